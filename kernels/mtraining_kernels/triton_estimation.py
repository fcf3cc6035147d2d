"""Triton kernels of online index estimation (DESIGN.md §2.2), bit-identical to the PyTorch definitions.

``mtraining_kernels.estimation`` defines the estimation arithmetic with PyTorch ops; these kernels compute
the very same fp32 logits and int64 fixed-point scores on the GPU, without cuBLAS and without the
PyTorch path's full-size temporaries:

1. :func:`estimation_logits` — ℓ = scale·⟨q_i, k_j⟩ ``[b, Hq, L, n]``, −inf where j > i, written once.
   Tiles of 64 rows × 128 keys (any tile shape gives the same bits); entry (i, j) is the fp32 sum over
   t = 0 … d−1, in that order, of the fp32 products q[t]·k[t] (each product and each addition rounded
   separately: the kernels are compiled with ``enable_fp_fusion=False``, so no FMA), then multiplied by
   the fp32 scale.
2. :func:`exp_row_sums` — top-P row sums Z_i of E = round(exp(ℓ − m_i)·2^32), with the same fp64
   polynomial exponential (+, ×, floor, an exact power of two) as the PyTorch code.
3. :func:`static_scores` / :func:`top_p_scores` — (V(j), partial S(s)) straight from the logits, reading
   them once per score (the int64 terms are never stored): the vertical kernel reduces 64-row column
   tiles, the slash kernel reads skewed tiles (row r at columns c₀ + r + u) so that each tile column is
   one diagonal when the key positions are consecutive, and adds it with one int64 atomic; pairs whose
   offset differs from their column's (runs of keys that are not consecutive, as in a rank's shard)
   are added with their own atomics.
   Integer atomics are exact in any order, so the sums do not depend on scheduling.

The integer rules (fixed-point scale, static clamp, exponential coefficients, …) come from the caller as
:class:`FixedPointRules`; fp64 constants reach the kernels through a small fp64 tensor, because Triton
rounds Python float literals to fp32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .host_copies import to_device

ROWS_PER_TILE = 64  # the estimation rows, L ≤ 64: one tile
# Tile shapes and warps are the fastest of those timed at N = 512K (tests/gpu/test_estimation_gpu.py script
# mode; the timings are in docs/benchmarks.md). They set the launch only, never a bit of the results.
LOGIT_KEYS_PER_TILE = 128  # keys per logits tile
LOGIT_NUM_WARPS = 2
LOGIT_UNROLL = 8  # head dimensions per logits-loop iteration (1 when d is not a multiple)
SCORE_KEYS_PER_TILE = 128  # columns per vertical / slash score tile
SCORE_NUM_WARPS = 8
_KERNEL_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)
# positions of the fp64 constants in the tensor built by _constants
_ONE, _STATIC_LIMIT, _EXP_FLOOR, _LOG2_E, _FIRST_COEFFICIENT = (tl.constexpr(i) for i in range(5))


class FixedPointRules(NamedTuple):
    """The integer arithmetic of the scores (DESIGN.md §2.2), as ``mtraining_kernels.estimation`` defines it.

    ``one``: the fixed-point scale (2^32); ``static_logit_limit``: |ℓ| clamp of static terms;
    ``incomplete_score``: static V(j) of a column with a masked entry; ``exp_input_floor``: exponents
    below it count as it; ``log2_e``: log₂(e) in fp64; ``exp2_coefficients``: c₀ … c_K of the
    polynomial 2^f ≈ Σ c_k f^k on [0, 1), evaluated by Horner's rule from c_K down.
    """

    one: int
    static_logit_limit: float
    incomplete_score: int
    exp_input_floor: float
    log2_e: float
    exp2_coefficients: tuple[float, ...]


@functools.lru_cache(maxsize=16)
def _constants(rules: FixedPointRules, device: torch.device) -> torch.Tensor:
    """The rules' fp64 constants on ``device``, copied there once per process (read-only for the kernels)."""
    values = (float(rules.one), rules.static_logit_limit, rules.exp_input_floor, rules.log2_e, *rules.exp2_coefficients)
    return to_device(torch.tensor(values, dtype=torch.float64), device)


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _logits_kernel(
    Q_BY_DIM,
    K,
    Q_POS,
    K_POS,
    OUT,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_ob,
    stride_oh,
    stride_or,
    num_rows,
    num_keys,
    group_size,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """One tile of 64 rows × BLOCK_N keys of one (query head, sample); Q_BY_DIM is fp32 ``[b, Hq, d, L]``.

    The d-loop runs UNROLL dimensions per iteration (their loads can be issued together); the additions stay
    one per dimension in the order t = 0 … d−1, so the bits do not depend on UNROLL."""
    head = tl.program_id(1)
    sample = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < num_keys
    q_ptrs = Q_BY_DIM + sample * stride_qb + head.to(tl.int64) * stride_qh + rows
    k_ptrs = K + sample * stride_kb + (head // group_size).to(tl.int64) * stride_kh + cols * stride_kn
    q_t = tl.load(q_ptrs, mask=row_ok, other=0.0)
    k_t = tl.load(k_ptrs, mask=col_ok, other=0.0).to(tl.float32)
    acc = q_t[:, None] * k_t[None, :]
    for u in tl.static_range(1, UNROLL):  # t = 1 … UNROLL − 1
        q_t = tl.load(q_ptrs + u * stride_qd, mask=row_ok, other=0.0)
        k_t = tl.load(k_ptrs + u * stride_kd, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + q_t[:, None] * k_t[None, :]
    for first in range(UNROLL, HEAD_DIM, UNROLL):  # then UNROLL at a time, in order
        for u in tl.static_range(UNROLL):
            q_t = tl.load(q_ptrs + (first + u) * stride_qd, mask=row_ok, other=0.0)
            k_t = tl.load(k_ptrs + (first + u) * stride_kd, mask=col_ok, other=0.0).to(tl.float32)
            acc = acc + q_t[:, None] * k_t[None, :]
    logits = acc * scale
    q_pos = tl.load(Q_POS + rows, mask=row_ok, other=0)
    k_pos = tl.load(K_POS + cols, mask=col_ok, other=0)
    logits = tl.where(k_pos[None, :] > q_pos[:, None], float("-inf"), logits)
    out_ptrs = OUT + sample * stride_ob + head.to(tl.int64) * stride_oh + rows[:, None].to(tl.int64) * stride_or
    tl.store(out_ptrs + cols[None, :], logits, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _round_to_integer(x):
    """Round-half-to-even of fp64 ``x`` (as ``torch.round``), still fp64: |x| + 2^52 has unit spacing, and
    every fp64 of magnitude ≥ 2^52 is an integer already."""
    magnitude = tl.abs(x)
    rounded = tl.where(magnitude < 4503599627370496.0, (magnitude + 4503599627370496.0) - 4503599627370496.0, magnitude)
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _exp_fixed_point(logits, row_max, counted, CONSTANTS, NUM_COEFFICIENTS: tl.constexpr):
    """E = round(exp(ℓ − m)·2^32) as int64 from fp32 ``logits`` and fp32 ``row_max[:, None]``; 0 where not
    ``counted``. The exact fp64 steps of ``mtraining_kernels.estimation.exp_fixed_point``."""
    floor_value = tl.load(CONSTANTS + _EXP_FLOOR)
    shifted = tl.where(counted, logits.to(tl.float64) - row_max.to(tl.float64), floor_value)
    y = tl.maximum(shifted, floor_value) * tl.load(CONSTANTS + _LOG2_E)
    whole = tl.floor(y)
    fraction = y - whole
    poly = tl.zeros_like(fraction) + tl.load(CONSTANTS + _FIRST_COEFFICIENT + NUM_COEFFICIENTS - 1)
    for step in tl.static_range(NUM_COEFFICIENTS - 1):  # c_{K-1} down to c_0
        poly = poly * fraction
        poly = poly + tl.load(CONSTANTS + _FIRST_COEFFICIENT + NUM_COEFFICIENTS - 2 - step)
    power = ((whole.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    exp_values = _round_to_integer((poly * power) * tl.load(CONSTANTS + _ONE)).to(tl.int64)
    return tl.where(counted, exp_values, 0)


@triton.jit
def _score_terms(
    logits, counted, ROW_MAX, DENOMINATOR, rows, row_ok, CONSTANTS, TOP_P: tl.constexpr, NUM_COEFFICIENTS: tl.constexpr
):
    """int64 terms of the scores, 0 where not ``counted``: static, round(clamp(ℓ, ±limit)·2^32); top-P,
    P = round(E·2^32 / (L·Z_i)) with the row's max at ROW_MAX and L·Z_i (fp64) at DENOMINATOR."""
    one = tl.load(CONSTANTS + _ONE)
    if TOP_P:
        row_max = tl.load(ROW_MAX + rows, mask=row_ok, other=0.0)
        denominator = tl.load(DENOMINATOR + rows, mask=row_ok, other=1.0)
        exp_values = _exp_fixed_point(logits, row_max[:, None], counted, CONSTANTS, NUM_COEFFICIENTS)
        terms = _round_to_integer(exp_values.to(tl.float64) * one / denominator[:, None]).to(tl.int64)
    else:
        limit = tl.load(CONSTANTS + _STATIC_LIMIT)
        clamped = tl.minimum(tl.maximum(logits.to(tl.float64), -limit), limit)
        terms = _round_to_integer(clamped * one).to(tl.int64)
    return tl.where(counted, terms, 0)


@triton.jit
def _exp_row_sums_kernel(
    LOGITS,
    ROW_MAX,
    CONSTANTS,
    ROW_SUMS,
    stride_lb,
    stride_lh,
    stride_lr,
    stride_mb,
    stride_mh,
    num_rows,
    num_keys,
    NUM_COEFFICIENTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Adds Σ_j E(i, j) over one column tile into the int64 ROW_SUMS ``[b, Hq, L]`` (atomics)."""
    head = tl.program_id(1).to(tl.int64)
    sample = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    in_tile = row_ok[:, None] & (cols < num_keys)[None, :]
    tile_ptrs = LOGITS + sample * stride_lb + head * stride_lh + rows[:, None].to(tl.int64) * stride_lr + cols[None, :]
    logits = tl.load(tile_ptrs, mask=in_tile, other=0.0)
    row_offset = sample * stride_mb + head * stride_mh
    row_max = tl.load(ROW_MAX + row_offset + rows, mask=row_ok, other=0.0)
    counted = in_tile & (logits != float("-inf"))
    exp_values = _exp_fixed_point(logits, row_max[:, None], counted, CONSTANTS, NUM_COEFFICIENTS)
    tl.atomic_add(ROW_SUMS + row_offset + rows, tl.sum(exp_values, axis=1), mask=row_ok, sem="relaxed")


@triton.jit
def _vertical_kernel(
    LOGITS,
    ROW_MAX,
    DENOMINATOR,
    CONSTANTS,
    SCORES,
    stride_lb,
    stride_lh,
    stride_lr,
    stride_mb,
    stride_mh,
    stride_sb,
    stride_sh,
    num_rows,
    num_keys,
    incomplete_score,
    TOP_P: tl.constexpr,
    NUM_COEFFICIENTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """V(j) = Σ_i terms(i, j) of one column tile into int64 SCORES ``[b, Hq, n]``; static columns with a
    masked (−inf) logit get ``incomplete_score``."""
    head = tl.program_id(1).to(tl.int64)
    sample = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < num_keys
    in_tile = row_ok[:, None] & col_ok[None, :]
    tile_ptrs = LOGITS + sample * stride_lb + head * stride_lh + rows[:, None].to(tl.int64) * stride_lr + cols[None, :]
    logits = tl.load(tile_ptrs, mask=in_tile, other=0.0)
    masked = in_tile & (logits == float("-inf"))
    row_offset = sample * stride_mb + head * stride_mh
    terms = _score_terms(
        logits,
        in_tile & ~masked,
        ROW_MAX + row_offset,
        DENOMINATOR + row_offset,
        rows,
        row_ok,
        CONSTANTS,
        TOP_P,
        NUM_COEFFICIENTS,
    )
    scores = tl.sum(terms, axis=0)
    if not TOP_P:
        scores = tl.where(tl.max(masked.to(tl.int32), axis=0) > 0, incomplete_score, scores)
    tl.store(SCORES + sample * stride_sb + head * stride_sh + cols, scores, mask=col_ok)


@triton.jit
def _slash_kernel(
    LOGITS,
    Q_POS,
    K_POS,
    ROW_MAX,
    DENOMINATOR,
    CONSTANTS,
    SUMS,
    stride_lb,
    stride_lh,
    stride_lr,
    stride_mb,
    stride_mh,
    stride_sb,
    stride_sh,
    num_rows,
    num_keys,
    TOP_P: tl.constexpr,
    NUM_COEFFICIENTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Adds the terms of one skewed tile (row r, column u at key c₀ + r + u) into int64 SUMS ``[b, Hq, N]``
    at their offsets s = i − j; pairs with j > i are skipped.

    Per tile column, the pairs at its largest and at its smallest offset are summed first (one atomic
    each; with consecutive key positions that is the whole column), the rest are added one by one.
    """
    head = tl.program_id(1).to(tl.int64)
    sample = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    first_col = tl.program_id(0).to(tl.int64) * BLOCK_S - (BLOCK_M - 1)
    cols = first_col + rows[:, None] + tl.arange(0, BLOCK_S)[None, :]  # [BLOCK_M, BLOCK_S]
    row_ok = rows < num_rows
    in_tile = row_ok[:, None] & (cols >= 0) & (cols < num_keys)
    tile_ptrs = LOGITS + sample * stride_lb + head * stride_lh + rows[:, None].to(tl.int64) * stride_lr + cols
    logits = tl.load(tile_ptrs, mask=in_tile, other=0.0)
    q_pos = tl.load(Q_POS + rows, mask=row_ok, other=0)
    offsets = q_pos[:, None] - tl.load(K_POS + cols, mask=in_tile, other=0)
    counted = in_tile & (offsets >= 0) & (logits != float("-inf"))
    row_offset = sample * stride_mb + head * stride_mh
    terms = _score_terms(
        logits,
        counted,
        ROW_MAX + row_offset,
        DENOMINATOR + row_offset,
        rows,
        row_ok,
        CONSTANTS,
        TOP_P,
        NUM_COEFFICIENTS,
    )
    largest = tl.max(tl.where(counted, offsets, -1), axis=0)
    smallest = tl.min(tl.where(counted, offsets, 2**62), axis=0)  # above every offset
    at_largest = counted & (offsets == largest[None, :])
    at_smallest = counted & (offsets == smallest[None, :]) & ~at_largest
    elsewhere = counted & ~at_largest & ~at_smallest
    sums_ptr = SUMS + sample * stride_sb + head * stride_sh
    tl.atomic_add(sums_ptr + largest, tl.sum(tl.where(at_largest, terms, 0), axis=0), mask=largest >= 0, sem="relaxed")
    tl.atomic_add(
        sums_ptr + smallest,
        tl.sum(tl.where(at_smallest, terms, 0), axis=0),
        mask=(smallest != largest) & (largest >= 0),
        sem="relaxed",
    )
    tl.atomic_add(sums_ptr + offsets, terms, mask=elsewhere, sem="relaxed")


# ----------------------------------------------------------------------------------------------- launchers
def _check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for tensor in tensors:
        if tensor.device != device:
            raise ValueError(f"tensors on {tensor.device} and {device}; put all estimation inputs on one device")


def _check_logits(
    logits: torch.Tensor, q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None
) -> None:
    if logits.dtype != torch.float32 or logits.dim() != 4 or not 1 <= logits.shape[2] <= ROWS_PER_TILE:
        raise ValueError(
            f"logits must be fp32 [b, Hq, L, n] with 1 <= L <= {ROWS_PER_TILE}, got "
            f"{logits.dtype} {tuple(logits.shape)}"
        )
    if logits.stride(-1) != 1:
        raise ValueError(f"logits need unit stride along keys, got strides {logits.stride()}; pass .contiguous()")
    if q_positions is not None and q_positions.shape != (logits.shape[2],):
        raise ValueError(f"q_positions {tuple(q_positions.shape)} must be [L={logits.shape[2]}]")
    if k_positions is not None and k_positions.shape != (logits.shape[3],):
        raise ValueError(f"k_positions {tuple(k_positions.shape)} must be [n={logits.shape[3]}]")


def _row_stats(logits: torch.Tensor, row_tensor: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    if row_tensor.shape != logits.shape[:3]:
        raise ValueError(f"{name} {tuple(row_tensor.shape)} must be [b, Hq, L] = {tuple(logits.shape[:3])}")
    return row_tensor.to(dtype).contiguous()


def estimation_logits(
    q_rows: torch.Tensor,
    q_positions: torch.Tensor,
    k: torch.Tensor,
    k_positions: torch.Tensor,
    softmax_scale: float,
    *,
    keys_per_tile: int = LOGIT_KEYS_PER_TILE,
    num_warps: int = LOGIT_NUM_WARPS,
) -> torch.Tensor:
    """ℓ = scale·⟨q_i, k_j⟩: fp32 ``[b, Hq, L, n]``, −inf where k_positions[j] > q_positions[i].

    ``q_rows [b, L, Hq, d]`` (L ≤ 64) and global positions ``q_positions [L]``; ``k [b, n, Hkv, d]``
    and ``k_positions [n]`` in any order. Query head h reads KV head h // (Hq/Hkv). Bit-equal to
    ``mtraining_kernels.estimation.estimation_logits``: sequential fp32 sum over d of separately rounded
    products, times ``softmax_scale`` rounded to fp32. ``keys_per_tile`` (a power of two ≥ 16) and
    ``num_warps`` set the launch only; every entry is computed alone, so they never change a bit.
    """
    batch, num_rows, q_heads, dim = q_rows.shape
    k_batch, num_keys, kv_heads, k_dim = k.shape
    if (k_batch, k_dim) != (batch, dim) or q_heads % kv_heads or not 1 <= num_rows <= ROWS_PER_TILE:
        raise ValueError(
            f"q_rows {tuple(q_rows.shape)} and k {tuple(k.shape)} must be [b, L<={ROWS_PER_TILE}, Hq, d] "
            "and [b, n, Hkv, d] with Hq a multiple of Hkv"
        )
    if q_positions.shape != (num_rows,) or k_positions.shape != (num_keys,):
        raise ValueError(
            f"positions {tuple(q_positions.shape)}, {tuple(k_positions.shape)} must be "
            f"[L={num_rows}] and [n={num_keys}]"
        )
    if keys_per_tile < 16 or keys_per_tile & (keys_per_tile - 1):
        raise ValueError(f"keys_per_tile={keys_per_tile} must be a power of two >= 16")
    _check_device(q_rows, q_positions, k, k_positions)
    q_by_dim = q_rows.float().permute(0, 2, 3, 1).contiguous()  # [b, Hq, d, L]
    logits = torch.empty(batch, q_heads, num_rows, num_keys, dtype=torch.float32, device=k.device)
    scale = torch.tensor(softmax_scale, dtype=torch.float32).item()  # exactly an fp32 value
    grid = (triton.cdiv(num_keys, keys_per_tile), q_heads, batch)
    _logits_kernel[grid](
        q_by_dim,
        k,
        q_positions.long().contiguous(),
        k_positions.long().contiguous(),
        logits,
        q_by_dim.stride(0),
        q_by_dim.stride(1),
        q_by_dim.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        k.stride(3),
        logits.stride(0),
        logits.stride(1),
        logits.stride(2),
        num_rows,
        num_keys,
        q_heads // kv_heads,
        scale,
        HEAD_DIM=dim,
        BLOCK_M=ROWS_PER_TILE,
        BLOCK_N=keys_per_tile,
        UNROLL=LOGIT_UNROLL if dim % LOGIT_UNROLL == 0 else 1,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return logits


def exp_row_sums(logits: torch.Tensor, row_max: torch.Tensor, rules: FixedPointRules) -> torch.Tensor:
    """Z_i·2^32 = Σ_j round(exp(ℓ(i, j) − m_i)·2^32) over the logits' keys: int64 ``[b, Hq, L]``.

    ``logits [b, Hq, L, n]`` fp32 (−inf = masked, counts 0); ``row_max [b, Hq, L]`` the row maxima over
    all keys of the sequence. Equals ``exp_fixed_point(logits, row_max).sum(-1)`` of the PyTorch code.
    """
    _check_logits(logits)
    _check_device(logits, row_max)
    row_max = _row_stats(logits, row_max, "row_max", torch.float32)
    batch, q_heads, num_rows, num_keys = logits.shape
    row_sums = torch.zeros(batch, q_heads, num_rows, dtype=torch.int64, device=logits.device)
    grid = (triton.cdiv(num_keys, SCORE_KEYS_PER_TILE), q_heads, batch)
    _exp_row_sums_kernel[grid](
        logits,
        row_max,
        _constants(rules, logits.device),
        row_sums,
        logits.stride(0),
        logits.stride(1),
        logits.stride(2),
        row_max.stride(0),
        row_max.stride(1),
        num_rows,
        num_keys,
        NUM_COEFFICIENTS=len(rules.exp2_coefficients),
        BLOCK_M=ROWS_PER_TILE,
        BLOCK_N=SCORE_KEYS_PER_TILE,
        **_KERNEL_OPTIONS,
    )
    return row_sums


def _score_sums(logits, q_positions, k_positions, seq_len, rules, row_max, denominators, slashes=True):
    """(V ``[b, Hq, n]``, partial S ``[b, Hq, seq_len]`` or None without ``slashes``), int64; top-P when
    ``row_max`` is given."""
    _check_logits(logits, q_positions, k_positions)
    _check_device(logits, q_positions, k_positions)
    batch, q_heads, num_rows, num_keys = logits.shape
    top_p = row_max is not None
    if not top_p:  # unused by the static kernels: any fp tensor will do
        row_max = denominators = logits.new_zeros(1, 1, 1)
    constants = _constants(rules, logits.device)
    vertical = torch.empty(batch, q_heads, num_keys, dtype=torch.int64, device=logits.device)
    shared = (logits.stride(0), logits.stride(1), logits.stride(2), row_max.stride(0), row_max.stride(1))
    meta = dict(
        TOP_P=top_p,
        NUM_COEFFICIENTS=len(rules.exp2_coefficients),
        BLOCK_M=ROWS_PER_TILE,
        num_warps=SCORE_NUM_WARPS,
        enable_fp_fusion=False,
    )
    _vertical_kernel[(triton.cdiv(num_keys, SCORE_KEYS_PER_TILE), q_heads, batch)](
        logits,
        row_max,
        denominators,
        constants,
        vertical,
        *shared,
        vertical.stride(0),
        vertical.stride(1),
        num_rows,
        num_keys,
        rules.incomplete_score,
        BLOCK_N=SCORE_KEYS_PER_TILE,
        **meta,
    )
    if not slashes:
        return vertical, None
    slash = torch.zeros(batch, q_heads, seq_len, dtype=torch.int64, device=logits.device)
    _slash_kernel[(triton.cdiv(num_keys + ROWS_PER_TILE - 1, SCORE_KEYS_PER_TILE), q_heads, batch)](
        logits,
        q_positions.long().contiguous(),
        k_positions.long().contiguous(),
        row_max,
        denominators,
        constants,
        slash,
        *shared,
        slash.stride(0),
        slash.stride(1),
        num_rows,
        num_keys,
        BLOCK_S=SCORE_KEYS_PER_TILE,
        **meta,
    )
    return vertical, slash


def static_scores(
    logits: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor, seq_len: int, rules: FixedPointRules
) -> tuple[torch.Tensor, torch.Tensor]:
    """Static scores of the logits' keys: (V ``[b, Hq, n]``, partial S ``[b, Hq, seq_len]``), int64.

    Terms are round(clamp(ℓ, ±limit)·2^32), 0 where masked; V(j) is their column sum, or
    ``rules.incomplete_score`` when the column has a masked logit; S(s) sums the pairs with
    q_positions[i] − k_positions[j] = s ≥ 0. Equal to the PyTorch ``static_logit_fixed_point``,
    ``vertical_scores`` and ``slash_partial_sums``.
    """
    return _score_sums(logits, q_positions, k_positions, seq_len, rules, None, None)


def top_p_scores(
    logits: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    seq_len: int,
    row_max: torch.Tensor,
    row_sums: torch.Tensor,
    rules: FixedPointRules,
    slashes: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top-P scores of the logits' keys: (V ``[b, Hq, n]``, partial S ``[b, Hq, seq_len]`` or None without
    ``slashes``), int64.

    Terms are the masses P = round(E·2^32 / (L·Z_i)) with ``row_max`` and ``row_sums`` (int64 Z_i·2^32)
    ``[b, Hq, L]`` over all keys of the sequence; V and S sum them as in :func:`static_scores`. Equal to
    the PyTorch ``probability_fixed_point``, ``vertical_scores`` and ``slash_partial_sums``.
    """
    row_max = _row_stats(logits, row_max, "row_max", torch.float32)
    denominators = _row_stats(logits, row_sums, "row_sums", torch.int64).double() * logits.shape[2]
    return _score_sums(logits, q_positions, k_positions, seq_len, rules, row_max, denominators, slashes)
