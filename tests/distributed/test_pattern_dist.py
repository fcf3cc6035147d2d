"""Distributed index estimation on gloo CPU ranks vs the single-device estimator: bit-identical (DESIGN.md §2.2)."""

import random
import re

import pytest
import torch
import torch.distributed as dist

from megatron_mtraining.ring.estimation import estimate_vertical_slash_distributed
from megatron_mtraining.ring.estimation_comm import _halo_sends
from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
from mtraining_kernels.estimation import estimate_vertical_slash
from mtraining_kernels.layout import LAYOUT_KINDS, Layout

SEQ_LEN = 384  # every layout splits it for W in {2, 3, 4} (striped with granularity 16 or 32)
BATCH, Q_HEADS, KV_HEADS, DIM = 2, 4, 2, 32
FIELDS = ("v_idx", "s_idx", "v_cnt", "s_cnt")


# ------------------------------------------------------------------------------------------------ cases
MODES = ("static", "top-p", "top-p-blocks")  # top-p-blocks: slashes as whole block diagonals


def _make_case(rng: random.Random, kind: str, world: int, mode: str) -> dict:
    """Random options for one estimation: layout, last_q that one rank holds, forced counts, budget, dtype."""
    local_len = SEQ_LEN // world
    striped = kind in ("striped", "skewed")
    granularity = rng.choice([g for g in (16, 32, 64, 128) if local_len % g == 0]) if striped else 128
    last_run = granularity if striped else {"contiguous": local_len, "zigzag": SEQ_LEN // (2 * world)}[kind]
    most = min(64, last_run)
    last_q = rng.choice([most, rng.randint(1, most)])
    sinks, window = rng.choice([(30, 100), (rng.randint(0, 30), rng.randint(0, 100))])
    if mode == "static":
        v_sizes = [rng.randint(max(sinks, 1), sinks + 24) for _ in range(Q_HEADS)]
        s_sizes = [rng.randint(window + 4, window + 24) for _ in range(Q_HEADS)]
        budget = rng.choice(
            [StaticBudget(v_sizes[0], s_sizes[0]), StaticHeadBudgets(torch.tensor(v_sizes), torch.tensor(s_sizes))]
        )
    else:
        cap = rng.randint(max(sinks, window, 1), 300)
        budget = TopPBudget(round(rng.uniform(0.5, 0.97), 3), cap, block_slashes=mode == "top-p-blocks")
    return dict(
        kind=kind,
        world=world,
        granularity=granularity,
        last_q=last_q,
        sink_tokens=sinks,
        local_window=window,
        budget=budget,
        softmax_scale=rng.choice([None, 0.3]),
        dtype=rng.choice([torch.float32, torch.bfloat16]),
        data_seed=rng.randrange(2**31),
    )


def _straddling_offsets(case: dict) -> list[int]:
    """Offsets s ≤ N − last_q whose key window N−L−s … N−1−s is split between two ranks' columns."""
    layout = Layout(case["kind"], case["world"], case["granularity"])
    owners, _ = layout.to_local(torch.arange(SEQ_LEN), SEQ_LEN)
    run_starts = ((owners[1:] != owners[:-1]).nonzero().flatten() + 1).tolist()
    last_q = case["last_q"]
    return sorted(
        {
            SEQ_LEN - 1 - top
            for start in run_starts
            for top in range(start, start + last_q - 1)
            if last_q <= SEQ_LEN - 1 - top <= SEQ_LEN - last_q
        }
    )


def _inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Global q/k with planted structure, and the planted slash offsets that straddle ranks.

    Noise everywhere; the estimation rows share a direction u, and 8 key columns spread over the ranks
    are all exactly 2u (exact vertical ties across ranks). For query head 0, up to 4 slashes are planted
    by setting k[i − s] = 3·(q[i] − u) on every estimation row i (high on row i only): up to two that
    straddle ranks, the others anywhere, on disjoint key columns (offsets at least L apart).
    """
    gen = torch.Generator().manual_seed(case["data_seed"])
    rng = random.Random(case["data_seed"])
    last_q = case["last_q"]
    q = torch.randn(BATCH, SEQ_LEN, Q_HEADS, DIM, generator=gen)
    k = torch.randn(BATCH, SEQ_LEN, KV_HEADS, DIM, generator=gen)
    direction = torch.randn(BATCH, 1, Q_HEADS, DIM, generator=gen)
    planted = []

    def plant_some(candidates: list[int], up_to: int) -> None:
        for offset in rng.sample(candidates, len(candidates)):
            if len(planted) < up_to and all(abs(offset - other) >= last_q for other in planted):
                planted.append(offset)

    plant_some(_straddling_offsets(case), 2)
    straddlers = list(planted)
    plant_some(list(range(SEQ_LEN - last_q + 1)), 4)  # offsets whose diagonal has all L rows
    rows = torch.arange(SEQ_LEN - last_q, SEQ_LEN)
    for offset in planted:
        k[:, rows - offset, 0] = 3 * q[:, rows, 0]
    q[:, SEQ_LEN - last_q :] += direction
    used = {int(j) for offset in planted for j in rows - offset}
    tied_columns = rng.sample([j for j in range(SEQ_LEN - last_q + 1) if j not in used], 8)  # complete columns
    k[:, tied_columns] = 2 * direction[:, :, :: Q_HEADS // KV_HEADS]
    return q.to(case["dtype"]), k.to(case["dtype"]), straddlers


def _options(case: dict) -> dict:
    return {name: case[name] for name in ("softmax_scale", "last_q", "sink_tokens", "local_window")}


def _estimate_shard(case: dict, group: dist.ProcessGroup):
    """This rank's distributed estimate of ``case`` over ``group``: the four index tensors."""
    layout = Layout(case["kind"], case["world"], case["granularity"])
    q, k, _ = _inputs(case)
    cp_rank = dist.get_rank(group)
    return tuple(
        estimate_vertical_slash_distributed(
            layout.shard(q, cp_rank), layout.shard(k, cp_rank), case["budget"], layout, group, **_options(case)
        )
    )


def _check_bitwise(case: dict, per_rank: list, seed: int) -> None:
    """Every rank's index equals the single-device one exactly; the planted straddling slashes matter."""
    q, k, straddlers = _inputs(case)
    expected = estimate_vertical_slash(q, k, case["budget"], **_options(case))
    for rank, got in enumerate(per_rank):
        for name, ours, theirs in zip(FIELDS, got, expected):
            assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (
                f"{name} differs on rank {rank} (seed={seed}, case={case})"
            )
    if not isinstance(case["budget"], TopPBudget):
        picked = set(expected.s_idx[:, 0].flatten().tolist())
        wanted = [s for s in straddlers if s >= case["local_window"]]
        assert not wanted or picked & set(wanted), (
            f"no planted straddling slash {wanted} was selected, so the halo went untested (seed={seed}, case={case})"
        )


# ----------------------------------------------------------------------------------------------- ranks
def _estimate_on_world(rank, world_size, cases):
    return [_estimate_shard(case, dist.group.WORLD) for case in cases]


def _estimate_on_subgroups(rank, world_size, members, cases_by_group):
    """Every rank joins the group of ``members`` that lists it and estimates that group's cases."""
    groups = [dist.new_group(ranks) for ranks in members]
    mine = next(i for i, ranks in enumerate(members) if rank in ranks)
    try:
        return mine, [_estimate_shard(case, groups[mine]) for case in cases_by_group[mine]]
    finally:
        dist.destroy_process_group(groups[mine])


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 3, 4])
def test_distributed_index_is_bitwise_the_single_device_index(distributed, seed, world):
    rng = random.Random(seed)
    cases = [_make_case(rng, kind, world, mode) for kind in LAYOUT_KINDS for mode in MODES]
    results = distributed(_estimate_on_world, world, cases)
    for number, case in enumerate(cases):
        _check_bitwise(case, [by_rank[number] for by_rank in results], seed)


def test_cp_groups_that_are_not_the_world_run_concurrently(distributed, seed):
    """Two CP groups of non-adjacent global ranks (as with TP = 2 inside), each with its own data."""
    rng = random.Random(seed)
    members = [[0, 2], [1, 3]]
    cases_by_group = [[_make_case(rng, rng.choice(LAYOUT_KINDS), 2, mode) for mode in MODES] for _ in members]
    results = distributed(_estimate_on_subgroups, 4, members, cases_by_group)
    for group_id, ranks in enumerate(members):
        assert [results[r][0] for r in ranks] == [group_id] * len(ranks)
        for number, case in enumerate(cases_by_group[group_id]):
            _check_bitwise(case, [results[r][1][number] for r in ranks], seed)


def test_halo_sends_only_the_offsets_that_straddle_a_run_end():
    """Contiguous: rank r passes L − 1 offsets to r + 1; striped: L − 1 per run to the ring successor."""
    seq_len, last_q = 4096, 64
    for rank in range(4):
        sends = _halo_sends(Layout("contiguous", 4), seq_len, last_q, rank)
        first_foreign = (rank + 1) * seq_len // 4
        expected = (
            []
            if rank == 3
            else [(rank + 1, list(range(seq_len - first_foreign - last_q + 1, seq_len - first_foreign)))]
        )
        assert [(dest, offsets.tolist()) for dest, offsets in sends] == expected
        striped = _halo_sends(Layout("striped", 4, 128), seq_len, last_q, rank)
        runs = seq_len // (4 * 128) - (rank == 3)  # rank 3's last run ends the sequence
        assert [dest for dest, _ in striped] == [(rank + 1) % 4] and len(striped[0][1]) == runs * (last_q - 1)


def _bad_calls(rank, world_size):
    """Every bad call's ValueError message on this rank (None if it did not raise), then a good call."""
    group, contiguous = dist.group.WORLD, Layout("contiguous", world_size)
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 256, 4, 16, generator=gen), torch.randn(1, 256, 2, 16, generator=gen)

    def estimate(length=256, budget=StaticBudget(64, 128), layout=contiguous, device="cpu", **options):
        """Shards the first ``length`` tokens contiguously and calls the estimator with ``layout``."""
        q_local, k_local = (contiguous.shard(x[:, :length], rank).to(device) for x in (q, k))
        return estimate_vertical_slash_distributed(q_local, k_local, budget, layout, group, **options)

    calls = {
        "world size": lambda: estimate(layout=Layout("contiguous", 2 * world_size)),
        "layout type": lambda: estimate(layout="contiguous"),
        "zigzag last_q": lambda: estimate(length=192, layout=Layout("zigzag", world_size)),
        "striped last_q": lambda: estimate(layout=Layout("striped", world_size, 16)),
        "striped split": lambda: estimate(length=192, layout=Layout("striped", world_size, 64)),
        "shapes": lambda: estimate_vertical_slash_distributed(
            contiguous.shard(q, rank), contiguous.shard(k, rank)[:, 1:], StaticBudget(64, 128), contiguous, group
        ),
        "budget heads": lambda: estimate(budget=StaticHeadBudgets(torch.tensor([64] * 3), torch.tensor([128] * 3))),
        "sinks": lambda: estimate(sink_tokens=257),
        "top-p cap": lambda: estimate(budget=TopPBudget(0.9, 64)),
        "device": lambda: estimate(device="meta"),
    }
    messages = {}
    for name, call in calls.items():  # errors come before any work: no thread setting needed
        try:
            call()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    return messages, tuple(estimate())  # the ranks are still in step


EXPECTED_ERRORS = {
    "world size": "the layout has world_size=4 but the group has 2 ranks",
    "layout type": "layout='contiguous' must be a mtraining_kernels.layout.Layout",
    "zigzag last_q": "last_q=64: .* zigzag .* only the last 48 positions on rank 0; use last_q <= 48",
    "striped last_q": "last_q=64: .* striped .* only the last 16 positions on rank 1; use last_q <= 16",
    "striped split": "N_loc=96 on 2 ranks gives N=192, which the layout cannot split",
    "shapes": "must agree on \\[b, N",
    "budget heads": "budget has 3 heads but q has Hq=4",
    "sinks": "sink_tokens=257 .* N=256",
    "top-p cap": "cap=64 is smaller",
    "device": "are on meta but the group's collectives move cpu tensors",
}


def test_bad_input_raises_the_same_error_on_every_rank_before_any_collective(distributed):
    results = distributed(_bad_calls, 2)
    for name, pattern in EXPECTED_ERRORS.items():
        messages = [by_rank[0][name] for by_rank in results]
        assert messages[0] is not None and messages.count(messages[0]) == len(messages), (name, messages)
        assert re.search(pattern, messages[0]), (name, messages[0])
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 256, 4, 16, generator=gen), torch.randn(1, 256, 2, 16, generator=gen)
    expected = estimate_vertical_slash(q, k, StaticBudget(64, 128))
    for _, index in results:
        assert all(torch.equal(a, b) for a, b in zip(index, expected))
