"""Triton kernels of online index estimation (DESIGN.md §2.2): logits on tensor cores, integer scores.

``mtraining_kernels.estimation`` defines the estimation with PyTorch ops; these kernels compute the same
int64 fixed-point scores on the GPU from logits that are never stored:

* **Logits** ℓ = scale·⟨q_i, k_j⟩ are one ``tl.dot`` per 64-row × 64-key tile (fp16/bf16 inputs on tensor
  cores with fp32 accumulation; other dtypes in fp32 with IEEE products), times the fp32 scale, −inf where
  the key's position is after the row's. Every launch uses the same tile and warps, so entry (i, j) is a
  fixed function of q_i and k_j: the same bits whichever keys share its tile, in every pass below and on
  every rank of a context-parallel group. They are not the bits of the PyTorch definition (a sequential
  fp32 sum): the two paths agree to fp32 rounding, each is bit-identical to its own distributed estimator.
* **Passes** over key tiles (grid: query heads fastest, so the query heads of one KV head read a key tile
  while it is in L2; a program loads its head's rows once and runs one key tile, or several where that
  measured faster; the top-P passes under register caps, which measured faster too): the row maxima per
  tile (top-P), the row sums Z_i of E = round(exp(ℓ − m_i)·2^32) (top-P; int64 atomics), then the scores:
  V(j) of a tile's columns (all rows are in the tile, a plain store) and the partial slash sums S(s). With
  consecutive key and row positions (the whole sequence, a document, a 128-token block of a shard) a tile's
  diagonals are gathered in registers (static terms as the fp32 integers they are, half the bytes of int64)
  and each is added with one int64 atomic; otherwise every pair is added at its own offset. A caller whose
  positions are consecutive in every tile says so (``consecutive_keys``): the pass then neither checks each
  tile nor compiles the per-pair branch, whose registers cost the static pass a third of its programs per
  multiprocessor. One more pass stores the logits (:func:`estimation_logits`), with the same dot code.
* The integer arithmetic is the PyTorch code's, step for step (the static terms' clamp and rounding, the fp32
  polynomial exponential and masses, each step one IEEE-rounded fp32 operation, never fused), so the scores of
  given logits are bit-equal to ``mtraining_kernels.estimation``'s; integer atomics are exact in any order.

Each pass also takes stored logits instead of q and k (:class:`QueryKeyTiles` or a logits tensor), which is
how the tests hold the integer arithmetic to the PyTorch code on crafted values. The integer rules come from
the caller as :class:`FixedPointRules`; their constants, all fp32 values, reach the kernels through a small fp32
tensor.
"""

from __future__ import annotations

import functools
import os
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .direct_launch import direct
from .host_copies import to_device

ROWS_PER_TILE = 64  # the estimation rows, L ≤ 64: one tile
KEYS_PER_TILE = 64  # keys per tile; equal to the rows, so a tile's diagonals gather within its shape
NUM_WARPS = 4  # every pass: one dot code, hence one value per logit
# the passes over key tiles
_ROW_MAXIMA, _ROW_SUMS, _SCORES, _STORED_LOGITS = (tl.constexpr(i) for i in range(4))
# key tiles one program runs, one after the other, with its query rows loaded once: more than one only where it
# measured faster (docs/benchmarks.md, session 46); the passes with the most registers lose occupancy instead
_TILES_PER_PROGRAM = {_ROW_MAXIMA.value: 4}  # by pass; others 1
# register caps (Triton's maxnreg) by (pass, top-P terms): the exponential's passes run more programs per
# multiprocessor under a cap, worth its spills where measured (docs/benchmarks.md, session 47); others uncapped
_MAX_REGISTERS = {(_ROW_SUMS.value, False): 96, (_SCORES.value, True): 128}
# positions of the constants in the tensor built by _constants
_ONE, _STATIC_LIMIT, _EXP_FLOOR, _LOG2_E, _FIRST_COEFFICIENT = (tl.constexpr(i) for i in range(5))


class QueryKeyTiles(NamedTuple):
    """The logits of the estimation rows against some keys, computed tile by tile and never stored.

    ``q_rows [b, L, Hq, d]`` (L ≤ 64), ``k [b, n, Hkv, d]``; query head h reads KV head h // (Hq/Hkv).
    """

    q_rows: torch.Tensor
    k: torch.Tensor
    softmax_scale: float


class FixedPointRules(NamedTuple):
    """The integer arithmetic of the scores (DESIGN.md §2.2), as ``mtraining_kernels.estimation`` defines it.

    ``one``: the fixed-point scale (2^32); ``static_logit_limit``: |ℓ| clamp of static terms;
    ``incomplete_score``: static V(j) of a column with a masked entry; ``exp_input_floor``: exponents
    below it count as it; ``log2_e``: log₂(e) rounded to fp32; ``exp2_coefficients``: c₀ … c_K (fp32 values) of the
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
    """The rules' constants as fp32 on ``device`` (each an fp32 value already), copied there once per process
    (read-only for the kernels)."""
    values = (float(rules.one), rules.static_logit_limit, rules.exp_input_floor, rules.log2_e, *rules.exp2_coefficients)
    constants = torch.tensor(values, dtype=torch.float32)
    if constants.double().tolist() != list(values):
        raise ValueError(f"fixed-point constants {values} must be fp32 values, so that no path rounds them")
    return to_device(constants, device)


# --------------------------------------------------------------------------------------------- kernels
@triton.jit
def _round_to_integer(x):
    """Round-half-to-even of fp32 ``x`` (as ``torch.round``), still fp32: |x| + 2^23 has unit spacing below
    2^23, and every fp32 of magnitude ≥ 2^23 is an integer already."""
    magnitude = tl.abs(x)
    rounded = tl.where(magnitude < 8388608.0, (magnitude + 8388608.0) - 8388608.0, magnitude)
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _exp_fixed_point(logits, row_max, counted, CONSTANTS, NUM_COEFFICIENTS: tl.constexpr):
    """E = round(exp(ℓ − m)·2^32) as an fp32 integer (≤ 2^32, its int64 conversion exact) from fp32 ``logits``
    and ``row_max[:, None]``; 0 where not ``counted``. The fp32 steps of
    ``mtraining_kernels.estimation.exp_fixed_point``."""
    floor_value = tl.load(CONSTANTS + _EXP_FLOOR)
    shifted = tl.where(counted, logits - row_max, floor_value)
    y = tl.maximum(shifted, floor_value) * tl.load(CONSTANTS + _LOG2_E)
    whole = tl.floor(y)
    fraction = y - whole
    poly = tl.zeros_like(fraction) + tl.load(CONSTANTS + _FIRST_COEFFICIENT + NUM_COEFFICIENTS - 1)
    for step in tl.static_range(NUM_COEFFICIENTS - 1):  # c_{K-1} down to c_0
        poly = poly * fraction
        poly = poly + tl.load(CONSTANTS + _FIRST_COEFFICIENT + NUM_COEFFICIENTS - 2 - step)
    power = ((whole.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    exp_values = _round_to_integer((poly * power) * tl.load(CONSTANTS + _ONE))
    return tl.where(counted, exp_values, 0.0)


@triton.jit
def _score_terms(
    logits, counted, ROW_MAX, MASS_SCALE, rows, row_ok, CONSTANTS, TOP_P: tl.constexpr, NUM_COEFFICIENTS: tl.constexpr
):
    """Terms of the scores, 0 where not ``counted``, as fp32 integers whose ``.to(tl.int64)`` is exact (so that the
    slash sums' gather moves half the bytes of int64): static, round(clamp(ℓ, ±limit)·2^32); top-P,
    P = round(E·R_i) with the row's max at ROW_MAX and R_i = 2^32 / (L·Z_i·2^32) (fp32) at MASS_SCALE."""
    if TOP_P:
        row_max = tl.load(ROW_MAX + rows, mask=row_ok, other=0.0)
        mass_scale = tl.load(MASS_SCALE + rows, mask=row_ok, other=0.0)
        exp_values = _exp_fixed_point(logits, row_max[None, :], counted, CONSTANTS, NUM_COEFFICIENTS)
        terms = _round_to_integer(exp_values * mass_scale[None, :])
    else:
        terms = _static_fixed_point(logits, tl.load(CONSTANTS + _STATIC_LIMIT), tl.load(CONSTANTS + _ONE))
    return tl.where(counted, terms, 0)


@triton.jit
def _static_fixed_point(logits, limit, one):
    """round(clamp(ℓ, ±limit)·one), an integer held in fp32, for the rules' powers of two (2^24, 2^32): the
    product is exact (at most 2^56) and its rounding exact too (:func:`_round_to_integer`), so its int64
    conversion gives the bits of the fp64 steps of ``static_logit_fixed_point``."""
    clamped = tl.minimum(tl.maximum(logits, -limit), limit)
    return _round_to_integer(clamped * one)


@triton.jit
def _logit_pointers(LOGITS, sample, head, rows, cols, stride_lb, stride_lh, stride_lr):
    """Pointers ``[cols, rows]`` into LOGITS ``[b, Hq, L, n]`` (unit stride over keys)."""
    ptrs = LOGITS + sample * stride_lb + head.to(tl.int64) * stride_lh + rows[None, :].to(tl.int64) * stride_lr
    return ptrs + cols[:, None]


@triton.jit
def _query_tile(
    Q,
    sample,
    head,
    rows,
    row_ok,
    stride_qb,
    stride_ql,
    stride_qh,
    stride_qd,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    """The estimation rows of one query head, ``[rows, DIM_PAD]`` (zero past the head dim and the rows)."""
    dims = tl.arange(0, DIM_PAD)
    q_ptrs = Q + sample * stride_qb + head.to(tl.int64) * stride_qh + rows[:, None] * stride_ql
    return tl.load(q_ptrs + dims[None, :] * stride_qd, mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _logit_tile(
    q,
    q_pos,
    K,
    LOGITS,
    K_POS,
    sample,
    head,
    rows,
    cols,
    row_ok,
    col_ok,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_lb,
    stride_lh,
    stride_lr,
    group_size,
    scale,
    FROM_QK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IEEE: tl.constexpr,
):
    """fp32 logits ``[cols, rows]`` of one tile (keys first), −inf where the key comes after the row; from k and
    the query tile ``q`` at positions ``q_pos`` (one dot), or loaded from LOGITS ``[b, Hq, L, n]``. Entries outside
    the tile are unspecified (the caller masks them). Keys first: the tensor-core layout spreads a tile's first
    axis over the warps, so sums over the rows (V, the slash diagonals) stay inside each warp's quads."""
    if FROM_QK:
        dims = tl.arange(0, DIM_PAD)
        k_ptrs = K + sample * stride_kb + (head // group_size).to(tl.int64) * stride_kh + cols[:, None] * stride_kn
        k = tl.load(k_ptrs + dims[None, :] * stride_kd, mask=col_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
        if IEEE:
            products = tl.dot(k, tl.trans(q), input_precision="ieee")
        else:
            products = tl.dot(k, tl.trans(q))
        k_pos = tl.load(K_POS + cols, mask=col_ok, other=0)
        logits = tl.where(k_pos[:, None] > q_pos[None, :], float("-inf"), products * scale)
    else:
        ptrs = _logit_pointers(LOGITS, sample, head, rows, cols, stride_lb, stride_lh, stride_lr)
        logits = tl.load(ptrs, mask=col_ok[:, None] & row_ok[None, :], other=0.0)
    return logits


@triton.jit
def _add_slash_sums(
    terms,
    in_tile,
    rows,
    cols,
    first_col,
    row_ok,
    col_ok,
    Q_POS,
    K_POS,
    SUMS,
    seq_len,
    BLOCK: tl.constexpr,
    CONSECUTIVE: tl.constexpr,
):
    """Adds the ``terms [BLOCK keys, BLOCK rows]`` of one tile (as :func:`_score_terms` gives them, converted to
    int64 after the gather) into SUMS ``[seq_len]`` at their offsets
    s = i − j (terms of pairs with j > i are 0). Consecutive rows and keys: diagonal e = r − u + BLOCK − 1 of
    the tile (row r, key u) holds one offset; one gather over the keys lines up diagonals d and d + BLOCK in
    line d, whose two sums are added with one atomic each. Otherwise one atomic per pair.
    ``CONSECUTIVE``: the caller guarantees consecutive positions, so neither the check nor the per-pair
    branch is compiled (their registers cost the pass a program per multiprocessor)."""
    steps = tl.arange(0, BLOCK)
    q_pos = tl.load(Q_POS + rows, mask=row_ok, other=0)
    k_pos = tl.load(K_POS + cols, mask=col_ok, other=0)
    first_q = tl.load(Q_POS)
    first_k = tl.load(K_POS + first_col)
    if CONSECUTIVE:
        broken = 0
    else:
        broken = tl.sum((row_ok & (q_pos != first_q + rows)).to(tl.int32), axis=0) + tl.sum(
            (col_ok & (k_pos != first_k + steps)).to(tl.int32), axis=0
        )
    if broken == 0:
        lowest = first_q - first_k - (BLOCK - 1)  # the offset of diagonal e = 0
        d = steps[:, None]
        r = rows[None, :]
        # line d, row r: key u = (r − d + BLOCK − 1) mod BLOCK, on diagonal d if r <= d, else on d + BLOCK
        lined_up = tl.gather(terms, (r - d + (BLOCK - 1)) % BLOCK, axis=0).to(tl.int64)
        for half in tl.static_range(2):  # diagonals e = half·BLOCK + d, d = 0 … BLOCK − 1
            on_diagonal = (r > d) if half else (r <= d)
            total = tl.sum(tl.where(on_diagonal, lined_up, 0), axis=1)
            diagonal_offsets = lowest + half * BLOCK + steps
            diagonal_kept = (diagonal_offsets >= 0) & (diagonal_offsets < seq_len)
            tl.atomic_add(SUMS + diagonal_offsets, total, mask=diagonal_kept, sem="relaxed")
    else:
        pair_offsets = q_pos[None, :] - k_pos[:, None]
        pair_kept = in_tile & (pair_offsets >= 0) & (pair_offsets < seq_len)
        tl.atomic_add(SUMS + pair_offsets, terms.to(tl.int64), mask=pair_kept, sem="relaxed")


def _pass_name(specialization) -> str:
    """The name a compiled pass of :func:`_key_tile_kernel` carries in profiles and traces, e.g.
    ``estimation_scores_top_p_slashes``: one kernel, four passes, told apart."""
    constants = {name: getattr(value, "value", value) for name, value in specialization.constants.items()}
    name = ("row_maxima", "row_sums", "scores", "stored_logits")[constants["PASS"]]
    if constants["PASS"] == _SCORES.value:
        name += ("_top_p" if constants["TOP_P"] else "_static") + ("_slashes" if constants["SLASHES"] else "")
    return f"estimation_{name}"


@triton.jit(repr=_pass_name)
def _key_tile_kernel(
    Q,
    K,
    LOGITS,
    Q_POS,
    K_POS,
    CONSTANTS,
    ROW_MAX,
    MASS_SCALE,
    TILE_MAX,
    ROW_SUMS,
    VERTICAL,
    SLASH,
    stride_qb,
    stride_ql,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_lb,
    stride_lh,
    stride_lr,
    num_rows,
    num_keys,
    num_heads,
    num_tiles,
    seq_len,
    group_size,
    scale,
    incomplete_score,
    PASS: tl.constexpr,
    FROM_QK: tl.constexpr,
    TOP_P: tl.constexpr,
    SLASHES: tl.constexpr,
    CONSECUTIVE: tl.constexpr,
    NUM_COEFFICIENTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    """One pass over key tiles g·TILES … g·TILES + TILES − 1 of one query head and sample: ``program_id(0)`` =
    g·Hq + head (the heads of a tile run together), ``program_id(1)`` = sample; the head's rows are loaded once.

    Row statistics are ``[b, Hq, L]`` (contiguous); TILE_MAX ``[b, Hq, L, tiles]``; VERTICAL ``[b, Hq, n]``;
    SLASH ``[b, Hq, seq_len]``. _ROW_MAXIMA stores the tile's row maxima; _ROW_SUMS adds Σ_j E(i, j) into
    ROW_SUMS; _SCORES stores V(j) (static: ``incomplete_score`` for a column with a masked entry) and, with
    SLASHES, adds the partial S(s). Top-P terms use ROW_MAX and MASS_SCALE (fp32, see :func:`_score_terms`).
    _STORED_LOGITS writes the tile's logits, computed from q and k, into LOGITS ``[b, Hq, L, n]``.
    """
    head = tl.program_id(0) % num_heads
    sample = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, BLOCK)
    row_ok = rows < num_rows
    row_stats = (sample * num_heads + head) * num_rows
    q_pos = tl.load(Q_POS + rows, mask=row_ok, other=0)
    if FROM_QK:
        q = _query_tile(Q, sample, head, rows, row_ok, stride_qb, stride_ql, stride_qh, stride_qd, HEAD_DIM, DIM_PAD)
    else:
        q = q_pos  # not read
    for step in range(TILES):
        tile = (tl.program_id(0) // num_heads) * TILES + step
        if tile < num_tiles:
            cols = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            col_ok = cols < num_keys
            in_tile = col_ok[:, None] & row_ok[None, :]
            logits = _logit_tile(
                q,
                q_pos,
                K,
                LOGITS,
                K_POS,
                sample,
                head,
                rows,
                cols,
                row_ok,
                col_ok,
                stride_kb,
                stride_kn,
                stride_kh,
                stride_kd,
                stride_lb,
                stride_lh,
                stride_lr,
                group_size,
                scale,
                FROM_QK,
                HEAD_DIM,
                DIM_PAD,
                IEEE,
            )
            if PASS == _STORED_LOGITS:
                ptrs = _logit_pointers(LOGITS, sample, head, rows, cols, stride_lb, stride_lh, stride_lr)
                tl.store(ptrs, logits, mask=in_tile)
            elif PASS == _ROW_MAXIMA:
                tile_max = tl.max(tl.where(in_tile, logits, float("-inf")), axis=0)
                tl.store(TILE_MAX + (row_stats + rows) * num_tiles + tile, tile_max, mask=row_ok)
            elif PASS == _ROW_SUMS:
                row_max = tl.load(ROW_MAX + row_stats + rows, mask=row_ok, other=0.0)
                counted = in_tile & (logits != float("-inf"))
                exp_values = _exp_fixed_point(logits, row_max[None, :], counted, CONSTANTS, NUM_COEFFICIENTS)
                row_sums = tl.sum(exp_values.to(tl.int64), axis=0)
                tl.atomic_add(ROW_SUMS + row_stats + rows, row_sums, mask=row_ok, sem="relaxed")
            else:
                masked = in_tile & (logits == float("-inf"))
                terms = _score_terms(
                    logits,
                    in_tile & ~masked,
                    ROW_MAX + row_stats,
                    MASS_SCALE + row_stats,
                    rows,
                    row_ok,
                    CONSTANTS,
                    TOP_P,
                    NUM_COEFFICIENTS,
                )
                scores = tl.sum(terms.to(tl.int64), axis=1)
                if not TOP_P:
                    scores = tl.where(tl.max(masked.to(tl.int32), axis=1) > 0, incomplete_score, scores)
                head_offset = sample * num_heads + head
                tl.store(VERTICAL + head_offset * num_keys + cols, scores, mask=col_ok)
                if SLASHES:
                    _add_slash_sums(
                        terms,
                        in_tile,
                        rows,
                        cols,
                        tile.to(tl.int64) * BLOCK,
                        row_ok,
                        col_ok,
                        Q_POS,
                        K_POS,
                        SLASH + head_offset * seq_len,
                        seq_len,
                        BLOCK,
                        CONSECUTIVE,
                    )


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


def _row_stats(shape: tuple[int, ...], row_tensor: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``row_tensor`` as contiguous ``dtype`` after checking it is ``[b, Hq, L]`` of the source's ``shape``."""
    if row_tensor.shape != tuple(shape[:3]):
        raise ValueError(f"{name} {tuple(row_tensor.shape)} must be [b, Hq, L] = {tuple(shape[:3])}")
    return row_tensor.to(dtype).contiguous()


class _Tiles(NamedTuple):
    """A logits source as kernel arguments: the pointers (Q, K, LOGITS), their 11 strides, the shape
    (b, Hq, L, n), the GQA group size, the scale and the compile-time choices."""

    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    strides: tuple[int, ...]
    shape: tuple[int, int, int, int]
    group_size: int
    scale: float
    meta: dict


def _dot_operands(q_rows: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(q, k, ieee): fp16/bf16 pairs go to the tensor cores as they are, anything else in fp32 with IEEE products.

    Triton's CPU interpreter multiplies 16-bit dot operands as raw bits, so there every pair goes through fp32.
    """
    half = q_rows.dtype == k.dtype and q_rows.dtype in (torch.float16, torch.bfloat16)
    if half and os.environ.get("TRITON_INTERPRET") != "1":
        return q_rows, k, False
    return q_rows.float(), k.float(), True


def _tiles(source, q_positions: torch.Tensor, k_positions: torch.Tensor) -> _Tiles:
    """Checks ``source`` (:class:`QueryKeyTiles` or fp32 logits ``[b, Hq, L, n]``) against the positions and
    returns its kernel arguments; ``ValueError`` naming what does not fit."""
    if not isinstance(source, QueryKeyTiles):
        _check_logits(source, q_positions, k_positions)
        _check_device(source, q_positions, k_positions)
        no_qk = (source, source)
        strides = (0,) * 8 + tuple(source.stride()[:3])
        meta = dict(FROM_QK=False, HEAD_DIM=16, DIM_PAD=16, IEEE=True)
        return _Tiles((*no_qk, source), strides, tuple(source.shape), 1, 1.0, meta)
    q_rows, k, softmax_scale = source
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
    _check_device(q_rows, q_positions, k, k_positions)
    q_rows, k, ieee = _dot_operands(q_rows, k)
    scale = struct.unpack("f", struct.pack("f", softmax_scale))[0]  # rounded to the nearest fp32, as a float
    meta = dict(FROM_QK=True, HEAD_DIM=dim, DIM_PAD=max(16, triton.next_power_of_2(dim)), IEEE=ieee)
    strides = (*q_rows.stride(), *k.stride(), 0, 0, 0)
    return _Tiles((q_rows, k, k), strides, (batch, q_heads, num_rows, num_keys), q_heads // kv_heads, scale, meta)


def _run_pass(
    tiles: _Tiles,
    pass_number: int,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    *,
    rules: FixedPointRules | None = None,
    row_max: torch.Tensor | None = None,
    mass_scales: torch.Tensor | None = None,
    tile_max: torch.Tensor | None = None,
    row_sums: torch.Tensor | None = None,
    vertical: torch.Tensor | None = None,
    slash: torch.Tensor | None = None,
    seq_len: int = 0,
    consecutive_keys: bool = False,
) -> None:
    """Launches one pass of :func:`_key_tile_kernel`; unused buffers may be None (any tensor stands in)."""
    batch, q_heads, num_rows, num_keys = tiles.shape
    num_tiles = triton.cdiv(num_keys, KEYS_PER_TILE)
    tiles_per_program = _TILES_PER_PROGRAM.get(pass_number, 1)
    num_groups = triton.cdiv(num_tiles, tiles_per_program)
    stand_in = tiles.tensors[2]
    buffers = [row_max, mass_scales, tile_max, row_sums, vertical, slash]
    constants = _constants(rules, stand_in.device) if rules is not None else stand_in
    top_p = row_max is not None and pass_number == _SCORES.value
    direct(_key_tile_kernel)(
        (num_groups * q_heads, batch),
        *tiles.tensors,
        q_positions.long().contiguous(),
        k_positions.long().contiguous(),
        constants,
        *(stand_in if buffer is None else buffer for buffer in buffers),
        *tiles.strides,
        num_rows,
        num_keys,
        q_heads,
        num_tiles,
        seq_len,
        tiles.group_size,
        tiles.scale,
        rules.incomplete_score if rules is not None else 0,
        PASS=pass_number,
        TOP_P=top_p,
        SLASHES=slash is not None,
        CONSECUTIVE=consecutive_keys,
        NUM_COEFFICIENTS=len(rules.exp2_coefficients) if rules is not None else 1,
        BLOCK=KEYS_PER_TILE,
        TILES=tiles_per_program,
        num_warps=NUM_WARPS,
        maxnreg=_MAX_REGISTERS.get((pass_number, top_p)),
        enable_fp_fusion=False,
        **tiles.meta,
    )


def estimation_logits(
    q_rows: torch.Tensor, q_positions: torch.Tensor, k: torch.Tensor, k_positions: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """ℓ = scale·⟨q_i, k_j⟩: fp32 ``[b, Hq, L, n]``, −inf where k_positions[j] > q_positions[i].

    ``q_rows [b, L, Hq, d]`` (L ≤ 64) and global positions ``q_positions [L]``; ``k [b, n, Hkv, d]`` and
    ``k_positions [n]`` in any order. The very logits every pass of this module computes (one dot per
    64 × 64 tile, see the module docstring), stored.
    """
    tiles = _tiles(QueryKeyTiles(q_rows, k, softmax_scale), q_positions, k_positions)
    logits = torch.empty(tiles.shape, dtype=torch.float32, device=k.device)
    q_operand, k_operand, _ = tiles.tensors
    logit_strides = logits.stride()[:3]  # over b, Hq, L; unit stride over keys
    into_logits = tiles._replace(tensors=(q_operand, k_operand, logits), strides=(*tiles.strides[:8], *logit_strides))
    _run_pass(into_logits, _STORED_LOGITS.value, q_positions, k_positions)
    return logits


def row_maxima(source, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """m_i = max_j ℓ(i, j) over the source's keys: fp32 ``[b, Hq, L]`` (−inf for a row with no key before it).

    ``source``: :class:`QueryKeyTiles` or fp32 logits ``[b, Hq, L, n]``."""
    tiles = _tiles(source, q_positions, k_positions)
    if not tiles.meta["FROM_QK"]:
        return source.amax(dim=-1)
    batch, q_heads, num_rows, num_keys = tiles.shape
    device = tiles.tensors[0].device
    per_tile = torch.empty(batch, q_heads, num_rows, triton.cdiv(num_keys, KEYS_PER_TILE), device=device)
    _run_pass(tiles, _ROW_MAXIMA.value, q_positions, k_positions, tile_max=per_tile)
    return per_tile.amax(dim=-1)


def exp_row_sums(
    source, q_positions: torch.Tensor, k_positions: torch.Tensor, row_max: torch.Tensor, rules: FixedPointRules
) -> torch.Tensor:
    """Z_i·2^32 = Σ_j round(exp(ℓ(i, j) − m_i)·2^32) over the source's keys: int64 ``[b, Hq, L]``.

    ``source`` as in :func:`row_maxima` (masked logits count 0); ``row_max [b, Hq, L]`` the row maxima over
    all keys of the sequence. Equals ``exp_fixed_point(logits, row_max).sum(-1)`` of the PyTorch code.
    """
    tiles = _tiles(source, q_positions, k_positions)
    row_max = _row_stats(tiles.shape, row_max, "row_max", torch.float32)
    row_sums = torch.zeros(tiles.shape[:3], dtype=torch.int64, device=row_max.device)
    _check_device(tiles.tensors[0], row_max)
    _run_pass(tiles, _ROW_SUMS.value, q_positions, k_positions, rules=rules, row_max=row_max, row_sums=row_sums)
    return row_sums


def _score_sums(
    source,
    q_positions,
    k_positions,
    seq_len,
    rules,
    row_max=None,
    mass_scales=None,
    slashes=True,
    consecutive_keys=False,
):
    """(V ``[b, Hq, n]``, partial S ``[b, Hq, seq_len]`` or None without ``slashes``), int64; top-P when
    ``row_max`` is given."""
    tiles = _tiles(source, q_positions, k_positions)
    batch, q_heads, _, num_keys = tiles.shape
    device = tiles.tensors[0].device
    vertical = torch.empty(batch, q_heads, num_keys, dtype=torch.int64, device=device)
    slash = torch.zeros(batch, q_heads, seq_len, dtype=torch.int64, device=device) if slashes else None
    _run_pass(
        tiles,
        _SCORES.value,
        q_positions,
        k_positions,
        rules=rules,
        row_max=row_max,
        mass_scales=mass_scales,
        vertical=vertical,
        slash=slash,
        seq_len=seq_len,
        consecutive_keys=consecutive_keys,
    )
    return vertical, slash


def static_scores(
    source,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    seq_len: int,
    rules: FixedPointRules,
    consecutive_keys: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Static scores of the source's keys: (V ``[b, Hq, n]``, partial S ``[b, Hq, seq_len]``), int64.

    ``source`` as in :func:`row_maxima`. Terms are round(clamp(ℓ, ±limit)·2^32), 0 where masked; V(j) is
    their column sum, or ``rules.incomplete_score`` when the column has a masked logit; S(s) sums the pairs
    with q_positions[i] − k_positions[j] = s ≥ 0. Equal to the PyTorch ``static_logit_fixed_point``,
    ``vertical_scores`` and ``slash_partial_sums`` of the same logits. ``consecutive_keys``: the caller
    guarantees that ``q_positions`` are consecutive and so is every tile of ``KEYS_PER_TILE`` keys of
    ``k_positions`` (keys t·64 … t·64 + 63); the pass then skips its per-tile check (wrong sums otherwise).
    """
    return _score_sums(source, q_positions, k_positions, seq_len, rules, consecutive_keys=consecutive_keys)


def top_p_scores(
    source,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    seq_len: int,
    row_max: torch.Tensor,
    row_sums: torch.Tensor,
    rules: FixedPointRules,
    slashes: bool = True,
    consecutive_keys: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top-P scores of the source's keys: (V ``[b, Hq, n]``, partial S ``[b, Hq, seq_len]`` or None without
    ``slashes``), int64.

    Terms are the masses P = round(E·R_i), R_i = 2^32 / (L·Z_i·2^32) rounded to fp32 once per row, with
    ``row_max`` and ``row_sums`` (int64 Z_i·2^32) ``[b, Hq, L]`` over all keys of the sequence; V and S sum them
    as in :func:`static_scores`. Equal to the PyTorch ``probability_fixed_point`` (its ``mass_scales``),
    ``vertical_scores`` and ``slash_partial_sums``.
    ``consecutive_keys`` as in :func:`static_scores`.
    """
    shape = _tiles(source, q_positions, k_positions).shape
    row_max = _row_stats(shape, row_max, "row_max", torch.float32)
    mass_scales = (rules.one / (_row_stats(shape, row_sums, "row_sums", torch.int64).double() * shape[2])).float()
    return _score_sums(
        source, q_positions, k_positions, seq_len, rules, row_max, mass_scales, slashes, consecutive_keys
    )
