"""The Triton list kernel (kernels/mtraining_kernels/triton_index.py) run by Triton's CPU interpreter:
the conversion with it equals the PyTorch conversion element for element, for every layout, W and rank."""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter tests run only on machines without CUDA"
)
pytest.importorskip("triton")

from host_reads import HostReads
from test_index import FIELDS, random_index

from mtraining_kernels import index, triton_index
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.vertical_slash import slash_block_hits

if type(triton_index._list_rows_kernel).__name__ != "InterpretedFunction":
    importlib.reload(triton_index)  # imported earlier without the interpreter flag


def convert_with(backend: str, *args) -> index.BlockBarIndex:
    return index.convert_index(*args, implementation=backend)


LAYOUTS = [("contiguous", 1), ("contiguous", 2), ("zigzag", 2), ("zigzag", 3), ("striped", 2), ("striped", 4)]


@pytest.mark.parametrize("kind, world", LAYOUTS)
def test_triton_bar_lists_equal_the_pytorch_ones(seed, kind, world):
    generator = torch.Generator().manual_seed(seed)
    layout = Layout(kind, world)
    seq_len = 2 * world * BLOCK_SIZE * 3  # 6 blocks per rank: zigzag needs 2 chunks each
    # wide enough that a row's candidates span more than one loop step of the kernel
    v_width = triton_index.CANDIDATES_PER_STEP + 64
    v_idx, s_idx = random_index(generator, 2, 3, seq_len, min(v_width, seq_len // 4), 24)
    for rank in range(world):
        expected = convert_with("torch", v_idx, s_idx, layout, rank, seq_len)
        got = convert_with("triton", v_idx, s_idx, layout, rank, seq_len)
        for field in FIELDS:
            assert torch.equal(getattr(got, field), getattr(expected, field)), (
                f"seed={seed} {kind} W={world} rank={rank}: {field} differs"
            )
        assert got.bar_col.dtype == torch.int32 and got.bar_ptr.dtype == torch.int32


def test_many_verticals_and_no_verticals(seed):
    """Every column a vertical (rows with hundreds of bars over several loop steps), then none at all."""
    generator = torch.Generator().manual_seed(seed)
    seq_len, layout = 16 * BLOCK_SIZE, Layout("striped", 2)
    full = torch.arange(seq_len, dtype=torch.int32).expand(1, 2, seq_len).contiguous()
    _, s_idx = random_index(generator, 1, 2, seq_len, 4, 8)
    empty = torch.full((1, 2, 64), seq_len, dtype=torch.int32)
    for v_idx in (full, empty):
        for rank in range(2):
            expected = convert_with("torch", v_idx, s_idx, layout, rank, seq_len)
            got = convert_with("triton", v_idx, s_idx, layout, rank, seq_len)
            for field in FIELDS:
                assert torch.equal(getattr(got, field), getattr(expected, field)), f"seed={seed}: {field}"
    assert expected.bar_col.numel() == 0


def test_rows_longer_than_one_loop_step_of_blocks(seed):
    """160 query blocks, a slash on every block diagonal and random verticals: the last rows hold more blocks
    than one kernel loop step reads."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = 160 * BLOCK_SIZE
    v_idx, _ = random_index(generator, 1, 2, seq_len, 16, 4)
    s_idx = torch.arange(0, seq_len, BLOCK_SIZE, dtype=torch.int32).expand(1, 2, -1).contiguous()
    expected = convert_with("torch", v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
    got = convert_with("triton", v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
    longest = int((expected.blk_ptr[..., 1:] - expected.blk_ptr[..., :-1]).max()) // 2
    assert longest > triton_index.CANDIDATES_PER_STEP, f"longest block row {longest}: the test checks one step only"
    for field in FIELDS:
        assert torch.equal(getattr(got, field), getattr(expected, field)), f"seed={seed}: {field} differs"


def test_the_triton_conversion_reads_the_host_twice(seed):
    """On a GPU each host read is a sync: the Triton conversion makes two, the input checks (all four
    conditions at once) and every list's size (blocks and bars at once); it made eight."""
    generator = torch.Generator().manual_seed(seed)
    layout, seq_len = Layout("striped", 2), 2 * 2 * BLOCK_SIZE * 3
    v_idx, s_idx = random_index(generator, 2, 3, seq_len, 24, 24)
    with HostReads() as reads:
        got = convert_with("triton", v_idx, s_idx, layout, 1, seq_len)
    assert got.bar_col.numel() > 0 and got.blk_col.numel() > 0
    assert [site.split(" ")[1] for site in reads.sites] == ["tolist", "tolist"], reads.sites


def test_the_unchecked_triton_conversion_reads_the_host_once(seed):
    """``check_contents=False`` (an index valid by construction) drops the input checks' host read; the lists'
    sizes are the one read left, and the lists are the checked conversion's."""
    generator = torch.Generator().manual_seed(seed)
    layout, seq_len = Layout("striped", 2), 2 * 2 * BLOCK_SIZE * 3
    v_idx, s_idx = random_index(generator, 2, 3, seq_len, 24, 24)
    checked = convert_with("triton", v_idx, s_idx, layout, 1, seq_len)
    with HostReads() as reads:
        unchecked = index.convert_index(v_idx, s_idx, layout, 1, seq_len, "triton", check_contents=False)
    assert [site.split(" ")[1] for site in reads.sites] == ["tolist"], reads.sites
    for field in FIELDS:
        assert torch.equal(getattr(unchecked, field), getattr(checked, field)), f"seed={seed}: {field} differs"


def test_after_its_host_read_the_conversion_launches_only_the_write(seed, monkeypatch):
    """One kernel launch finds the block hits and one counts the three lists (blocks, by key, bars) before the host
    read of their sizes, and one writes them after it: on a GPU the host launches nothing else while the device
    waits for it."""
    generator = torch.Generator().manual_seed(seed)
    layout, seq_len = Layout("striped", 2), 2 * 2 * BLOCK_SIZE * 3
    v_idx, s_idx = random_index(generator, 2, 3, seq_len, 24, 24)
    timeline: list[str] = []
    kernel_type = type(triton_index._list_rows_kernel)
    launch = kernel_type.run

    def recorded_launch(kernel, *args, **kwargs):
        timeline.append(f"launch {kernel.fn.__name__}")
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(kernel_type, "run", recorded_launch)
    with HostReads() as reads:
        reads.sites = timeline  # host reads and launches in one order
        got = index.convert_index(v_idx, s_idx, layout, 1, seq_len, "triton", check_contents=False)
    steps = [event if event.startswith("launch") else event.split(" ")[1] for event in timeline]  # "file:line op"
    launches = ["launch _block_hits_kernel", "launch _list_rows_kernel", "tolist", "launch _list_rows_kernel"]
    assert steps == launches, timeline
    assert got.blk_col.numel() and got.key_qblock.numel() == got.blk_col.numel() // 2 and got.bar_col.numel()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_triton_block_hits_equal_the_pytorch_ones(seed, dtype):
    """The hits kernel against ``vertical_slash.slash_block_hits``: rows longer than a loop step of offsets and of
    blocks, sentinels N, offsets on block edges, and out-of-range values (which switch on δ = 0 only)."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = triton_index.HITS_PER_STEP + 37
    seq_len = num_blocks * BLOCK_SIZE
    width = triton_index.HITS_PER_STEP + 300
    s_idx = torch.randint(0, seq_len, (2, 3, width), generator=generator)
    s_idx[:, :, :40] = torch.randint(0, num_blocks, (2, 3, 40), generator=generator) * BLOCK_SIZE  # block edges
    s_idx[:, :, 40:60] = seq_len  # sentinels
    s_idx[0, 1, 60:70] = torch.tensor([-1, -BLOCK_SIZE, seq_len + 1, 2 * seq_len, seq_len - 1, 1, 127, 128, 129, 0])
    s_idx[1, 2] = seq_len  # a row of sentinels only
    s_idx = s_idx.to(dtype)
    expected = slash_block_hits(s_idx, num_blocks, BLOCK_SIZE)
    got = triton_index.slash_block_hits(s_idx, num_blocks, BLOCK_SIZE)
    assert got.dtype == torch.bool and got.is_contiguous()
    assert torch.equal(got, expected), f"seed={seed} {dtype}: {(got != expected).nonzero()[:5].tolist()}"
    assert torch.equal(
        triton_index.slash_block_hits(s_idx[..., :0], 5, BLOCK_SIZE), slash_block_hits(s_idx[..., :0], 5)
    )
