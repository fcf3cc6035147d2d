"""The Triton estimation kernels on a CUDA device (DESIGN.md §2.2).

The tensor-core logits are held to the fp64 definition within fp32 rounding and to themselves bit for bit
whichever keys share a tile; the integer scores of the fused passes to the PyTorch scoring of the same
logits (``torch.equal``), per key shard too, the index to the PyTorch selection, and the ranking by radix select
to the ranking by sort. Shapes up to N = 32K (the ranking up to 128K), GQA 8:1 and 1:1, d = 48, 64 and 128,
bf16, fp16 and fp32, static and top-P budgets.

Run as a script to time one layer's estimation, each Triton pass, the PyTorch path against the Triton one and the
per-document estimation of packed mixtures (not a test): ``python tests/gpu/test_estimation_gpu.py 131072 524288``.
"""

import statistics
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from host_reads import device_syncs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_attention import QUEUE_LEAD_MS, median_ms
from document_mixtures import MIXTURES

from mtraining_kernels import estimation, triton_estimation
from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
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


def pair_logits_match(got, expected):
    """Assert-ready (ok, message): equal masks, and finite logits within fp32 rounding of a d-term dot."""
    masks_equal = torch.equal(torch.isneginf(got), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    error = (got[finite].double() - expected[finite].double()).abs().max().item()
    return masks_equal and error < 1e-4, f"masks equal {masks_equal}, largest error {error:.3g}"


@pytest.mark.parametrize(
    "batch, seq_len, q_heads, kv_heads, dim, dtype",
    [
        (2, 4096, 8, 1, 128, torch.bfloat16),
        (1, 8192, 4, 4, 64, torch.float16),
        (1, 3000, 4, 2, 48, torch.bfloat16),  # d below a power of two, N not a multiple of the tile
        (1, 2500, 4, 1, 128, torch.float32),  # fp32 operands: IEEE products
        (1, 32768, 16, 2, 128, torch.bfloat16),
    ],
)
def test_logits_are_a_function_of_each_pair(seed, batch, seq_len, q_heads, kv_heads, dim, dtype):
    """Tensor-core logits: within fp32 rounding of the fp64 definition, and bit for bit the same whichever keys
    share their tile (shuffled keys, a striped shard), which is what makes a rank's logits those of one device."""
    q, k = draw_qk(seed, batch, seq_len, q_heads, kv_heads, dim, dtype)
    q_positions, k_positions = positions(seq_len)
    q_rows, scale = q[:, seq_len - 64 :], dim**-0.5
    got = triton_estimation.estimation_logits(q_rows, q_positions, k, k_positions, scale)
    expected = estimation._torch_estimation_logits(q_rows.double(), q_positions, k.double(), k_positions, scale)
    ok, message = pair_logits_match(got, expected)
    assert ok, f"seed={seed} N={seq_len} {dtype}: {message}"
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for name, keys in (
        ("shuffled", torch.randperm(seq_len, generator=gen, device=DEVICE)[: seq_len // 2 + 7]),
        ("striped", torch.arange(seq_len, device=DEVICE)[(torch.arange(seq_len, device=DEVICE) // 128) % 3 == 1]),
    ):
        shard = triton_estimation.estimation_logits(q_rows, q_positions, k[:, keys], keys, scale)
        assert torch.equal(shard.view(torch.int32), got[..., keys].view(torch.int32)), f"seed={seed} {name} keys"


@pytest.mark.parametrize("mode", ["static", "top_p"])
def test_fused_scores_are_the_pytorch_scores_of_the_same_logits(seed, mode):
    """The passes recompute their logits tile by tile; their integers equal the PyTorch scoring of the stored
    logits (so every pass saw the very same logits)."""
    seq_len = 32768
    q, k = draw_qk(seed, 1, seq_len, 16, 2, 128, torch.bfloat16)
    q_positions, k_positions = positions(seq_len)
    q_rows, scale = q[:, seq_len - 64 :], 128**-0.5
    logits = triton_estimation.estimation_logits(q_rows, q_positions, k, k_positions, scale)
    expected = estimation.vertical_and_slash_scores(
        logits, mode == "top_p", q_positions, k_positions, seq_len, implementation="torch"
    )
    for source in ("stored", "fused", "fused, consecutive keys"):
        if source == "stored":
            got = estimation.vertical_and_slash_scores(logits, mode == "top_p", q_positions, k_positions, seq_len)
        else:
            run = seq_len if source == "fused, consecutive keys" else None  # the passes skip their check
            got = estimation.scores_of_keys(
                q_rows, q_positions, k, k_positions, scale, mode == "top_p", seq_len, consecutive_key_run=run
            )
        for name, a, b in zip(("V", "S"), got, expected):
            assert torch.equal(a, b), f"seed={seed} {mode} {source} {name}: {int((a != b).sum())} differ"


@pytest.mark.parametrize("mode", ["static", "top_p"])
@pytest.mark.parametrize("split", ["striped", "shuffled"])
def test_scores_of_a_key_split_add_up(seed, mode, split):
    """Four shards of keys, each scored alone from q and k (runs of 128 positions, a rank's keys in distributed
    estimation, said to be consecutive per tile as that estimator does; or random keys, the pair-by-pair path):
    V and the row statistics per shard, and the sum of the partial S, equal one device's."""
    seq_len, layout = 16384, Layout("striped", 4)
    q, k = draw_qk(seed, 1, seq_len, 8, 2, 128, torch.bfloat16)
    q_positions, k_positions = positions(seq_len)
    q_rows, scale = q[:, seq_len - 64 :], 128**-0.5
    logits = triton_estimation.estimation_logits(q_rows, q_positions, k, k_positions, scale)
    expected_v, expected_s = estimation.vertical_and_slash_scores(
        logits, mode == "top_p", q_positions, k_positions, seq_len, implementation="torch"
    )
    row_max = logits.amax(dim=-1)
    row_sums = estimation.exp_fixed_point(logits, row_max).sum(dim=-1)
    rules, summed_s = estimation._fixed_point_rules(), torch.zeros_like(expected_s)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    shards = (
        [layout.global_positions(seq_len, rank, device=DEVICE) for rank in range(4)]
        if split == "striped"
        else torch.randperm(seq_len, generator=gen, device=DEVICE).chunk(4)
    )
    consecutive = split == "striped"
    for rank, shard in enumerate(shards):
        source = triton_estimation.QueryKeyTiles(q_rows, k[:, shard], scale)
        if mode == "static":
            local_v, local_s = triton_estimation.static_scores(source, q_positions, shard, seq_len, rules, consecutive)
        else:
            local_max = triton_estimation.row_maxima(source, q_positions, shard)
            local_sums = triton_estimation.exp_row_sums(source, q_positions, shard, row_max, rules)
            assert torch.equal(local_max, logits[..., shard].amax(dim=-1)), f"seed={seed} rank {rank}: row maxima"
            expected_sums = estimation.exp_fixed_point(logits[..., shard], row_max).sum(dim=-1)
            assert torch.equal(local_sums, expected_sums), f"seed={seed} rank {rank}: row sums"
            local_v, local_s = triton_estimation.top_p_scores(
                source, q_positions, shard, seq_len, row_max, row_sums, rules, consecutive_keys=consecutive
            )
        assert torch.equal(local_v, expected_v[..., shard]), f"seed={seed} {mode} {split} rank {rank}: V differs"
        summed_s += local_s
    assert torch.equal(summed_s, expected_s), f"seed={seed} {mode} {split}: the partial S do not add up"


@pytest.mark.parametrize("mode", ["static", "top_p", "top_p_blocks"])
@pytest.mark.parametrize("seq_len", [4096, 32768])
def test_index_is_the_pytorch_selection_of_the_same_logits(seed, mode, seq_len):
    """The Triton estimation's index is the PyTorch path's once that path is handed the tensor-core logits; from
    its own sequential-sum logits it may differ where two candidates' scores differ by the rounding."""
    q, k = draw_qk(seed, 1, seq_len, 16, 2, 128, torch.bfloat16)
    got = estimation.estimate_vertical_slash(q, k, BUDGETS[mode])
    with mock.patch.object(estimation, "_torch_estimation_logits", triton_estimation.estimation_logits):
        expected = estimation.estimate_vertical_slash(q, k, BUDGETS[mode], implementation="torch")
    for name, a, b in zip(estimation.VerticalSlashIndex._fields, got, expected):
        assert torch.equal(a, b), f"seed={seed} {mode} N={seq_len}: {name} differs"


@pytest.mark.parametrize("seq_len", [4096, 131072])
def test_ranking_by_selection_is_the_ranking_by_sort(seed, seq_len):
    """The Triton ranking (radix select of the first entries, then a sort of those) equals the full stable sort, on
    the static scores of real q/k and on scores with exact ties across the limit."""
    q, k = draw_qk(seed, 1, seq_len, 16, 2, 128, torch.bfloat16)
    q_positions, k_positions = positions(seq_len)
    rules = estimation._fixed_point_rules()
    source = triton_estimation.QueryKeyTiles(q[:, seq_len - 64 :], k, 128**-0.5)
    v_scores, s_scores = triton_estimation.static_scores(source, q_positions, k_positions, seq_len, rules)
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    ties = torch.randint(-3, 3, v_scores.shape, generator=generator, device=DEVICE) << 40
    indices = k_positions.expand_as(v_scores)
    for name, scores in (("V", v_scores), ("S", s_scores), ("ties", ties)):
        for forced, limit in ((30, 1024), (100, 6016)):
            got = estimation.rank_candidates(scores, indices, forced, min(limit, seq_len - 1), True)
            expected = estimation.rank_candidates(scores, indices, forced, min(limit, seq_len - 1), True, "torch")
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (
                f"seed={seed} N={seq_len} {name} limit={limit}: the selection ranks differently"
            )


@pytest.mark.parametrize("mode", ["static", "top_p", "top_p_blocks"])
def test_estimation_waits_on_the_host_nowhere(seed, mode):
    """The index of one layer is queued without a host sync: the budget's sizes and the kernels' constants
    reach the device from pinned memory (they were three syncs in the 128K profile, docs/benchmarks.md)."""
    q, k = draw_qk(seed, 1, 4096, 16, 2, 128, torch.bfloat16)
    estimation.estimate_vertical_slash(q, k, BUDGETS[mode])  # compiles the kernels
    with device_syncs() as syncs:
        estimation.estimate_vertical_slash(q, k, BUDGETS[mode])
    assert syncs == [], f"seed={seed} {mode}: {len(syncs)} host syncs: {syncs[:3]}"


@pytest.mark.parametrize("mode", sorted(BUDGETS))
def test_packed_index_is_each_documents_own_triton_index(mode, seed):
    """All documents ranked at once (document_selection) on the Triton scores: each document's lists equal
    the Triton estimate of the document alone, shifted (documents of one length share a score pass)."""
    q, k = draw_qk(seed, 2, 16384, 16, 2, 128, torch.bfloat16)
    starts = [[0, 4096, 6144, 10240, 12288, 14848], [0, 2048, 6144, 10240, 16384, 16384]]
    documents = Documents(torch.tensor(starts, device=DEVICE), 16384)
    index, _ = estimate_document_index(q, k, documents, BUDGETS[mode], min_sparse_length=2048)
    for sample, document in index.sparse.nonzero().tolist():
        start, length = documents.host_spans[sample, document].tolist()
        budget = BUDGETS[mode]
        if isinstance(budget, StaticBudget):
            budget = StaticBudget(min(budget.v_size, length), min(budget.s_size, length))
        own = estimation.estimate_vertical_slash(
            q[sample : sample + 1, start : start + length], k[sample : sample + 1, start : start + length], budget
        )
        for got, lists, counts, shift in (
            (index.v_idx, own.v_idx, own.v_cnt, start),
            (index.s_idx, own.s_idx, own.s_cnt, 0),
        ):
            for head in range(16):
                count = int(counts[0, head])
                message = f"seed={seed} {mode} sample={sample} document={document} head={head}"
                assert torch.equal(got[sample, document, head, :count] - shift, lists[0, head, :count]), message
                assert got[sample, document, head, count:].eq(16384).all(), message


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
    """Print median milliseconds of one layer's estimation (b = 1, bf16): the PyTorch path, the Triton path,
    and the Triton scores alone (the fused passes), with the peak memory of both paths."""
    q, k = draw_qk(0, 1, seq_len, q_heads, kv_heads, dim, torch.bfloat16)
    q_positions, k_positions = positions(seq_len)
    scale = dim**-0.5
    old_repeats = 2 if seq_len > 200_000 else 3
    for mode, budget in BUDGETS.items():
        torch.cuda.reset_peak_memory_stats()
        old = _median_ms(lambda: estimation.estimate_vertical_slash(q, k, budget, implementation="torch"), old_repeats)
        old_peak = torch.cuda.max_memory_allocated() / 2**30
        scores_ms = _median_ms(
            lambda: estimation.scores_of_keys(
                q[:, seq_len - 64 :], q_positions, k, k_positions, scale, mode != "static", seq_len
            ),
            5,
        )
        torch.cuda.reset_peak_memory_stats()
        new = _median_ms(lambda: estimation.estimate_vertical_slash(q, k, budget), 5)
        new_peak = torch.cuda.max_memory_allocated() / 2**30
        print(
            f"N={seq_len} Hq={q_heads} Hkv={kv_heads} d={dim} {mode}: pytorch path {old:.1f} ms "
            f"(peak {old_peak:.1f} GiB), triton path {new:.2f} ms (peak {new_peak:.1f} GiB) = scores "
            f"{scores_ms:.2f} + selection; speedup {old / new:.1f}x",
            flush=True,
        )


def time_passes(seq_len: int, q_heads: int = 16, kv_heads: int = 2, dim: int = 128) -> None:
    """Print the GPU ms of each Triton pass and of the ranking (b = 1, bf16), queued behind a sleep kernel so the
    host launches do not count: the table "Where the estimation's time goes" of docs/benchmarks.md."""
    q, k = draw_qk(0, 1, seq_len, q_heads, kv_heads, dim, torch.bfloat16)
    q_positions, k_positions = positions(seq_len)
    rules, rows = estimation._fixed_point_rules(), q[:, seq_len - 64 :]
    source = triton_estimation.QueryKeyTiles(rows, k, dim**-0.5)
    row_max = triton_estimation.row_maxima(source, q_positions, k_positions)
    row_sums = triton_estimation.exp_row_sums(source, q_positions, k_positions, row_max, rules)
    v_scores, s_scores = triton_estimation.static_scores(source, q_positions, k_positions, seq_len, rules)
    keys = k_positions.expand_as(v_scores)
    static_lists = StaticHeadBudgets.uniform(StaticBudget(1000, 6000), q_heads)
    steps = {
        "stored logits": lambda: triton_estimation.estimation_logits(rows, q_positions, k, k_positions, dim**-0.5),
        "row maxima": lambda: triton_estimation.row_maxima(source, q_positions, k_positions),
        "row sums": lambda: triton_estimation.exp_row_sums(source, q_positions, k_positions, row_max, rules),
        "static V + S": lambda: triton_estimation.static_scores(source, q_positions, k_positions, seq_len, rules),
        "static V + S, consecutive keys": lambda: triton_estimation.static_scores(
            source, q_positions, k_positions, seq_len, rules, consecutive_keys=True
        ),
        "top-P V + S": lambda: triton_estimation.top_p_scores(
            source, q_positions, k_positions, seq_len, row_max, row_sums, rules
        ),
        "top-P V only": lambda: triton_estimation.top_p_scores(
            source, q_positions, k_positions, seq_len, row_max, row_sums, rules, slashes=False
        ),
        "rank V": lambda: estimation.rank_candidates(v_scores, keys, 30, 1024, True),
        "rank S": lambda: estimation.rank_candidates(s_scores, keys, 100, 6016, True),
        "rank V and S, one selection": lambda: estimation.rank_candidate_groups(
            [(v_scores, keys, 30, 1024), (s_scores, keys, 100, 6016)], True
        ),
        "rank V by sort": lambda: estimation.rank_candidates(v_scores, keys, 30, 1024, True, "torch"),
        "rank S by sort": lambda: estimation.rank_candidates(s_scores, keys, 100, 6016, True, "torch"),
        "static lists V and S, one selection": lambda: estimation.select_index(
            v_scores, keys, s_scores, keys, static_lists, None, seq_len, 30, 100, candidates_ascending=True
        ),
        "static estimation": lambda: estimation.estimate_vertical_slash(q, k, StaticBudget(1000, 6000)),
    }
    timings = {name: round(median_ms(step, 10, QUEUE_LEAD_MS), 3) for name, step in steps.items()}
    print(f"N={seq_len}: queued GPU ms {timings}", flush=True)


def time_packed_estimation(seq_len: int) -> None:
    """Print the per-document estimation's median ms (b = 1, Qwen2.5-3B heads, bf16), launched and queued behind a
    sleep kernel, per mixture of ``tools/document_mixtures.py`` and budget: docs/benchmarks.md, "Packed index"."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq_len, 16, 128, generator=gen).to(DEVICE, torch.bfloat16)
    k = torch.randn(1, seq_len, 2, 128, generator=gen).to(DEVICE, torch.bfloat16)
    budgets = {"static": StaticBudget(4160, 4160), **{mode: BUDGETS[mode] for mode in ("top_p", "top_p_blocks")}}
    for mode, budget in budgets.items():
        for mixture in ("prolong", "uniform4k", "single"):
            starts = MIXTURES[mixture](seq_len, 0).starts.to(DEVICE)
            documents = Documents(starts, seq_len)
            step = lambda: estimate_document_index(q, k, documents, budget, min_sparse_length=4096)  # noqa: E731
            print(
                f"N={seq_len} {mode} {mixture}: packed estimation {median_ms(step, 5):.2f} ms, "
                f"queued {median_ms(step, 5, QUEUE_LEAD_MS):.2f} ms",
                flush=True,
            )


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for length in sys.argv[1:] or ["131072", "524288"]:
        time_passes(int(length))
        time_estimation(int(length))
        time_packed_estimation(int(length))
