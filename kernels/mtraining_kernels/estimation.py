"""Online vertical-slash index estimation (DESIGN.md §2.2), built from pieces a distributed caller reuses.

:func:`estimate_vertical_slash` is the single-device estimator. It chains these pure functions, each of
which works on any subset of keys given with their global positions:

1. :func:`estimation_logits` — ℓ = scale·⟨q_i, k_j⟩ (fp32) of the last-query rows Q_L against keys,
   ``[b, Hq, L, n]``, −inf where j > i.
2. Scores, all int64 fixed point (value·2^32, see :func:`to_fixed_point`):

   * static: :func:`static_logit_fixed_point` (logits clamped to ±2^24), then
     :func:`vertical_scores` with the −∞ rule for columns that have a masked entry;
   * top-P: row maxima ``logits.amax(-1)``, :func:`exp_fixed_point`, its row sums Z, then
     :func:`probability_fixed_point` (P = exp(ℓ − m_i)/(L·Z_i)) and :func:`vertical_scores`;
   * both: :func:`slash_partial_sums` adds each pair into its offset s = i − j.

3. Selection: :func:`rank_candidates` orders (score, index) candidates by forced first, then score
   descending, then index ascending, and keeps the top ``limit``; :func:`top_p_counts` turns ranked
   masses into counts; :func:`index_list` writes the ascending, sentinel-padded lists.

**Bit identity.** Every step is exact or elementwise, so a result never depends on how keys, rows or
samples are grouped (a rank's share of the keys, a batch, a tile of 64 × 64):

* logits use no matmul: here each one is the fp32 sum over t = 0 … d−1, in that order, of q[t]·k[t]
  (separate, correctly rounded multiplications and additions), times the scale rounded to fp32; the Triton
  path (:mod:`mtraining_kernels.triton_estimation`, CUDA tensors) computes each 64 × 64 tile with one
  tensor-core dot of one fixed shape instead, equally independent of which keys share the tile, and equal
  to these logits up to fp32 rounding;
* the exponential is a fixed polynomial in fp32 built from +, ×, floor and an exact power of two, each
  step one IEEE-rounded fp32 operation (library ``exp`` may mix vector and scalar code paths whose results
  differ in the last bit), and so are the top-P masses;
* every sum (Z_i, V(j), S(s)) adds int64 values, which is associative, so all-reduces and halo
  additions give the same integers in any order; maxima are exact anyway;
* ranking compares integers and breaks ties by index, so it needs no tie behaviour of a sort.

:func:`megatron_mtraining.ring.estimation.estimate_vertical_slash_distributed` is the same estimator over a
context-parallel group, built from these functions (:func:`vertical_and_slash_scores` takes the row
reduction it needs for top-P; :func:`select_index` ranks the union of every rank's top candidates).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Callable, Literal, NamedTuple

import torch

from .budget import StaticBudget, StaticHeadBudgets, TopPBudget
from .host_copies import copy_to
from .launch_checks import uses_triton
from .layout import BLOCK_SIZE

FIXED_POINT_ONE = 2**32  # fixed point: value·2^32 rounded to int64
STATIC_LOGIT_LIMIT = 2.0**24  # |logit| clamp: 64 rows · 2^24 · 2^32 = 2^62 cannot overflow
MAX_LAST_Q = 64  # one tile of query rows; also what keeps the clamp above safe
FORCED_KEY = 2**63 - 1  # ranking key of forced entries: above every score
INCOMPLETE_SCORE = -(2**63 - 1)  # static V(j) = −∞: below every sum, and its negation fits
LIST_ALIGNMENT = 64  # list widths Vmax/Smax are multiples of this (or N)
_EXP_INPUT_FLOOR = -80.0  # exp(−80)·2^32 < 1e−25: rounds to 0 in fixed point


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32, as a Python float: every later conversion of it is exact."""
    return struct.unpack("f", struct.pack("f", x))[0]


_LOG2_E = _fp32(1.4426950408889634)
# 2^f = Σ_k (f·ln 2)^k / k! on [0, 1), in fp32; the degree-8 truncation error is below 1.1e−7 (relative)
_EXP2_COEFFICIENTS = tuple(_fp32(math.log(2.0) ** k / math.factorial(k)) for k in range(9))


# reduce_rows(tensor, "max" | "sum"): row maxima or sums over some key columns → over all of them
RowReduction = Callable[[torch.Tensor, Literal["max", "sum"]], torch.Tensor]


class VerticalSlashIndex(NamedTuple):
    """The estimated index (DESIGN.md §2.1): ascending lists padded with the sentinel N.

    ``v_idx [b, Hq, Vmax]`` int32 key columns, ``s_idx [b, Hq, Smax]`` int32 diagonal offsets,
    ``v_cnt``/``s_cnt [b, Hq]`` int32 numbers of valid entries.
    """

    v_idx: torch.Tensor
    s_idx: torch.Tensor
    v_cnt: torch.Tensor
    s_cnt: torch.Tensor


# ---------------------------------------------------------------------------------------------- scores


def _triton_estimation():
    """:mod:`mtraining_kernels.triton_estimation`, imported on first use (Triton is only needed there)."""
    from . import triton_estimation

    return triton_estimation


def _triton_selection():
    """:mod:`mtraining_kernels.triton_selection`, imported on first use."""
    from . import triton_selection

    return triton_selection


def _fixed_point_rules():
    """This module's integer arithmetic, as the Triton kernels take it."""
    return _triton_estimation().FixedPointRules(
        one=FIXED_POINT_ONE,
        static_logit_limit=STATIC_LOGIT_LIMIT,
        incomplete_score=INCOMPLETE_SCORE,
        exp_input_floor=_EXP_INPUT_FLOOR,
        log2_e=_LOG2_E,
        exp2_coefficients=_EXP2_COEFFICIENTS,
    )


def estimation_logits(
    q_rows: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    k_positions: torch.Tensor,
    softmax_scale: float,
    implementation: str = "auto",
) -> torch.Tensor:
    """Logits of the estimation rows against some keys: fp32 ``[b, Hq, L, n]``, −inf where j > i.

    ``q_rows [b, L, Hq, d]`` and their global positions ``q_positions [L]``; ``k [b, n, Hkv, d]`` and
    ``k_positions [n]``, any subset of keys in any order. Query head h reads KV head h // (Hq/Hkv).
    The loop runs over d (not over tokens): entry (i, j) is fl(…fl(fl(q0·k0) + fl(q1·k1))… ) accumulated
    in fixed order, then multiplied by ``softmax_scale`` rounded to fp32, so it is independent of
    every other entry computed alongside it. ``implementation`` "auto" takes the Triton kernel for CUDA
    tensors (:mod:`mtraining_kernels.triton_estimation`: one tensor-core dot per tile, equally independent of
    the other entries, equal to this definition up to fp32 rounding).
    """
    if uses_triton(implementation, k):
        return _triton_estimation().estimation_logits(q_rows, q_positions, k, k_positions, softmax_scale)
    return _torch_estimation_logits(q_rows, q_positions, k, k_positions, softmax_scale)


def _torch_estimation_logits(
    q_rows: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor, k_positions: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """:func:`estimation_logits` with PyTorch ops on any device: one broadcast product and add per t."""
    batch, rows, q_heads, dim = q_rows.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    # [d, b, Hkv, group·L, 1] against [d, b, Hkv, 1, n]: one broadcast product per t
    q_by_dim = (
        q_rows.float()
        .reshape(batch, rows, kv_heads, group, dim)
        .permute(4, 0, 2, 3, 1)
        .reshape(dim, batch, kv_heads, group * rows, 1)
        .contiguous()
    )
    k_by_dim = k.float().permute(3, 0, 2, 1).unsqueeze(3).contiguous()
    logits = torch.mul(q_by_dim[0], k_by_dim[0])
    product = torch.empty_like(logits)
    for t in range(1, dim):
        torch.mul(q_by_dim[t], k_by_dim[t], out=product)
        logits.add_(product)
    logits.mul_(float(torch.tensor(softmax_scale, dtype=torch.float32)))
    logits = logits.view(batch, kv_heads, group, rows, -1).reshape(batch, q_heads, rows, -1)
    future = k_positions.to(logits.device)[None, :] > q_positions.to(logits.device)[:, None]
    return logits.masked_fill_(future, float("-inf"))


def to_fixed_point(x: torch.Tensor) -> torch.Tensor:
    """round(x·2^32) as int64 (x finite, |x| ≤ 2^30); exact, computed through fp64."""
    return torch.round(x.double() * FIXED_POINT_ONE).long()


def static_logit_fixed_point(logits: torch.Tensor) -> torch.Tensor:
    """Static-mode terms: logits clamped to ±2^24 in fixed point, 0 where masked (−inf): int64, same shape."""
    values = to_fixed_point(logits.clamp(-STATIC_LOGIT_LIMIT, STATIC_LOGIT_LIMIT))
    return values.masked_fill_(torch.isneginf(logits), 0)


def _exp_nonpositive(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for fp32 x ≤ 0 from fp32 +, ×, floor and an exact power of two; inputs below −80 give exp(−80).

    2^y with y = x·log2(e) is split as 2^⌊y⌋ (built from its exponent bits) times a degree-8 polynomial
    in the fraction, evaluated by Horner's rule (a loop over the 8 coefficients). Within 2e−6 of exp(x),
    relative, for x ≥ −22 (the rounding of y), where E below is at least 1.
    """
    y = x.clamp(min=_EXP_INPUT_FLOOR) * _LOG2_E
    whole = torch.floor(y)
    fraction = y - whole  # exact, in [0, 1)
    poly = torch.full_like(fraction, _EXP2_COEFFICIENTS[-1])
    for coefficient in reversed(_EXP2_COEFFICIENTS[:-1]):
        poly.mul_(fraction).add_(coefficient)
    power = torch.bitwise_left_shift(whole.int() + 127, 23).view(torch.float32)  # 2^⌊y⌋, normal: ⌊y⌋ ≥ −116
    return poly.mul_(power)


def exp_fixed_point(logits: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """E = round(exp(ℓ − m_i)·2^32), in fp32 arithmetic: int64 like ``logits`` (each an fp32 integer, ≤ 2^32), 0
    where masked.

    ``row_max [..., L]`` must be the row maximum over *all* keys of the sequence (after an
    all-reduce(MAX) when keys are split), so every exponent is ≤ 0 and E ≤ 2^32. ℓ − m_i is the fp32
    difference of the fp32 logit and maximum; the product by 2^32 is exact, then rounded half to even.
    """
    masked = torch.isneginf(logits)
    shifted = logits.float() - row_max.float()[..., None]
    shifted = shifted.masked_fill_(masked, _EXP_INPUT_FLOOR)  # its E rounds to 0
    return torch.round(_exp_nonpositive(shifted).mul_(FIXED_POINT_ONE)).long()


def mass_scales(row_sums: torch.Tensor, num_rows: int) -> torch.Tensor:
    """R_i = 2^32 / (L·row_sums_i) ``[..., L]``: one fp64 division per row, rounded to fp32, from the int64 row
    sums of :func:`exp_fixed_point` (Z_i·2^32) and ``num_rows`` = L."""
    return (FIXED_POINT_ONE / (row_sums.double() * num_rows)).float()


def probability_fixed_point(exp_values: torch.Tensor, row_sums: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Softmax mass P = exp(ℓ − m_i)/(L·Z_i) in fixed point: int64 like ``exp_values``.

    ``exp_values`` from :func:`exp_fixed_point`; ``row_sums [..., L]`` their int64 row sums over all
    keys (Z_i·2^32); ``num_rows`` is L. Computes round(E·R_i) in fp32 with the row's :func:`mass_scales`
    (one product per entry, not a division; E converts to fp32 exactly), so the masses of a head sum to 1
    (2^32) up to rounding.
    """
    return torch.round(exp_values.float() * mass_scales(row_sums, num_rows)[..., None]).long()


def vertical_scores(values: torch.Tensor, incomplete_columns: torch.Tensor | None = None) -> torch.Tensor:
    """V(j) = Σ_i values[..., i, j]: int64 ``[..., n]``; ``incomplete_columns`` (bool, broadcastable)
    get :data:`INCOMPLETE_SCORE`, the static rule for columns with a masked entry."""
    scores = values.sum(dim=-2)
    if incomplete_columns is not None:
        scores = scores.masked_fill_(incomplete_columns, INCOMPLETE_SCORE)
    return scores


def slash_partial_sums(
    values: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Per-offset sums S(s) = Σ values[..., i, j] over pairs with i − j = s: int64 ``[..., seq_len]``.

    ``values [..., L, n]`` int64 with rows at ``q_positions [L]`` and columns at ``k_positions [n]``
    (global); pairs with j > i are skipped. Over a subset of keys these are partial sums that add up
    exactly to the full S(s).
    """
    offsets = q_positions.to(values.device)[:, None] - k_positions.to(values.device)[None, :]
    offsets = torch.where(offsets >= 0, offsets, seq_len).reshape(-1)  # masked pairs → spare slot
    leading = values.shape[:-2]
    sums = values.new_zeros(*leading, seq_len + 1)
    sums.scatter_add_(-1, offsets.expand(*leading, -1), values.reshape(*leading, -1))
    return sums[..., :seq_len]


# ------------------------------------------------------------------------------------------- selection
def rank_candidates(
    scores: torch.Tensor,
    indices: torch.Tensor,
    num_forced: int,
    limit: int,
    indices_ascending: bool = False,
    implementation: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Order candidates and keep the first ``limit``: (ranked scores, ranked indices), int64 ``[..., limit]``.

    ``scores``/``indices [..., m]`` int64, indices distinct along the last dim, in any order
    (``indices_ascending``: already ascending, as all N of one sequence are, so they need no sort). The
    order is: indices below ``num_forced`` (the forced entries) first, by index; then the others by
    score descending, then index ascending. It is a strict total order, so ranking a union of per-rank
    results again gives the same list as ranking everything at once. ``implementation`` "auto" (Triton for
    CUDA tensors), "torch" or "triton": with Triton the first ``limit`` are selected by
    :func:`mtraining_kernels.triton_selection.top_positions` and only they are sorted; the same result.
    """
    return rank_candidate_groups([(scores, indices, num_forced, limit)], indices_ascending, implementation)[0]


def rank_candidate_groups(
    groups: list[tuple[torch.Tensor, torch.Tensor, int, int]],
    indices_ascending: bool = False,
    implementation: str = "auto",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`rank_candidates` of each group ``(scores, indices, num_forced, limit)`` (say the verticals and the
    slashes); with Triton the selections of both groups are one launch, so their rows run side by side."""
    keyed = []
    for scores, indices, num_forced, limit in groups:
        if not indices_ascending:
            by_index = indices.argsort(dim=-1, stable=True)
            indices = indices.gather(-1, by_index)
            scores = scores.gather(-1, by_index)
        keyed.append((scores, indices, torch.where(indices < num_forced, FORCED_KEY, scores), limit))
    selected = [
        i for i, (_, _, keys, limit) in enumerate(keyed) if limit < keys.shape[-1] and uses_triton(implementation, keys)
    ]
    first = dict(zip(selected, _first_positions([keyed[i][2:] for i in selected]))) if selected else {}
    ranked = []
    for i, (scores, indices, keys, limit) in enumerate(keyed):
        if i in first:  # the first `limit` found without a sort, then only they are ranked
            order = first[i].gather(-1, torch.argsort(-keys.gather(-1, first[i]), dim=-1, stable=True))
        else:
            order = torch.argsort(-keys, dim=-1, stable=True)[..., :limit]  # ties keep index order
        ranked.append((scores.gather(-1, order), indices.gather(-1, order)))
    return ranked


def _first_positions(keyed: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """For each ``(keys [..., m] int64, limit < m)``, the positions of the first ``limit`` by (key desc, position
    asc), ascending: int64 ``[..., limit]``, by the Triton selection, every group in one launch."""
    selection = _triton_selection()
    groups = []
    for keys, limit in keyed:
        rows = keys.reshape(-1, keys.shape[-1])
        counts = torch.full((rows.shape[0],), limit, dtype=torch.int32, device=keys.device)
        groups.append(selection.SelectionRows(rows, counts, limit))
    positions = selection.top_positions_of_groups(groups)
    return [chosen.long().view(*keys.shape[:-1], limit) for chosen, (keys, limit) in zip(positions, keyed)]


def _selected_lists(
    kinds: list[tuple[torch.Tensor, int, torch.Tensor, int]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`index_list` of the :func:`rank_candidates` ranking of all candidates 0 … m−1, for each kind
    ``(scores [..., m] int64 with m = N, num_forced, counts [...] ≤ width, width < m)``, by the Triton selection
    alone, every kind in one launch: the first ``counts`` candidates come out ascending and padded with m, so
    neither the ranking nor the list needs a sort."""
    groups = [
        _triton_selection().SelectionRows(scores.reshape(-1, scores.shape[-1]), counts.reshape(-1), width, num_forced)
        for scores, num_forced, counts, width in kinds
    ]
    positions = _triton_selection().top_positions_of_groups(groups)
    return [
        (chosen.view(*scores.shape[:-1], width), counts.int())
        for chosen, (scores, _, counts, width) in zip(positions, kinds)
    ]


def top_p_counts(
    ranked_masses: torch.Tensor, num_forced: int, total_mass: torch.Tensor, p: float, cap: int
) -> torch.Tensor:
    """Per head, the smallest count c ≥ ``num_forced`` whose first c ranked masses reach ``p``·total, at most ``cap``.

    ``ranked_masses [..., m]`` int64 ≥ 0 from :func:`rank_candidates` (forced entries first, so their
    mass is always included), ``total_mass [...]`` int64 the sum over all candidates (the integer
    "1"), ``cap`` ≤ m. Returns int64 ``[...]``.
    """
    needed = torch.ceil(total_mass.double() * p).long()
    cumulative = ranked_masses[..., :cap].cumsum(dim=-1)
    short = (cumulative < needed[..., None]).sum(dim=-1)  # entries before the mass is reached
    return (short + 1).clamp(min=num_forced, max=cap)


def index_list(
    ranked_indices: torch.Tensor, counts: torch.Tensor, width: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``counts`` ranked indices, ascending, padded with ``seq_len``: (int32 ``[..., width]``, int32 counts).

    ``ranked_indices [..., m]`` with m ≥ width ≥ max(counts).
    """
    if ranked_indices.shape[-1] < width:
        raise ValueError(f"{ranked_indices.shape[-1]} ranked candidates cannot fill a list of width {width}")
    slots = torch.arange(width, device=ranked_indices.device)
    chosen = torch.where(slots < counts[..., None], ranked_indices[..., :width], seq_len)
    return chosen.sort(dim=-1).values.int(), counts.int()


def list_width(largest: int, seq_len: int) -> int:
    """Vmax/Smax: the largest budget or cap rounded up to a multiple of 64, at most ``seq_len``."""
    return min(-(-largest // LIST_ALIGNMENT) * LIST_ALIGNMENT, seq_len)


# ------------------------------------------------------------------------------------------ estimation
def check_int(name: str, value, low: int, high: int, why: str) -> None:
    """Raise ``ValueError`` unless ``value`` is an int in [low, high], saying ``why``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}={value!r} must be an integer in [{low}, {high}] ({why})")


def check_query_key(q, k, softmax_scale, same_length: bool = True) -> None:
    """Shape, dtype, GQA and device checks of q/k (the whole sequence or one rank's shard) and the scale;
    ``same_length=False`` lets q hold fewer rows than k (the last queries only)."""
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point tensor [b, N, heads, d], got "
                f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', '')}"
            )
    (batch, seq_len, q_heads, dim), (k_batch, k_len, kv_heads, k_dim) = q.shape, k.shape
    if (batch, dim) != (k_batch, k_dim) or (same_length and seq_len != k_len):
        agree = "[b, N, ·, d]" if same_length else "[b, ·, ·, d]"
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on {agree}")
    if 0 in q.shape or 0 in k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must not be empty")
    if q_heads % kv_heads:
        raise ValueError(
            f"query heads Hq={q_heads} are not divisible by KV heads Hkv={kv_heads}; "
            "GQA needs Hq to be a multiple of Hkv"
        )
    if q.device != k.device:
        raise ValueError(f"q is on {q.device} but k is on {k.device}; put both on one device")
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a positive finite number or None (d^-1/2)")


def check_forced_entries(sink_tokens, local_window, seq_len: int) -> None:
    check_int("sink_tokens", sink_tokens, 0, seq_len, f"the forced sinks must exist in N={seq_len}")
    check_int("local_window", local_window, 0, seq_len, f"the forced window offsets must exist in N={seq_len}")


def _check_inputs(q, k, softmax_scale, last_q, sink_tokens, local_window) -> None:
    check_query_key(q, k, softmax_scale)
    seq_len = q.shape[1]
    check_int(
        "last_q",
        last_q,
        1,
        min(MAX_LAST_Q, seq_len),
        f"at most the sequence length N={seq_len} and at most one {MAX_LAST_Q}-row tile",
    )
    check_forced_entries(sink_tokens, local_window, seq_len)


def resolve_budget(
    budget, q_heads: int, seq_len: int, sink_tokens: int, local_window: int
) -> StaticHeadBudgets | TopPBudget:
    """The budget as per-head static sizes or a top-P budget, checked against Hq, N and the forced entries.

    Kept per budget and arguments (see :func:`_budget_key`): a layer resolves the same budget every step, and
    then gets the same object back, so what :func:`select_index` derives from it is kept too. Shared, so read
    the result, never write it.
    """
    if not isinstance(budget, (StaticBudget, StaticHeadBudgets, TopPBudget)):
        raise ValueError(f"budget={budget!r} must be a StaticBudget, StaticHeadBudgets or TopPBudget")
    return _resolved_budget(_budget_key(budget), q_heads, seq_len, sink_tokens, local_window)


def _budget_key(budget: StaticBudget | StaticHeadBudgets | TopPBudget) -> tuple:
    """A cache key that changes with the budget's contents: static and top-P budgets are frozen values; head
    budgets are keyed by identity and their tensors' version counters, which every in-place write bumps."""
    if isinstance(budget, StaticHeadBudgets):
        return budget, budget.v_size._version, budget.s_size._version
    return budget, None, None


@functools.lru_cache(maxsize=256)
def _resolved_budget(
    budget_key: tuple, q_heads: int, seq_len: int, sink_tokens: int, local_window: int
) -> StaticHeadBudgets | TopPBudget:
    budget = budget_key[0]
    if isinstance(budget, StaticBudget):
        budget = StaticHeadBudgets.uniform(budget, q_heads)
    if isinstance(budget, StaticHeadBudgets) and budget.num_heads != q_heads:
        raise ValueError(
            f"the budget has {budget.num_heads} heads but q has Hq={q_heads}; resolve the budget for this "
            "rank's query heads"
        )
    budget.validate_for(seq_len, sink_tokens, local_window)
    return budget


@functools.lru_cache(maxsize=256)
def _static_sizes(budget_key: tuple, device: torch.device) -> torch.Tensor:
    """int32 ``[2, Hq]`` (v_size; s_size) of a resolved static budget, kept on the host (pinned for a CUDA
    ``device``) for :func:`select_index` to copy from each call: never handed out, so never written."""
    budget = budget_key[0]
    sizes = torch.stack((budget.v_size, budget.s_size)).int()
    return sizes.pin_memory() if device.type == "cuda" else sizes


def estimate_vertical_slash(
    q: torch.Tensor,
    k: torch.Tensor,
    budget: StaticBudget | StaticHeadBudgets | TopPBudget,
    *,
    softmax_scale: float | None = None,
    last_q: int = 64,
    sink_tokens: int = 30,
    local_window: int = 100,
    implementation: str = "auto",
) -> VerticalSlashIndex:
    """Estimate the vertical-slash index of one layer from post-RoPE q/k in global order (DESIGN.md §2.2).

    ``q [b, N, Hq, d]``, ``k [b, N, Hkv, d]`` (any float dtype; logits in fp32). ``budget`` is a uniform
    :class:`StaticBudget`, per-head :class:`StaticHeadBudgets` (one entry per query head) or a
    :class:`TopPBudget`. Sinks 0 … sink_tokens−1 and offsets 0 … local_window−1 are always selected and
    count toward the budget; the other entries are the best candidates by (score desc, index asc).
    ``v_idx`` is Vmax wide, the largest ``v_size`` (or the cap) rounded up to a multiple of 64 and at
    most N; ``s_idx`` likewise with ``s_size``. Top-P counts reach ``p`` of the integer total mass.
    ``implementation`` "auto" (Triton for CUDA tensors), "torch" or "triton": the same index up to candidates
    whose scores differ by the logits' fp32 rounding (see the module docstring).
    """
    _check_inputs(q, k, softmax_scale, last_q, sink_tokens, local_window)
    uses_triton(implementation, q)  # an unknown name is refused before any work
    seq_len = q.shape[1]
    budget = resolve_budget(budget, q.shape[2], seq_len, sink_tokens, local_window)
    return _estimate(q[:, seq_len - last_q :], k, budget, softmax_scale, sink_tokens, local_window, implementation)


def estimate_from_last_queries(
    q_last: torch.Tensor,
    k: torch.Tensor,
    budget: StaticBudget | StaticHeadBudgets | TopPBudget,
    *,
    softmax_scale: float | None = None,
    sink_tokens: int = 30,
    local_window: int = 100,
    implementation: str = "auto",
) -> VerticalSlashIndex:
    """:func:`estimate_vertical_slash` from the only queries it reads, bit for bit the same index.

    ``q_last [b, L, Hq, d]`` are the queries at positions N − L … N − 1 (L ≤ 64) of ``k [b, N, Hkv, d]``, so a
    caller holding whole documents copies their last rows and no other query (``document_index``).
    """
    check_query_key(q_last, k, softmax_scale, same_length=False)
    last_q, seq_len = q_last.shape[1], k.shape[1]
    check_int("L", last_q, 1, min(MAX_LAST_Q, seq_len), f"the last queries of N={seq_len} keys, one tile at most")
    check_forced_entries(sink_tokens, local_window, seq_len)
    uses_triton(implementation, q_last)  # an unknown name is refused before any work
    budget = resolve_budget(budget, q_last.shape[2], seq_len, sink_tokens, local_window)
    return _estimate(q_last, k, budget, softmax_scale, sink_tokens, local_window, implementation)


def _estimate(
    q_last: torch.Tensor,
    k: torch.Tensor,
    budget: StaticHeadBudgets | TopPBudget,
    softmax_scale: float | None,
    sink_tokens: int,
    local_window: int,
    implementation: str,
) -> VerticalSlashIndex:
    """:func:`estimate_from_last_queries` of checked inputs and a resolved budget."""
    last_q, seq_len, dim = q_last.shape[1], k.shape[1], q_last.shape[3]
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    k_positions = _positions(seq_len, q_last.device)
    q_positions = k_positions[seq_len - last_q :]
    top_p = isinstance(budget, TopPBudget)
    block_slashes = top_p and budget.block_slashes
    v_scores, s_scores = scores_of_keys(
        q_last,
        q_positions,
        k,
        k_positions,
        scale,
        top_p,
        seq_len,
        implementation=implementation,
        slashes=not block_slashes,
        consecutive_key_run=seq_len,  # both position lists are aranges
    )

    total_mass = v_scores.sum(dim=-1) if top_p else None  # = s_scores.sum(-1) exactly
    if block_slashes:
        s_scores = block_diagonal_scores(v_scores, k_positions, seq_len)
    return select_index(
        v_scores,
        k_positions.expand_as(v_scores),  # every key is a candidate column, every offset 0 … N−1 a slash
        s_scores,
        _all_candidates(s_scores) if block_slashes else k_positions.expand_as(s_scores),
        budget,
        total_mass,
        seq_len,
        sink_tokens,
        local_window,
        candidates_ascending=True,
        implementation=implementation,
    )


def _values_and_vertical_scores(
    logits: torch.Tensor, top_p: bool, reduce_rows: RowReduction | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int64 terms of the scores (``values``, like ``logits``) and V over the logits' columns ``[b, Hq, n]``.

    Static terms are the clamped logits; top-P terms are the masses P. ``reduce_rows(tensor, "max" | "sum")``
    turns row maxima and row sums over some columns into ones over all columns (an all-reduce when the
    columns are split over ranks); without it the logits hold all columns.
    """
    if not top_p:
        values = static_logit_fixed_point(logits)
        return values, vertical_scores(values, torch.isneginf(logits).any(dim=-2))
    row_max = logits.amax(dim=-1)
    if reduce_rows is not None:
        row_max = reduce_rows(row_max, "max")
    exp_values = exp_fixed_point(logits, row_max)
    row_sums = exp_values.sum(dim=-1)
    if reduce_rows is not None:
        row_sums = reduce_rows(row_sums, "sum")
    values = probability_fixed_point(exp_values, row_sums, logits.shape[-2])
    return values, vertical_scores(values)


def vertical_and_slash_scores(
    logits: torch.Tensor,
    top_p: bool,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    seq_len: int,
    reduce_rows: RowReduction | None = None,
    implementation: str = "auto",
    slashes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(V over the logits' columns ``[b, Hq, n]``, partial S ``[b, Hq, seq_len]``), int64, from the logits.

    ``reduce_rows`` as in :func:`_values_and_vertical_scores`; ``implementation`` as in
    :func:`estimation_logits`. With Triton the terms are computed inside the kernels and never stored; the
    integers are the same. Without ``slashes`` (top-P over block diagonals needs V only) S is None.
    """
    if not uses_triton(implementation, logits):
        values, v_scores = _values_and_vertical_scores(logits, top_p, reduce_rows)
        return v_scores, slash_partial_sums(values, q_positions, k_positions, seq_len) if slashes else None
    return _triton_scores(logits, top_p, q_positions, k_positions, seq_len, reduce_rows, slashes)


def scores_of_keys(
    q_rows: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    k_positions: torch.Tensor,
    softmax_scale: float,
    top_p: bool,
    seq_len: int,
    reduce_rows: RowReduction | None = None,
    implementation: str = "auto",
    slashes: bool = True,
    consecutive_key_run: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`vertical_and_slash_scores` of :func:`estimation_logits`, without storing the logits on Triton.

    The arguments are those two functions'. With Triton every pass recomputes its tiles of logits on the
    tensor cores (the same bits each time); with PyTorch ops the logits are built once, as defined above.
    ``consecutive_key_run``: the caller guarantees consecutive ``q_positions`` and ``k_positions`` made of runs
    of this many consecutive positions (the first from key 0), or None; where every tile of the Triton passes
    then lies in one run, they skip their check of it. The scores are the same.
    """
    if not uses_triton(implementation, k):
        logits = _torch_estimation_logits(q_rows, q_positions, k, k_positions, softmax_scale)
        return vertical_and_slash_scores(
            logits, top_p, q_positions, k_positions, seq_len, reduce_rows, implementation, slashes
        )
    source = _triton_estimation().QueryKeyTiles(q_rows, k, softmax_scale)
    return _triton_scores(source, top_p, q_positions, k_positions, seq_len, reduce_rows, slashes, consecutive_key_run)


def _triton_scores(source, top_p, q_positions, k_positions, seq_len, reduce_rows, slashes, consecutive_key_run=None):
    """The Triton passes over ``source`` (stored logits or ``QueryKeyTiles``): (V, partial S or None)."""
    kernels, rules = _triton_estimation(), _fixed_point_rules()
    run = consecutive_key_run
    consecutive_keys = run is not None and (run >= k_positions.numel() or run % kernels.KEYS_PER_TILE == 0)
    if not top_p:
        return kernels.static_scores(source, q_positions, k_positions, seq_len, rules, consecutive_keys)
    row_max = kernels.row_maxima(source, q_positions, k_positions)
    if reduce_rows is not None:
        row_max = reduce_rows(row_max, "max")
    row_sums = kernels.exp_row_sums(source, q_positions, k_positions, row_max, rules)
    if reduce_rows is not None:
        row_sums = reduce_rows(row_sums, "sum")
    return kernels.top_p_scores(
        source, q_positions, k_positions, seq_len, row_max, row_sums, rules, slashes, consecutive_keys
    )


_POSITIONS: dict[torch.device, torch.Tensor] = {}  # per device, 0 … n − 1 for the longest n asked so far


def _positions(seq_len: int, device: torch.device) -> torch.Tensor:
    """0 … seq_len − 1 (int64) on ``device``: a prefix of one tensor per device, rebuilt only for a longer length
    (documents of many lengths share it). Shared, so read it, never write it."""
    positions = _POSITIONS.get(device)
    if positions is None or positions.numel() < seq_len:
        positions = _POSITIONS[device] = torch.arange(seq_len, device=device)
    return positions[:seq_len]


def _all_candidates(scores: torch.Tensor) -> torch.Tensor:
    """Indices 0 … N−1 (key columns or offsets) for scores ``[b, Hq, N]``."""
    return torch.arange(scores.shape[-1], device=scores.device).expand(scores.shape)


def list_widths(budget: StaticHeadBudgets | TopPBudget, seq_len: int) -> tuple[int, int]:
    """(Vmax, Smax) of a resolved budget on a sequence of ``seq_len``."""
    if isinstance(budget, TopPBudget):
        width = list_width(budget.effective_cap(seq_len), seq_len)
        if budget.block_slashes:
            return width, list_width(min(budget.cap, block_diagonals(seq_len)), seq_len)
        return width, width
    return _static_widths(_budget_key(budget), seq_len)


@functools.lru_cache(maxsize=256)
def _static_widths(budget_key: tuple, seq_len: int) -> tuple[int, int]:
    budget = budget_key[0]
    return list_width(int(budget.v_size.max()), seq_len), list_width(int(budget.s_size.max()), seq_len)


def block_diagonals(seq_len: int) -> int:
    """The block diagonals δ = 0 … ⌈N/128⌉ − 1 of a sequence (or document) of ``seq_len`` tokens."""
    return -(-seq_len // BLOCK_SIZE)


def forced_block_diagonals(local_window: int) -> int:
    """How many block diagonals (δ = 0, 1, …) the local window's offsets 0 … local_window − 1 reach."""
    return -(-(local_window - 1) // BLOCK_SIZE) + 1


def block_diagonal_scores(v_scores: torch.Tensor, key_positions: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Block-diagonal masses ``[b, Hq, ⌈N/128⌉]`` int64 from vertical masses ``v_scores [b, Hq, n]`` of the keys
    at ``key_positions [n]`` (all of them, or one rank's: the sums over ranks then add up exactly).

    Diagonal δ holds the keys j with (N − 1 − j) // 128 = δ: the estimation rows, which end the sequence,
    meet those keys in the blocks δ below their own (exactly so when N is a multiple of 128).
    """
    diagonal = ((seq_len - 1 - key_positions.to(v_scores.device)) // BLOCK_SIZE).expand_as(v_scores)
    sums = v_scores.new_zeros(*v_scores.shape[:-1], block_diagonals(seq_len))
    return sums.scatter_add_(-1, diagonal, v_scores)


def _block_slash_index(
    scores: torch.Tensor, budget: TopPBudget, total_mass: torch.Tensor, seq_len: int, local_window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-P over block diagonals ``scores [b, Hq, ⌈N/128⌉]`` (all of them, δ ascending): the chosen δ as
    slash offsets 128·δ, ascending, padded with N (int32 ``[b, Hq, Smax]``), and their counts."""
    num_diagonals = scores.shape[-1]
    forced = min(forced_block_diagonals(local_window), num_diagonals)
    width = list_widths(budget, seq_len)[1]
    limit = min(budget.cap, num_diagonals)
    candidates = torch.arange(num_diagonals, device=scores.device).expand(scores.shape)
    ranked_scores, ranked = rank_candidates(scores, candidates, forced, min(width, num_diagonals), True)
    counts = top_p_counts(ranked_scores, forced, total_mass, budget.p, limit)
    chosen, counts = index_list(ranked, counts, min(width, num_diagonals), num_diagonals)
    offsets = torch.where(chosen < num_diagonals, chosen * BLOCK_SIZE, seq_len)
    padding = torch.full(
        (*offsets.shape[:-1], width - offsets.shape[-1]), seq_len, dtype=offsets.dtype, device=offsets.device
    )
    return torch.cat([offsets, padding], dim=-1), counts


def select_index(
    v_scores: torch.Tensor,
    v_indices: torch.Tensor,
    s_scores: torch.Tensor,
    s_indices: torch.Tensor,
    budget: StaticHeadBudgets | TopPBudget,
    total_mass: torch.Tensor | None,
    seq_len: int,
    sink_tokens: int,
    local_window: int,
    candidates_ascending: bool = False,
    implementation: str = "auto",
) -> VerticalSlashIndex:
    """The index from (score, global index) candidates ``[b, Hq, m]`` of verticals and of slashes.

    The candidates must contain every head's best Vmax (Smax) entries in the order of
    :func:`rank_candidates`: all of them, or the union of per-rank top lists. ``total_mass [b, Hq]``
    (int64, top-P only) is the sum of all vertical masses. ``candidates_ascending``: both index lists are
    ascending (all of them, 0 … m−1), so ranking skips its sort by index. A budget with ``block_slashes``
    takes every block diagonal's mass (:func:`block_diagonal_scores`) as ``s_scores`` (``s_indices`` unused).
    ``implementation``: :func:`rank_candidates`'s.
    """
    v_width, s_width = list_widths(budget, seq_len)
    if isinstance(budget, TopPBudget):
        v_sizes = s_sizes = None
    else:  # int32 on the host, so that one copy brings both and no cast runs on the device
        v_sizes, s_sizes = copy_to(_static_sizes(_budget_key(budget), v_scores.device), v_scores.device)
    kinds = [(v_scores, v_indices, sink_tokens, v_width, v_sizes)]
    block_slashes = isinstance(budget, TopPBudget) and budget.block_slashes
    if not block_slashes:
        kinds.append((s_scores, s_indices, local_window, s_width, s_sizes))
    lists = {}
    selected = []  # the kinds whose lists the Triton selection writes alone, in one launch
    ranked = []  # the kinds ranked first (their selections in one launch too), with their counts if fixed
    for kind, (scores, indices, num_forced, width, sizes) in enumerate(kinds):
        counts = None if sizes is None else sizes.expand(scores.shape[:-1])
        all_positions = candidates_ascending and scores.shape[-1] == seq_len
        if counts is not None and all_positions and width < seq_len and uses_triton(implementation, scores):
            selected.append((kind, (scores, num_forced, counts, width)))
        else:
            ranked.append((kind, (scores, indices, num_forced, width), counts))
    if selected:
        lists.update(zip((kind for kind, _ in selected), _selected_lists([args for _, args in selected])))
    rankings = rank_candidate_groups([group for _, group, _ in ranked], candidates_ascending, implementation)
    for (kind, (_, _, num_forced, width), counts), (ranked_scores, ranked_indices) in zip(ranked, rankings):
        if counts is None:
            counts = top_p_counts(ranked_scores, num_forced, total_mass, budget.p, budget.effective_cap(seq_len))
        lists[kind] = index_list(ranked_indices, counts, width, seq_len)
    if block_slashes:
        lists[1] = _block_slash_index(s_scores, budget, total_mass, seq_len, local_window)
    (v_idx, v_cnt), (s_idx, s_cnt) = lists[0], lists[1]
    return VerticalSlashIndex(v_idx, s_idx, v_cnt, s_cnt)
