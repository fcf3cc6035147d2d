"""Per-document index estimation on gloo CPU ranks vs the single-device estimator: bit-identical (PACKED.md)."""

import random
import re
import time

import pytest
import torch
import torch.distributed as dist

from megatron_mtraining.ring.document_estimation import estimate_document_index_distributed
from megatron_mtraining.ring.estimation import estimate_vertical_slash_distributed
from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
from mtraining_kernels.document_index import estimate_document_index
from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import LAYOUT_KINDS, Layout

SEQ_LEN = 1536  # every layout splits it for W in {2, 3} (striped with granularity 128)
BATCH, Q_HEADS, KV_HEADS, DIM = 2, 4, 2, 16
MIN_SPARSE = 128
# sample 0: documents straddling 128-token blocks and rank boundaries, dense ones of 40, 1 and 63 tokens
# among them, one of exactly MIN_SPARSE; sample 1 is drawn per case
FIXED_LENGTHS = [300, 40, 300, 217, 1, 63, MIN_SPARSE, 487]  # two of 300: one batched estimation
COLLECTIVE_TIMEOUT = 20.0  # seconds a gloo collective waits in the agreement test
PROMPT_SECONDS = 10.0  # an agreed error takes milliseconds; a stuck collective takes COLLECTIVE_TIMEOUT


MODES = ("static", "top-p", "top-p-blocks")  # top-p-blocks: slashes as whole block diagonals


def _random_lengths(rng: random.Random) -> list[int]:
    """Lengths summing to N: long documents and runs of short (dense) ones."""
    lengths, left = [], SEQ_LEN
    while left:
        length = min(left, rng.choice([rng.randint(1, MIN_SPARSE - 1), rng.randint(MIN_SPARSE, 700)]))
        lengths.append(length)
        left -= length
    return lengths


def _documents(rows: list[list[int]]) -> Documents:
    width = max(len(row) for row in rows)
    starts = [[sum(row[:d]) for d in range(len(row))] + [SEQ_LEN] * (width - len(row)) for row in rows]
    return Documents(torch.tensor(starts), SEQ_LEN)


def _make_case(rng: random.Random, kind: str, world: int, mode: str, one_document: bool = False) -> dict:
    """Random options for one estimation: documents, last_q, forced counts, budget (static sizes above some
    documents' lengths, so they are clamped), scale, dtype and the data seed."""
    sinks, window = rng.choice([(30, 100), (rng.randint(0, 30), rng.randint(0, 100))])
    if mode == "static":
        v_sizes = [rng.randint(max(sinks, 1), 300) for _ in range(Q_HEADS)]
        s_sizes = [rng.randint(max(window, 1), 400) for _ in range(Q_HEADS)]
        budget = rng.choice(
            [StaticBudget(v_sizes[0], s_sizes[0]), StaticHeadBudgets(torch.tensor(v_sizes), torch.tensor(s_sizes))]
        )
    else:
        cap = rng.randint(max(sinks, window, 1), 400)
        budget = TopPBudget(round(rng.uniform(0.5, 0.97), 3), cap, block_slashes=mode == "top-p-blocks")
    return dict(
        kind=kind,
        world=world,
        lengths=[[SEQ_LEN]] * BATCH if one_document else [FIXED_LENGTHS, _random_lengths(rng)],
        budget=budget,
        min_sparse_length=MIN_SPARSE,
        softmax_scale=rng.choice([None, 0.3]),
        last_q=rng.choice([64, rng.randint(1, 64)]),
        sink_tokens=sinks,
        local_window=window,
        dtype=rng.choice([torch.float32, torch.bfloat16]),
        data_seed=rng.randrange(2**31),
    )


def _inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Global q/k: noise, and in every sample 8 key columns equal to 2u while the estimation rows of every
    document share the direction u (exact vertical ties, across ranks)."""
    gen = torch.Generator().manual_seed(case["data_seed"])
    q = torch.randn(BATCH, SEQ_LEN, Q_HEADS, DIM, generator=gen)
    k = torch.randn(BATCH, SEQ_LEN, KV_HEADS, DIM, generator=gen)
    direction = torch.randn(BATCH, 1, Q_HEADS, DIM, generator=gen)
    for sample, row in enumerate(case["lengths"]):
        for end in (sum(row[: d + 1]) for d in range(len(row))):
            q[sample, max(end - case["last_q"], 0) : end] += direction[sample]
    tied = torch.randperm(SEQ_LEN, generator=gen)[:8]
    k[:, tied] = 2 * direction[:, :, :: Q_HEADS // KV_HEADS]
    return q.to(case["dtype"]), k.to(case["dtype"])


def _options(case: dict) -> dict:
    return {
        name: case[name] for name in ("min_sparse_length", "softmax_scale", "last_q", "sink_tokens", "local_window")
    }


def _layout(case: dict) -> Layout:
    return Layout(case["kind"], case["world"])


def _estimate_shard(case: dict, rank: int, group: dist.ProcessGroup | None = None):
    """The distributed estimate of ``case`` by CP rank ``rank`` of ``group`` (None: the world): (sparse, v_idx,
    s_idx, starts, clamped)."""
    layout, (q, k) = _layout(case), _inputs(case)
    index, clamped = estimate_document_index_distributed(
        layout.shard(q, rank),
        layout.shard(k, rank),
        _documents(case["lengths"]),
        case["budget"],
        layout,
        group,
        **_options(case),
    )
    return index.sparse, index.v_idx, index.s_idx, index.documents.starts, clamped


def _estimate_on_world(rank, world_size, cases, one_document_cases):
    """Every case's per-document estimate; for the one-document cases also the unpacked distributed index."""
    packed = [_estimate_shard(case, rank) for case in cases]
    unpacked = []
    for case in one_document_cases:
        layout, (q, k) = _layout(case), _inputs(case)
        options = {name: case[name] for name in ("softmax_scale", "last_q", "sink_tokens", "local_window")}
        index = estimate_vertical_slash_distributed(
            layout.shard(q, rank), layout.shard(k, rank), case["budget"], layout, dist.group.WORLD, **options
        )
        unpacked.append((_estimate_shard(case, rank), tuple(index)))
    return packed, unpacked


def _check_bitwise(case: dict, per_rank: list, seed: int) -> None:
    q, k = _inputs(case)
    index, clamped = estimate_document_index(q, k, _documents(case["lengths"]), case["budget"], **_options(case))
    expected = (index.sparse, index.v_idx, index.s_idx, index.documents.starts)
    for rank, got in enumerate(per_rank):
        for name, ours, theirs in zip(("sparse", "v_idx", "s_idx", "starts"), got, expected):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (
                f"{name} differs on rank {rank} (seed={seed}, case={case})"
            )
        assert got[4] == clamped, f"clamped documents differ on rank {rank} (seed={seed}, case={case})"


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_document_index_is_bitwise_the_single_device_one(distributed, seed, world):
    rng = random.Random(seed)
    cases = [_make_case(rng, kind, world, mode) for kind in LAYOUT_KINDS for mode in MODES]
    one_document_cases = [_make_case(rng, kind, world, rng.choice(MODES), True) for kind in LAYOUT_KINDS]
    packed, unpacked = zip(*distributed(_estimate_on_world, world, cases, one_document_cases))
    for number, case in enumerate(cases):
        _check_bitwise(case, [by_rank[number] for by_rank in packed], seed)
    assert any(clamped for by_rank in packed for *_, clamped in by_rank), f"no budget was clamped (seed={seed})"
    for number, case in enumerate(one_document_cases):
        _check_bitwise(case, [by_rank[number][0] for by_rank in unpacked], seed)
        for rank, by_rank in enumerate(unpacked):
            (sparse, v_idx, s_idx, _, _), whole = by_rank[number]
            assert sparse.all(), f"seed={seed} case={case}"
            assert torch.equal(v_idx[:, 0], whole[0]) and torch.equal(s_idx[:, 0], whole[1]), (
                f"one document differs from the unpacked distributed index on rank {rank} (seed={seed}, case={case})"
            )


def _estimate_on_subgroups(rank, world_size, members, cases_by_group):
    """Every rank joins the group of ``members`` that lists it and estimates that group's cases."""
    groups = [dist.new_group(ranks) for ranks in members]
    mine = next(i for i, ranks in enumerate(members) if rank in ranks)
    try:
        cp_rank = dist.get_rank(groups[mine])
        return mine, [_estimate_shard(case, cp_rank, groups[mine]) for case in cases_by_group[mine]]
    finally:
        dist.destroy_process_group(groups[mine])


def test_cp_groups_that_are_not_the_world_run_concurrently(distributed, seed):
    """Two CP groups of non-adjacent global ranks (as with TP = 2 inside), each with its own data."""
    rng = random.Random(seed)
    members = [[0, 2], [1, 3]]
    cases_by_group = [[_make_case(rng, rng.choice(LAYOUT_KINDS), 2, mode)] for mode in ("static", "top-p")]
    results = distributed(_estimate_on_subgroups, 4, members, cases_by_group)
    for group_id, ranks in enumerate(members):
        assert [results[r][0] for r in ranks] == [group_id] * len(ranks)
        _check_bitwise(cases_by_group[group_id][0], [results[r][1][0] for r in ranks], seed)


# ------------------------------------------------------------------------------------------ agreement
def _disagreeing_calls(rank, world_size, case):
    """Rank 1 passes other boundaries, then another min_sparse_length: every rank's message and seconds;
    then every rank makes the good call."""
    layout, (q, k) = _layout(case), _inputs(case)
    q_local, k_local = layout.shard(q, rank), layout.shard(k, rank)

    def estimate(lengths=case["lengths"], **changes):
        options = _options(case) | changes
        return estimate_document_index_distributed(
            q_local, k_local, _documents(lengths), case["budget"], layout, dist.group.WORLD, **options
        )

    shifted = [[FIXED_LENGTHS[0] + 1, FIXED_LENGTHS[1] - 1, *FIXED_LENGTHS[2:]], case["lengths"][1]]
    bad_calls = {
        "boundaries": lambda: estimate(lengths=shifted if rank == 1 else case["lengths"]),
        "min_sparse_length": lambda: estimate(min_sparse_length=MIN_SPARSE + (rank == 1)),
    }
    outcomes = {}
    for name, call in bad_calls.items():
        start = time.monotonic()
        with pytest.raises(ValueError) as raised:
            call()
        outcomes[name] = (str(raised.value), time.monotonic() - start)
    index, clamped = estimate()
    return outcomes, (index.sparse, index.v_idx, index.s_idx, index.documents.starts, clamped)


EXPECTED_DISAGREEMENT = {
    "boundaries": r"disagree on \{'document starts\[1\]': \[300, 301, 300\]",
    "min_sparse_length": r"disagree on \{'min_sparse_length': \[128, 129, 128\]",
}


def test_ranks_with_other_boundaries_all_raise_promptly_then_a_good_call_works(seed):
    from harness import run_on_ranks

    case = _make_case(random.Random(seed), "striped", 3, "top-p")
    results = run_on_ranks(
        _disagreeing_calls, 3, case, timeout=4 * COLLECTIVE_TIMEOUT, collective_timeout=COLLECTIVE_TIMEOUT
    )
    for name, pattern in EXPECTED_DISAGREEMENT.items():
        for rank, (outcomes, _) in enumerate(results):
            message, seconds = outcomes[name]
            assert re.search(pattern, message) and seconds < PROMPT_SECONDS, (name, rank, message, seconds)
    _check_bitwise(case, [good for _, good in results], seed)
