"""The index conversion on a CUDA device: the Triton list kernels against the PyTorch path (DESIGN.md §2.6).

Both paths run on the same GPU on benchmark-like patterns (30 sinks + N/128 random verticals, window +
random slashes); every list must be ``torch.equal``. Up to N = 128K, layouts
contiguous (W = 1) and striped / zigzag (W = 2, both ranks).

Run as a script to time the conversion, PyTorch ops against the Triton kernels (not a test):
``python tests/gpu/test_index_gpu.py 131072 524288``.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_attention import budget_pattern, median_ms
from host_reads import device_syncs

from mtraining_kernels import index, triton_index
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.vertical_slash import slash_block_hits

pytestmark = pytest.mark.gpu
FIELDS = ("blk_ptr", "blk_col", "bar_ptr", "bar_col", "key_ptr", "key_qblock")


def convert(backend: str, v_idx, s_idx, layout: Layout, rank: int, seq_len: int) -> index.BlockBarIndex:
    return index.convert_index(v_idx, s_idx, layout, rank, seq_len, implementation=backend)


@pytest.mark.parametrize("seq_len", [32768, 131072])
@pytest.mark.parametrize("kind, world", [("contiguous", 1), ("striped", 2), ("zigzag", 2)])
def test_triton_lists_equal_the_pytorch_lists(seed, seq_len, kind, world):
    generator = torch.Generator().manual_seed(seed)
    v_idx, s_idx, _ = budget_pattern(1, 16, seq_len, 0.95, "cuda", generator)
    layout = Layout(kind, world)
    for rank in range(world):
        expected = convert("torch", v_idx, s_idx, layout, rank, seq_len)
        got = convert("triton", v_idx, s_idx, layout, rank, seq_len)
        assert got.bar_col.numel() > 0, "the pattern has no bars; the test would check nothing"
        for field in FIELDS:
            assert torch.equal(getattr(got, field), getattr(expected, field)), (
                f"seed={seed} N={seq_len} {kind} W={world} rank={rank}: {field} differs"
            )


def test_auto_uses_triton_on_cuda(seed, monkeypatch):
    calls = []
    original = triton_index.list_candidates
    monkeypatch.setattr(triton_index, "list_candidates", lambda *args: calls.append(1) or original(*args))
    v_idx, s_idx, _ = budget_pattern(1, 2, 8192, 0.9, "cuda", torch.Generator().manual_seed(seed))
    convert("auto", v_idx, s_idx, Layout("contiguous", 1), 0, 8192)
    assert calls == [1]


def test_the_triton_conversion_syncs_twice(seed):
    """The input checks and the lists' sizes are the conversion's only host reads (eight before,
    docs/benchmarks.md's 128K profile)."""
    v_idx, s_idx, _ = budget_pattern(1, 16, 32768, 0.95, "cuda", torch.Generator().manual_seed(seed))
    convert("triton", v_idx, s_idx, Layout("striped", 2), 1, 32768)  # compiles the kernels
    with device_syncs() as syncs:
        convert("triton", v_idx, s_idx, Layout("striped", 2), 1, 32768)
    assert len(syncs) == 2, f"seed={seed}: {len(syncs)} host syncs: {syncs}"


def test_the_unchecked_triton_conversion_syncs_once(seed):
    """``check_contents=False`` (our estimators' indices) leaves the one sync for the lists' sizes."""
    v_idx, s_idx, _ = budget_pattern(1, 16, 32768, 0.95, "cuda", torch.Generator().manual_seed(seed))
    convert("triton", v_idx, s_idx, Layout("striped", 2), 1, 32768)  # compiles the kernels
    with device_syncs() as syncs:
        index.convert_index(v_idx, s_idx, Layout("striped", 2), 1, 32768, "triton", check_contents=False)
    assert len(syncs) == 1, f"seed={seed}: {len(syncs)} host syncs: {syncs}"


if __name__ == "__main__":
    for n in [int(arg) for arg in sys.argv[1:]] or [131072, 524288]:
        v, s, _ = budget_pattern(1, 16, n, 0.95, "cuda", torch.Generator().manual_seed(0))
        timings = {
            name: median_ms(lambda: convert(name, v, s, Layout("contiguous", 1), 0, n), 5)
            for name in ("torch", "triton")
        }
        bars = convert("triton", v, s, Layout("contiguous", 1), 0, n).bar_col.numel()
        hit = slash_block_hits(s, n // BLOCK_SIZE, BLOCK_SIZE)
        query_blocks, source_blocks = index.block_tables(Layout("contiguous", 1), 0, n, v.device)
        blocks_ms = median_ms(lambda: index._block_lists(hit, query_blocks, source_blocks), 5)
        print(
            f"N={n}: conversion {timings['torch']:.1f} ms with PyTorch ops (block lists {blocks_ms:.1f} ms), "
            f"{timings['triton']:.1f} ms with the Triton kernels ({bars / 1e6:.1f} M bar entries, Hq = 16, "
            "95 % sparsity pattern)",
            flush=True,
        )
