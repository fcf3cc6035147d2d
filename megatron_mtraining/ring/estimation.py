"""The vertical-slash index estimated over a context-parallel group, bit-identical to the single-device
estimator (DESIGN.md §2.2, distributed estimation).

Every rank broadcasts Q_L from its owner, scores its own keys against it
(:func:`~mtraining_kernels.estimation.scores_of_keys`), all-reduces (MAX) the row maxima and (SUM) the
int64 row sums for top-P, exchanges the slash partials of offsets that straddle its runs of columns, and
all-gathers each rank's
:func:`~mtraining_kernels.estimation.rank_candidates` output (``limit`` = list width) before ranking the
union once more: the global top ``limit`` is inside the union of local tops. The data movement lives in
:mod:`megatron_mtraining.ring.estimation_comm`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
from mtraining_kernels.estimation import (
    MAX_LAST_Q,
    VerticalSlashIndex,
    block_diagonal_scores,
    check_forced_entries,
    check_int,
    check_query_key,
    list_widths,
    rank_candidates,
    resolve_budget,
    scores_of_keys,
    select_index,
)
from mtraining_kernels.layout import Layout

from .consensus import agree_on_inputs, collective_device
from .estimation_comm import all_gather_last_dim, broadcast_last_rows, complete_slash_sums, last_rows_owner

_REDUCE_OPS = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


def check_group_inputs(q_local, k_local, layout, group, softmax_scale) -> int:
    """The checks every distributed estimator makes alike on every rank: q/k and the scale, the layout for the
    group's size, the group's device and the length the layout must split; returns N = W·N_loc."""
    check_query_key(q_local, k_local, softmax_scale)
    if not isinstance(layout, Layout):
        raise ValueError(
            f"layout={layout!r} must be a mtraining_kernels.layout.Layout, e.g. Layout('striped', cp_size)"
        )
    world_size = dist.get_world_size(group)
    if layout.world_size != world_size:
        raise ValueError(
            f"the layout has world_size={layout.world_size} but the group has {world_size} ranks; "
            f"build the layout with the group's size, Layout({layout.kind!r}, {world_size})"
        )
    wanted = collective_device(group)
    if q_local.device.type != wanted.type:
        raise ValueError(
            f"q_local and k_local are on {q_local.device} but the group's collectives move "
            f"{wanted.type} tensors; move them to {wanted.type}"
        )
    local_len = q_local.shape[1]
    seq_len = local_len * world_size
    try:
        layout.validate(seq_len)
    except ValueError as error:
        raise ValueError(
            f"the local length N_loc={local_len} on {world_size} ranks gives N={seq_len}, which "
            f"the layout cannot split: {error}"
        ) from None
    return seq_len


def _check_distributed_inputs(q_local, k_local, layout, group, softmax_scale, last_q, sink_tokens, local_window) -> int:
    """The checks of :func:`estimate_vertical_slash_distributed`, alike on every rank; returns N."""
    seq_len = check_group_inputs(q_local, k_local, layout, group, softmax_scale)
    check_int("last_q", last_q, 1, MAX_LAST_Q, f"at most one {MAX_LAST_Q}-row tile")
    owner, held = last_rows_owner(layout, seq_len, min(MAX_LAST_Q, seq_len))
    if last_q > held:
        raise ValueError(
            f"last_q={last_q}: the estimation rows N-{last_q} … N-1 must all live on one rank to be "
            f"broadcast, but the {layout.kind} layout {layout} with N={seq_len} puts only the last "
            f"{held} positions on rank {owner}; use last_q <= {held}"
        )
    check_forced_entries(sink_tokens, local_window, seq_len)
    return seq_len


# every setting that changes what a distributed estimation sends or computes; the ranks agree on them exactly
_AGREED_FIELDS = (
    "b",
    "N_loc",
    "Hq",
    "Hkv",
    "d",
    "dtype",
    "layout",
    "last_q",
    "sink_tokens",
    "local_window",
    "softmax_scale",
    "top-P",
    "Vmax",
    "Smax",
    "p",
    "cap",
    "block_slashes",
    "v_size",
    "s_size",
)


def _agreed_values(
    q_local,
    k_local,
    layout: Layout,
    budget: StaticHeadBudgets | TopPBudget,
    seq_len: int,
    softmax_scale,
    last_q: int,
    sink_tokens: int,
    local_window: int,
) -> list:
    """This rank's values of :data:`_AGREED_FIELDS`, from checked inputs and the resolved budget: the exact
    scale, p and per-head sizes (None where the budget kind has no such value)."""
    batch, local_len, q_heads, dim = q_local.shape
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    v_width, s_width = list_widths(budget, seq_len)
    if isinstance(budget, TopPBudget):
        budget_values = [1, v_width, s_width, float(budget.p), budget.cap, budget.block_slashes, None, None]
    else:
        budget_values = [0, v_width, s_width, None, None, None, budget.v_size, budget.s_size]
    return [
        batch,
        local_len,
        q_heads,
        k_local.shape[2],
        dim,
        q_local.dtype,
        repr(layout),
        last_q,
        sink_tokens,
        local_window,
        float(scale),
        *budget_values,
    ]


def estimate_vertical_slash_distributed(
    q_local: torch.Tensor,
    k_local: torch.Tensor,
    budget: StaticBudget | StaticHeadBudgets | TopPBudget,
    layout: Layout,
    group: dist.ProcessGroup,
    *,
    softmax_scale: float | None = None,
    last_q: int = 64,
    sink_tokens: int = 30,
    local_window: int = 100,
) -> VerticalSlashIndex:
    """:func:`~mtraining_kernels.estimation.estimate_vertical_slash` of the whole sequence from this rank's
    shard: the same index, bit for bit, returned on every rank of ``group``.

    ``q_local [b, N_loc, Hq, d]`` and ``k_local [b, N_loc, Hkv, d]`` are this rank's tokens in
    ``layout`` (whose ``world_size`` is the group's size; N = W·N_loc), on the group's device (cuda for
    nccl, cpu for gloo). The other arguments are those of the single-device estimator; the last
    ``last_q`` positions must lie on one rank. Collectives on ``group``, peers as global ranks:

    1. broadcast of Q_L ``[b, L, Hq, d]`` (q's dtype) from the rank holding it;
    2. top-P only: all-reduce (MAX) of the fp32 row maxima ``[b, Hq, L]`` and (SUM) of the int64 row sums;
    3. the slash halo (:func:`~megatron_mtraining.ring.estimation_comm.complete_slash_sums`): partials of the
       offsets that straddle a run of this rank's columns go to the owner of the offset, so every S(s)
       is complete on one rank; V(j) is complete on the owner of column j anyway;
    4. one all-gather of every rank's top Vmax and Smax (int64 score, int32 index) candidates (and, for
       top-P, its share of the total mass), ranked again identically on every rank.

    Every rank checks its inputs and the ranks agree on them in one small all-gather before any other
    collective (:func:`~megatron_mtraining.ring.consensus.agree_on_inputs`): a bad or inconsistent rank
    makes every rank raise a ``ValueError`` instead of hanging.
    """
    values, error = None, None
    try:
        seq_len = _check_distributed_inputs(
            q_local, k_local, layout, group, softmax_scale, last_q, sink_tokens, local_window
        )
        budget = resolve_budget(budget, q_local.shape[2], seq_len, sink_tokens, local_window)
        values = _agreed_values(
            q_local, k_local, layout, budget, seq_len, softmax_scale, last_q, sink_tokens, local_window
        )
    except ValueError as caught:
        error = caught
    agree_on_inputs("distributed index estimation", _AGREED_FIELDS, values, error, group)
    dim = q_local.shape[3]
    top_p = isinstance(budget, TopPBudget)
    v_width, s_width = list_widths(budget, seq_len)

    def all_reduce(tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        dist.all_reduce(tensor, op=_REDUCE_OPS[reduction], group=group)
        return tensor

    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    device = q_local.device
    q_positions = torch.arange(seq_len - last_q, seq_len, device=device)
    k_positions = layout.global_positions(seq_len, dist.get_rank(group), device=device)
    q_rows = broadcast_last_rows(q_local, layout, seq_len, last_q, group)
    block_slashes = top_p and budget.block_slashes
    v_scores, partials = scores_of_keys(
        q_rows,
        q_positions,
        k_local,
        k_positions,
        scale,
        top_p,
        seq_len,
        all_reduce,
        slashes=not block_slashes,
        consecutive_key_run=layout.run_length(seq_len),
    )
    # a rank's key positions ascend in every layout, so its owned offsets N − 1 − position descend: flipped,
    # both candidate lists are ascending and their ranking needs no sort by index
    v_scores_top, v_indices_top = rank_candidates(
        v_scores, k_positions.expand_as(v_scores), sink_tokens, v_width, indices_ascending=True
    )
    mass_shares = [v_scores.sum(dim=-1, keepdim=True)] if top_p else []
    if block_slashes:  # every block diagonal's mass, its ranks' shares summed exactly: only verticals to gather
        s_scores_all, s_indices_all = all_reduce(block_diagonal_scores(v_scores, k_positions, seq_len), "sum"), None
        v_scores_all, v_indices_all, *mass_all = all_gather_last_dim(
            [v_scores_top, v_indices_top.int(), *mass_shares], group
        )
    else:
        s_scores, s_offsets = complete_slash_sums(partials, layout, seq_len, last_q, group)
        del partials
        s_scores_top, s_indices_top = rank_candidates(
            s_scores.flip(-1), s_offsets.flip(-1).expand_as(s_scores), local_window, s_width, indices_ascending=True
        )
        v_scores_all, v_indices_all, s_scores_all, s_indices_all, *mass_all = all_gather_last_dim(
            [v_scores_top, v_indices_top.int(), s_scores_top, s_indices_top.int(), *mass_shares], group
        )
        s_indices_all = s_indices_all.long()
    total_mass = mass_all[0].sum(dim=-1) if top_p else None
    return select_index(
        v_scores_all,
        v_indices_all.long(),
        s_scores_all,
        s_indices_all,
        budget,
        total_mass,
        seq_len,
        sink_tokens,
        local_window,
    )
