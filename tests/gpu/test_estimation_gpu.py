"""The Triton estimation kernels on a CUDA device, bit for bit against the PyTorch path (DESIGN.md §2.2).

The PyTorch definitions run on the same GPU (and, for a small case, on the CPU); logits are compared
bit pattern for bit pattern, scores and indices with ``torch.equal``. Shapes up to N = 32K, GQA 8:1
and 1:1, d = 64 and 128, bf16 and fp16, static and top-P budgets, and a striped key split whose
partial slash sums must add up exactly.

Run as a script to time one layer's estimation, the PyTorch path against the Triton one (not a test):
``python tests/gpu/test_estimation_gpu.py 131072 524288``.
"""

import statistics
import sys
from unittest import mock

import pytest
import torch
from host_reads import device_syncs

from mtraining_kernels import estimation, triton_estimation
from mtraining_kernels.budget import StaticBudget, TopPBudget
from mtraining_kernels.document_index import estimate_document_index
from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import Layout

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
BUDGETS = {
    "static": StaticBudget(2048, 4096),
    "top_p": TopPBudget(0.9, 4096),
    "top_p_blocks": TopPBudget(0.9, 4096, block_slashes=True),
}


def draw_qk(seed, batch, seq_len, q_heads, kv_heads, dim, dtype, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, seq_len, q_heads, dim, generator=gen, device=device).to(dtype)
    k = torch.randn(batch, seq_len, kv_heads, dim, generator=gen, device=device).to(dtype)
    k[:, torch.randint(0, seq_len, (16,), generator=gen, device=device)] *= 3.0  # a few strong columns
    return q, k


def positions(seq_len, device=DEVICE):
    return torch.arange(seq_len - 64, seq_len, device=device), torch.arange(seq_len, device=device)


@pytest.mark.parametrize(
    "batch, seq_len, q_heads, kv_heads, dim, dtype",
    [
        (2, 4096, 8, 1, 128, torch.bfloat16),
        (1, 8192, 4, 4, 64, torch.float16),
        (1, 32768, 16, 2, 128, torch.bfloat16),
    ],
)
def test_logits_are_bit_equal_to_the_pytorch_path(seed, batch, seq_len, q_heads, kv_heads, dim, dtype):
    q, k = draw_qk(seed, batch, seq_len, q_heads, kv_heads, dim, dtype)
    q_positions, k_positions = positions(seq_len)
    args = (q[:, seq_len - 64 :], q_positions, k, k_positions, dim**-0.5)
    got = triton_estimation.estimation_logits(*args)
    expected = estimation._torch_estimation_logits(*args)
    mismatches = int((got.view(torch.int32) != expected.view(torch.int32)).sum())
    assert mismatches == 0, f"seed={seed} N={seq_len}: {mismatches} logits differ from the PyTorch path on the GPU"
    if seq_len <= 4096:
        on_cpu = estimation._torch_estimation_logits(*(a.cpu() if torch.is_tensor(a) else a for a in args))
        assert torch.equal(got.cpu().view(torch.int32), on_cpu.view(torch.int32)), f"seed={seed}: CPU logits differ"


@pytest.mark.parametrize("mode", ["static", "top_p"])
def test_scores_are_bit_equal_to_the_pytorch_path(seed, mode):
    seq_len = 32768
    q, k = draw_qk(seed, 1, seq_len, 16, 2, 128, torch.bfloat16)
    q_positions, k_positions = positions(seq_len)
    logits = triton_estimation.estimation_logits(q[:, seq_len - 64 :], q_positions, k, k_positions, 128**-0.5)
    scores = {}
    for backend in ("torch", "triton"):
        scores[backend] = estimation.vertical_and_slash_scores(
            logits, mode == "top_p", q_positions, k_positions, seq_len, implementation=backend
        )
    for name, got, expected in zip(("V", "S"), scores["triton"], scores["torch"]):
        assert torch.equal(got, expected), f"seed={seed} {mode} {name}: {int((got != expected).sum())} differ"


@pytest.mark.parametrize("mode", ["static", "top_p"])
def test_partial_slash_sums_of_a_striped_split_add_up(seed, mode):
    """Four striped shards (runs of 128 positions): the shape of a rank's keys in distributed estimation."""
    seq_len, layout = 16384, Layout("striped", 4)
    q, k = draw_qk(seed, 1, seq_len, 8, 2, 128, torch.bfloat16)
    q_positions, k_positions = positions(seq_len)
    logits = triton_estimation.estimation_logits(q[:, seq_len - 64 :], q_positions, k, k_positions, 128**-0.5)
    expected_v, expected_s = estimation.vertical_and_slash_scores(
        logits, mode == "top_p", q_positions, k_positions, seq_len, implementation="torch"
    )
    row_max = logits.amax(dim=-1)
    row_sums = estimation.exp_fixed_point(logits, row_max).sum(dim=-1)
    rules, summed_s = estimation._fixed_point_rules(), torch.zeros_like(expected_s)
    for rank in range(layout.world_size):
        shard = layout.global_positions(seq_len, rank, device=DEVICE)
        shard_logits = logits[..., shard].contiguous()
        if mode == "static":
            local_v, local_s = triton_estimation.static_scores(shard_logits, q_positions, shard, seq_len, rules)
        else:
            local_v, local_s = triton_estimation.top_p_scores(
                shard_logits, q_positions, shard, seq_len, row_max, row_sums, rules
            )
        assert torch.equal(local_v, expected_v[..., shard]), f"seed={seed} {mode} rank {rank}: V differs"
        summed_s += local_s
    assert torch.equal(summed_s, expected_s), f"seed={seed} {mode}: the partial S do not add up"


@pytest.mark.parametrize("mode", ["static", "top_p", "top_p_blocks"])
@pytest.mark.parametrize("seq_len", [4096, 32768])
def test_index_is_identical_to_the_pytorch_path(seed, mode, seq_len):
    q, k = draw_qk(seed, 1, seq_len, 16, 2, 128, torch.bfloat16)
    indexes = {}
    for backend in ("torch", "auto"):
        indexes[backend] = estimation.estimate_vertical_slash(q, k, BUDGETS[mode], implementation=backend)
    if seq_len <= 4096:
        indexes["cpu"] = estimation.estimate_vertical_slash(q.cpu(), k.cpu(), BUDGETS[mode])
    for backend in indexes:
        for name, got, expected in zip(estimation.VerticalSlashIndex._fields, indexes["auto"], indexes[backend]):
            assert torch.equal(got.cpu(), expected.cpu()), f"seed={seed} {mode} N={seq_len}: {name} vs {backend}"


@pytest.mark.parametrize("mode", ["static", "top_p", "top_p_blocks"])
def test_estimation_waits_on_the_host_nowhere(seed, mode):
    """The index of one layer is queued without a host sync: the budget's sizes and the kernels' fp64 constants
    reach the device from pinned memory (they were three syncs in the 128K profile, docs/benchmarks.md)."""
    q, k = draw_qk(seed, 1, 4096, 16, 2, 128, torch.bfloat16)
    estimation.estimate_vertical_slash(q, k, BUDGETS[mode])  # compiles the kernels
    with device_syncs() as syncs:
        estimation.estimate_vertical_slash(q, k, BUDGETS[mode])
    assert syncs == [], f"seed={seed} {mode}: {len(syncs)} host syncs: {syncs[:3]}"


def test_packed_estimation_syncs_do_not_grow_with_the_documents(seed):
    """Per-document estimation runs one batched estimation per document length; its host syncs (the index's
    input checks, read once) must not come once per length group (63 syncs at 512K ProLong-like before)."""
    q, k = draw_qk(seed, 1, 16384, 16, 2, 128, torch.bfloat16)
    counts = {}
    for starts in ([0, 8192], [0, 4096, 6144, 10240, 12288, 14848]):
        documents = Documents(torch.tensor([starts], device=DEVICE), 16384)
        documents.host_spans  # the CPU copy of the spans, made once per batch
        estimate_document_index(q, k, documents, BUDGETS["static"], min_sparse_length=1024)  # compiles
        with device_syncs() as syncs:
            estimate_document_index(q, k, documents, BUDGETS["static"], min_sparse_length=1024)
        counts[len(starts)] = len(syncs)
    assert counts[2] == counts[6] <= 1, f"seed={seed}: host syncs by document count {counts}"


# ----------------------------------------------------------------------------------------------- timing
def _median_ms(step, repeats: int) -> float:
    step()  # warm-up (and Triton compilation)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_estimation(seq_len: int, q_heads: int = 16, kv_heads: int = 2, dim: int = 128) -> None:
    """Print median milliseconds of one layer's estimation (b = 1, bf16) through both paths."""
    q, k = draw_qk(0, 1, seq_len, q_heads, kv_heads, dim, torch.bfloat16)
    q_positions, k_positions = positions(seq_len)
    scale = dim**-0.5
    old_repeats = 2 if seq_len > 200_000 else 3
    tiles = {}
    for keys_per_tile, num_warps in ((64, 1), (64, 2), (128, 1), (128, 2), (128, 4), (256, 2), (256, 4)):
        tiles[f"{keys_per_tile}x{num_warps}w"] = round(
            _median_ms(
                lambda: triton_estimation.estimation_logits(
                    q[:, seq_len - 64 :],
                    q_positions,
                    k,
                    k_positions,
                    scale,
                    keys_per_tile=keys_per_tile,
                    num_warps=num_warps,
                ),
                5,
            ),
            2,
        )
    print(f"N={seq_len}: logits kernel ms by keys per tile x warps: {tiles}", flush=True)
    # the logits are bound as default arguments (not closed over): they are deleted before the peak-memory timings
    sweep_logits = triton_estimation.estimation_logits(q[:, seq_len - 64 :], q_positions, k, k_positions, scale)
    for mode in BUDGETS:
        tiles = {}
        for keys_per_tile, num_warps in ((32, 4), (64, 8), (128, 4), (128, 8), (128, 16), (256, 8), (256, 16)):
            with (
                mock.patch.object(triton_estimation, "SCORE_KEYS_PER_TILE", keys_per_tile),
                mock.patch.object(triton_estimation, "SCORE_NUM_WARPS", num_warps),
            ):
                tiles[f"{keys_per_tile}x{num_warps}w"] = round(
                    _median_ms(
                        lambda logits=sweep_logits: estimation.vertical_and_slash_scores(
                            logits, mode == "top_p", q_positions, k_positions, seq_len
                        ),
                        5,
                    ),
                    2,
                )
        print(f"N={seq_len} {mode}: score kernels ms by keys per tile x warps: {tiles}", flush=True)
    del sweep_logits
    for mode, budget in BUDGETS.items():
        torch.cuda.reset_peak_memory_stats()
        old = _median_ms(lambda: estimation.estimate_vertical_slash(q, k, budget, implementation="torch"), old_repeats)
        old_peak = torch.cuda.max_memory_allocated() / 2**30
        logits = triton_estimation.estimation_logits(q[:, seq_len - 64 :], q_positions, k, k_positions, scale)
        logits_ms = _median_ms(
            lambda: triton_estimation.estimation_logits(q[:, seq_len - 64 :], q_positions, k, k_positions, scale), 5
        )
        scores_ms = _median_ms(
            lambda logits=logits: estimation.vertical_and_slash_scores(
                logits, mode == "top_p", q_positions, k_positions, seq_len
            ),
            5,
        )
        del logits
        torch.cuda.reset_peak_memory_stats()
        new = _median_ms(lambda: estimation.estimate_vertical_slash(q, k, budget), 5)
        new_peak = torch.cuda.max_memory_allocated() / 2**30
        print(
            f"N={seq_len} Hq={q_heads} Hkv={kv_heads} d={dim} {mode}: pytorch path {old:.1f} ms "
            f"(peak {old_peak:.1f} GiB), triton path {new:.1f} ms (peak {new_peak:.1f} GiB) = logits "
            f"{logits_ms:.1f} + scores {scores_ms:.1f} + selection; speedup {old / new:.1f}x",
            flush=True,
        )


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for length in sys.argv[1:] or ["131072", "524288"]:
        time_estimation(int(length))
