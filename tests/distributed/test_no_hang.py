"""No hangs: when one rank's input is inconsistent, every rank raises promptly.

On 3 gloo ranks, one rank calls :func:`~megatron_mtraining.ring.sparse_ring.ring_attention` or
:func:`~megatron_mtraining.ring.estimation.estimate_vertical_slash_distributed` with a different sequence
length, index (rank, length, heads or layout), head count, dtype, kernel backend, gradient wire dtype,
softmax scale, budget or option than its peers. Every rank must raise a
``ValueError`` within :data:`PROMPT_SECONDS`: the bad rank its own reason, the others either the same
consensus message (naming the values that differ, by rank) or one naming the bad rank. A rank left
waiting inside a collective would instead fail after :data:`COLLECTIVE_TIMEOUT` seconds with gloo's
timeout (a ``RuntimeError``), and a crashed rank would make the harness raise ``TimeoutError``.

Each case runs "cold" (first call of the process) and "warm" (after a successful call with the good
inputs, as at step 40,000 of a run); afterwards every rank runs the good call again, which shows that
the failure left nothing in flight on the group.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist
from patterns import random_index

from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
from mtraining_kernels.index import convert_index
from mtraining_kernels.layout import Layout

WORLD = 3
COLLECTIVE_TIMEOUT = 20.0  # seconds a gloo collective waits before it fails
PROMPT_SECONDS = 10.0  # an agreed error takes milliseconds; a stuck collective takes COLLECTIVE_TIMEOUT
LOCAL_LEN, HEADS, KV_HEADS, DIM = 256, 2, 1, 16


def _run(fn, *args):
    from harness import run_on_ranks

    return run_on_ranks(fn, WORLD, *args, timeout=4 * COLLECTIVE_TIMEOUT, collective_timeout=COLLECTIVE_TIMEOUT)


def _attempt(call) -> dict:
    """Run ``call()``; return what it raised (type name, message) and how long it took."""
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - every outcome is reported to the test
        return {"raised": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    return {"raised": None, "message": "", "seconds": time.monotonic() - start}


AGREE = r".*every rank must pass the same shapes, dtype, budget and options"


# ------------------------------------------------------------------------------------------ ring
# per case: what the bad rank changes (keyword arguments of _ring_call), whose message the ranks raise
# ("consensus": all the same one; "own": the bad rank its reason, the others one naming it) and that message
RING_CASES = {
    "sequence length": (
        dict(local_len=2 * LOCAL_LEN),
        "consensus",
        r"ring attention: the ranks of the group disagree on "
        r"\{'N_loc': \[(?=[^\]]*256)(?=[^\]]*512)" + AGREE,
    ),
    "index shape (heads)": (
        dict(index_heads=2 * HEADS),
        "own",
        r"index covers \[b, Hq\]=\(1, 4\), q has \(1, 2\); convert the index",
    ),
    "index for another rank": (
        dict(index_rank_shift=1),
        "own",
        r"index was built for world_size=3, rank=\d but this is CP rank \d of 3",
    ),
    "index for another length": (
        dict(index_len_factor=2),
        "own",
        r"index was built for seq_len=1536, inputs have 256 x 3 tokens; convert the index "
        r"for N=768",
    ),
    "head count": (
        dict(heads=2 * HEADS, index_heads=2 * HEADS),
        "consensus",
        r"ring attention: the ranks of the group disagree on \{'Hq': \[(?=[^\]]*2)(?=[^\]]*4)" + AGREE,
    ),
    "dtype": (
        dict(dtype=torch.bfloat16),
        "consensus",
        r"ring attention: the ranks of the group disagree on \{'dtype': "
        r"\[(?=[^\]]*'torch\.float32')(?=[^\]]*'torch\.bfloat16')" + AGREE,
    ),
    "q without batch dim": (dict(squeeze_q=True), "own", r"q must be a 4-D tensor \[b, N_loc, heads, d\]"),
    "index for another layout": (
        dict(index_kind="zigzag"),
        "consensus",
        r"ring attention: the ranks of the group disagree on \{'index layout': "
        r"\[(?=[^\]]*Layout\(kind='striped', world_size=3)(?=[^\]]*Layout\(kind='zigzag')" + AGREE,
    ),
    "another backend": (
        dict(backend="triton"),
        "consensus",
        r"ring attention: the ranks of the group disagree on \{'backend': "
        r"\[(?=[^\]]*'torch_blocksparse')(?=[^\]]*'triton')" + AGREE,
    ),
    "unknown backend": (
        dict(backend="torch"),
        "own",
        r"backend='torch' is unknown; use one of \['torch_blocksparse', 'triton'\]",
    ),
    "another wire dtype": (
        dict(grad_wire_dtype="bf16"),
        "consensus",
        r"ring attention: the ranks of the group disagree on \{'grad_wire_dtype': "
        r"\[(?=[^\]]*'fp32')(?=[^\]]*'bf16')" + AGREE,
    ),
    "unknown wire dtype": (dict(grad_wire_dtype="fp16"), "own", r"grad_wire_dtype='fp16' is not one of"),
    "another softmax scale": (
        dict(softmax_scale=0.3),
        "consensus",  # the others' default: 16 ** -0.5
        r"ring attention: the ranks of the group disagree on \{'softmax_scale': "
        r"\[(?=[^\]]*0\.25\b)(?=[^\]]*0\.3\b)" + AGREE,
    ),
    "another determinism": (
        dict(deterministic=True),
        "consensus",
        r"ring attention: the ranks of the group disagree on \{'deterministic': "
        r"\[(?=[^\]]*False)(?=[^\]]*True)" + AGREE,
    ),
}


def _ring_call(
    rank,
    world_size,
    seed,
    local_len=LOCAL_LEN,
    heads=HEADS,
    index_heads=HEADS,
    index_rank_shift=0,
    index_len_factor=1,
    index_kind="striped",
    dtype=torch.float32,
    squeeze_q=False,
    backend="torch_blocksparse",
    grad_wire_dtype="fp32",
    softmax_scale=None,
    deterministic=False,
):
    """One flat-ring forward + backward (by default on torch_blocksparse) with a random striped index."""
    from megatron_mtraining.ring.groups import RingGroups
    from megatron_mtraining.ring.sparse_ring import ring_attention

    gen = torch.Generator().manual_seed(seed + rank)
    seq_len = local_len * world_size
    q = torch.randn(1, local_len, heads, DIM, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(1, local_len, KV_HEADS, DIM, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    index_len = seq_len * index_len_factor
    v_idx, s_idx = random_index(1, index_heads, index_len, 16, 4, gen)
    index = convert_index(
        v_idx, s_idx, Layout(index_kind, world_size), (rank + index_rank_shift) % world_size, index_len
    )
    out = ring_attention(
        q[0] if squeeze_q else q,
        k,
        v,
        index,
        RingGroups.flat(dist.group.WORLD),
        backend=backend,
        grad_wire_dtype=grad_wire_dtype,
        softmax_scale=softmax_scale,
        deterministic=deterministic,
    )
    out.sum().backward()
    if not torch.isfinite(q.grad).all():
        raise AssertionError("the good ring call produced non-finite gradients")


def _ring_rank(rank, world_size, case, bad_rank, warm, seed):
    change, _, _ = RING_CASES[case]
    if warm:
        _ring_call(rank, world_size, seed)
    outcome = _attempt(lambda: _ring_call(rank, world_size, seed, **(change if rank == bad_rank else {})))
    outcome["recovered"] = _attempt(lambda: _ring_call(rank, world_size, seed + 1))["raised"] is None
    return outcome


# ------------------------------------------------------------------------------------------ estimator
ESTIMATOR_CASES = {  # as RING_CASES; top-P: 0 static, 1 top-P
    "sequence length": (
        dict(local_len=2 * LOCAL_LEN),
        "consensus",
        r"disagree on \{'N_loc': \[(?=[^\]]*256)(?=[^\]]*512)" + AGREE,
    ),
    "head count": (dict(heads=2 * HEADS), "consensus", r"disagree on \{'Hq': \[(?=[^\]]*2)(?=[^\]]*4)" + AGREE),
    "dtype": (
        dict(dtype=torch.bfloat16),
        "consensus",
        r"disagree on \{'dtype': \[(?=[^\]]*'torch\.float32')(?=[^\]]*'torch\.bfloat16')" + AGREE,
    ),
    "invalid budget": (
        dict(budget=StaticBudget(8, 128)),
        "own",
        r"v_size=8 is smaller than the 30 forced sink columns.*use v_size >= 30",
    ),
    "another budget": (
        dict(budget=TopPBudget(0.9, 256)),
        "consensus",
        r"disagree on \{'top-P': \[(?=[^\]]*0)(?=[^\]]*1)" + AGREE,
    ),
    "another last_q": (dict(last_q=32), "consensus", r"disagree on \{'last_q': \[(?=[^\]]*64)(?=[^\]]*32)" + AGREE),
    "another layout": (
        dict(kind="zigzag"),
        "consensus",
        r"disagree on \{'layout': \[(?=[^\]]*kind='zigzag')(?=[^\]]*kind='striped')" + AGREE,
    ),
    # 0.25 + 2^-40 and the others' 0.25 are one value in the 2^-32 fixed point the ranks once compared
    "softmax scale below 2^-32": (
        dict(softmax_scale=0.25 + 2**-40),
        "consensus",
        r"disagree on \{'softmax_scale': \[(?=[^\]]*0\.25,)(?=[^\]]*0\.25000000000090)" + AGREE,
    ),
}


def _estimate_call(
    rank,
    world_size,
    seed,
    local_len=LOCAL_LEN,
    heads=HEADS,
    dtype=torch.float32,
    budget=StaticBudget(64, 128),
    last_q=64,
    kind="striped",
    softmax_scale=None,
):
    from megatron_mtraining.ring.estimation import estimate_vertical_slash_distributed

    gen = torch.Generator().manual_seed(seed + rank)
    q = torch.randn(1, local_len, heads, DIM, generator=gen).to(dtype)
    k = torch.randn(1, local_len, KV_HEADS, DIM, generator=gen).to(dtype)
    return estimate_vertical_slash_distributed(
        q, k, budget, Layout(kind, world_size), dist.group.WORLD, last_q=last_q, softmax_scale=softmax_scale
    )


def _estimator_rank(rank, world_size, case, bad_rank, warm, seed):
    change, _, _ = ESTIMATOR_CASES[case]
    if warm:
        _estimate_call(rank, world_size, seed)
    outcome = _attempt(lambda: _estimate_call(rank, world_size, seed, **(change if rank == bad_rank else {})))
    outcome["recovered"] = _attempt(lambda: _estimate_call(rank, world_size, seed + 1))["raised"] is None
    return outcome


# ------------------------------------------------------------------------------------------ checks
def _assert_every_rank_raised(outcomes, bad_rank, kind, message, what, context):
    """Every rank raised a ValueError promptly with the expected message, and the group still works.

    ``kind`` "consensus": every rank raises ``message``; "own": the bad rank raises ``message``, the others
    one naming the bad rank.
    """
    for rank, outcome in enumerate(outcomes):
        where = f"{what}, rank {rank} (bad rank {bad_rank}), {context}"
        assert outcome["raised"] == "ValueError", f"{where}: {outcome['raised']}: {outcome['message']}"
        assert outcome["seconds"] < PROMPT_SECONDS, (
            f"{where}: raised only after {outcome['seconds']:.1f}s (a collective waited): {outcome['message']}"
        )
        if kind == "consensus" or rank == bad_rank:
            expected = message
        else:
            expected = rf"invalid on (CP )?rank\(s\) \[{bad_rank}\]"
        assert re.search(expected, outcome["message"], re.S), f"{where}: {outcome['message']!r} !~ {expected!r}"
        assert outcome["recovered"], f"{where}: the good call after the failure did not succeed"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_attention_raises_on_every_rank(case, warm, seed):
    bad_rank = seed % WORLD
    _, kind, message = RING_CASES[case]
    outcomes = _run(_ring_rank, case, bad_rank, warm, seed)
    _assert_every_rank_raised(outcomes, bad_rank, kind, message, f"ring_attention, {case}", f"seed={seed}")


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("case", list(ESTIMATOR_CASES))
def test_distributed_estimation_raises_on_every_rank(case, warm, seed):
    # the bad rank alternates between the rank that broadcasts the last rows (W-1, striped) and another
    bad_rank = (WORLD - 1) if seed % 2 else seed % (WORLD - 1)
    _, kind, message = ESTIMATOR_CASES[case]
    outcomes = _run(_estimator_rank, case, bad_rank, warm, seed)
    _assert_every_rank_raised(
        outcomes, bad_rank, kind, message, f"estimate_vertical_slash_distributed, {case}", f"seed={seed}"
    )


# ------------------------------------------------------------------------------------------ per-head budgets
# (v_size, s_size) per head: two tables that the weighted checksum sum_h (h+1)·size[h], which the ranks once
# compared instead of the sizes, maps to one value, with one list width Vmax (and one s_size)
CHECKSUM_TWINS = (([40, 60], [128, 128]), ([60, 50], [128, 128]))


def _head_budgets(v_size, s_size) -> StaticHeadBudgets:
    return StaticHeadBudgets(torch.tensor(v_size), torch.tensor(s_size))


def _head_budget_rank(rank, world_size, bad_rank, seed):
    good, other = (_head_budgets(*table) for table in CHECKSUM_TWINS)
    outcome = _attempt(lambda: _estimate_call(rank, world_size, seed, budget=other if rank == bad_rank else good))
    outcome["recovered"] = _attempt(lambda: _estimate_call(rank, world_size, seed + 1, budget=good))["raised"] is None
    return outcome


def test_per_head_budgets_are_compared_exactly(seed):
    from mtraining_kernels.estimation import list_width

    (v_good, s_good), (v_other, s_other) = CHECKSUM_TWINS

    def checksum(sizes):
        return sum((head + 1) * size for head, size in enumerate(sizes))

    assert v_good != v_other and checksum(v_good) == checksum(v_other) and s_good == s_other
    assert list_width(max(v_good), WORLD * LOCAL_LEN) == list_width(max(v_other), WORLD * LOCAL_LEN)
    bad_rank = seed % WORLD

    def by_rank(head):
        return [v_other[head] if rank == bad_rank else v_good[head] for rank in range(WORLD)]

    message = re.escape(f"disagree on {{'v_size[0]': {by_rank(0)}, 'v_size[1]': {by_rank(1)}}}") + AGREE
    outcomes = _run(_head_budget_rank, bad_rank, seed)
    _assert_every_rank_raised(
        outcomes,
        bad_rank,
        "consensus",
        message,
        "estimate_vertical_slash_distributed, per-head budgets",
        f"seed={seed}",
    )
