"""Pure-PyTorch block-sparse backend (``torch_blocksparse``, DESIGN.md §2.6).

Computes one ring step of vertical-slash attention from the step's CSR work lists (see
``mtraining_kernels.index.BlockBarIndex``): the listed 64-wide key sub-tiles and bar columns of
every (b, query head, 128-row query block), and nothing else. No N×N mask or score matrix is
built. For each query block, the listed key columns are expanded into a padded gather
``columns [rows, K]`` with a validity mask; K/V are gathered per KV head straight from
``[b, Nk, Hkv, d]`` (never repeated to Hq); scores are ``[rows, 128, K]``.

Rows are processed in chunks of at most :data:`SCORE_ELEMENTS_PER_CHUNK` score elements, so
memory stays bounded on long sequences; only rows that have work are visited.

Packed documents (DESIGN.md §2.7): with ``query_doc_ids``/``key_doc_ids`` (the index's ``doc_ids`` of the
query rows and of the source chunk) a listed score (i, j), tile or bar, is kept only where
doc(i) == doc(j); the lists of ``document_conversion`` make that the whole document mask.

Math is fp32 (fp64 when the inputs are fp64, which the tests use for tight checks); the
running ``out``/``lse`` and the gradient buffers must have that accumulator dtype.
"""

from __future__ import annotations

import math
from typing import Iterator, NamedTuple

import torch

from .launch_checks import check_accumulator, check_doc_ids
from .layout import BLOCK_SIZE
from .merge import merge_attention

SUB_TILE = 64  # key sub-tile width of the work lists (contract of BlockBarIndex)
SCORE_ELEMENTS_PER_CHUNK = 1 << 25
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def accumulator_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of out/lse/delta/dq/dk/dv for inputs of ``input_dtype``: fp64 for fp64, else fp32."""
    return torch.float64 if input_dtype == torch.float64 else torch.float32


class _Chunk(NamedTuple):
    """A group of query blocks with work, and their padded key columns."""

    batch: torch.Tensor  # int64 [R]
    head: torch.Tensor  # int64 [R] query head
    qblock: torch.Tensor  # int64 [R] local query block
    columns: torch.Tensor  # int64 [R, K] local key columns in the source chunk (padding: 0)
    valid: torch.Tensor  # bool  [R, K] column is a listed entry, not padding
    keep: torch.Tensor  # bool  [R, 1 or 128, K] score is used (valid, causal on the diagonal, same document)


# ---------------------------------------------------------------------------------------- checks
def _shape_error(name: str, tensor: torch.Tensor, expected: tuple, meaning: str) -> ValueError:
    return ValueError(f"{name} must have shape {expected} ({meaning}), got {tuple(tensor.shape)}")


def _check_index(blk_ptr, blk_col, bar_ptr, bar_col, batch, heads, num_blocks, key_len, device):
    for name, ptr, col in (("blk", blk_ptr, blk_col), ("bar", bar_ptr, bar_col)):
        if not isinstance(ptr, torch.Tensor) or ptr.dtype != torch.int32 or ptr.dim() != 3:
            raise ValueError(
                f"{name}_ptr must be an int32 tensor [b, Hq, nb+1] (one step's slice, e.g. "
                f"index.{name}_ptr[w]), got {getattr(ptr, 'dtype', type(ptr))} "
                f"with shape {tuple(getattr(ptr, 'shape', ()))}"
            )
        if tuple(ptr.shape) != (batch, heads, num_blocks + 1):
            raise _shape_error(f"{name}_ptr", ptr, (batch, heads, num_blocks + 1), "[b, Hq, nb+1] of q")
        if not isinstance(col, torch.Tensor) or col.dtype != torch.int32 or col.dim() != 1:
            raise ValueError(
                f"{name}_col must be a 1-D int32 tensor, got {getattr(col, 'dtype', type(col))} "
                f"with shape {tuple(getattr(col, 'shape', ()))}"
            )
        if ptr.device != device or col.device != device:
            raise ValueError(f"{name}_ptr/{name}_col are on {ptr.device}/{col.device}; move them to {device}")
        if ptr.min() < 0 or ptr.max() > col.numel() or (ptr[..., 1:] < ptr[..., :-1]).any():
            raise ValueError(
                f"{name}_ptr must be non-decreasing offsets within [0, {col.numel()}] (the length of {name}_col)"
            )
    limit = 2 * num_blocks
    if blk_col.numel() and (blk_col.min() < 0 or blk_col.max() >= limit):
        raise ValueError(
            f"blk_col holds sub-tile indices outside [0, {limit}) = [0, 2*nb); "
            f"the index was built for another local length"
        )
    pairs = blk_col.view(-1, 2) if blk_col.numel() % 2 == 0 else None
    if (blk_ptr % 2).any() or pairs is None or (pairs[:, 0] % 2).any() or (pairs[:, 1] != pairs[:, 0] + 1).any():
        raise ValueError(
            "blk_col must list each 128-key block j as the sub-tile pair 2j, 2j+1 at an even offset "
            "(the Triton forward reads a pair as one tile); build the index with convert_index"
        )
    if bar_col.numel() and (bar_col.min() < 0 or bar_col.max() >= key_len):
        raise ValueError(
            f"bar_col holds key columns outside [0, {key_len}) = [0, Nk); the index was built for another local length"
        )


def _check_inputs(q, k, v, blk_ptr, blk_col, bar_ptr, bar_col, softmax_scale) -> torch.dtype:
    """Validate one step's inputs; return the accumulator dtype."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor ([b, N, H, d]), got {getattr(t, 'shape', type(t))}")
    if q.dtype not in INPUT_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; use one of {INPUT_DTYPES}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v devices differ ({q.device}, {k.device}, {v.device})")
    batch, query_len, heads, dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"k/v {tuple(k.shape)} disagree with q {tuple(q.shape)} on batch or head dim")
    key_len, kv_heads = k.shape[1], k.shape[2]
    if query_len % BLOCK_SIZE or query_len == 0:
        raise ValueError(f"q length {query_len} must be a positive multiple of the block size {BLOCK_SIZE}")
    if key_len != query_len:
        raise ValueError(f"k/v length {key_len} must equal q length {query_len} (one source chunk per step)")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of KV heads {kv_heads} (GQA)")
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite positive number (usually head_dim ** -0.5)")
    _check_index(blk_ptr, blk_col, bar_ptr, bar_col, batch, heads, query_len // BLOCK_SIZE, key_len, q.device)
    return accumulator_dtype(q.dtype)


# ---------------------------------------------------------------------------------------- work lists
def _padded_entries(start: torch.Tensor, count: torch.Tensor, col: torch.Tensor):
    """Entries col[start:start+count] of each row, padded: (int64 [R, max count], bool valid)."""
    width = int(count.max())
    slot = torch.arange(width, device=col.device)
    valid = slot < count[:, None]
    position = torch.where(valid, start[:, None] + slot, 0)
    return torch.where(valid, col[position].long(), 0), valid


def _chunks(
    blk_ptr, blk_col, bar_ptr, bar_col, *, causal_diag: bool, query_doc_ids=None, key_doc_ids=None
) -> Iterator[_Chunk]:
    """Rows (b, h, query block) with work, in chunks of bounded score size; with document ids ``[b, Nq]`` and
    ``[b, Nk]`` each score also needs doc(i) == doc(j)."""
    heads, num_blocks = blk_ptr.shape[1], blk_ptr.shape[2] - 1
    device = blk_col.device
    blk_start = blk_ptr[..., :-1].reshape(-1).long()
    blk_count = (blk_ptr[..., 1:] - blk_ptr[..., :-1]).reshape(-1).long()
    bar_start = bar_ptr[..., :-1].reshape(-1).long()
    bar_count = (bar_ptr[..., 1:] - bar_ptr[..., :-1]).reshape(-1).long()
    width = blk_count * SUB_TILE + bar_count
    rows = torch.nonzero(width > 0).squeeze(1)
    if rows.numel() == 0:
        return
    rows_per_chunk = max(1, SCORE_ELEMENTS_PER_CHUNK // (BLOCK_SIZE * int(width[rows].max())))
    lane = torch.arange(SUB_TILE, device=device)
    query_offset = torch.arange(BLOCK_SIZE, device=device)
    for chunk_rows in rows.split(rows_per_chunk):
        tiles, tile_valid = _padded_entries(blk_start[chunk_rows], blk_count[chunk_rows], blk_col)
        bars, bar_valid = _padded_entries(bar_start[chunk_rows], bar_count[chunk_rows], bar_col)
        tile_columns = (tiles[:, :, None] * SUB_TILE + lane).flatten(1)
        columns = torch.cat([tile_columns, bars], dim=1)
        valid = torch.cat([tile_valid.repeat_interleave(SUB_TILE, dim=1), bar_valid], dim=1)
        batch_of_row, rest = chunk_rows // (heads * num_blocks), chunk_rows % (heads * num_blocks)
        head, qblock = rest // num_blocks, rest % num_blocks
        keep = valid[:, None, :]
        if causal_diag:
            # token causal mask inside the diagonal block only (sub-tiles 2i, 2i+1); bars never need one
            is_tile = torch.arange(columns.shape[1], device=device) < tile_columns.shape[1]
            on_diagonal = is_tile & (columns // BLOCK_SIZE == qblock[:, None])
            future = on_diagonal[:, None, :] & ((columns % BLOCK_SIZE)[:, None, :] > query_offset[:, None])
            keep = keep & ~future
        if query_doc_ids is not None:
            row_docs = query_doc_ids.reshape(query_doc_ids.shape[0], num_blocks, BLOCK_SIZE)[batch_of_row, qblock]
            column_docs = key_doc_ids[batch_of_row[:, None], columns]
            keep = keep & (row_docs[:, :, None] == column_docs[:, None, :])
        yield _Chunk(batch_of_row, head, qblock, columns, valid, keep)


def _gather(q, k, v, chunk: _Chunk, group: int, dtype: torch.dtype):
    """Query rows [R, 128, d] and their listed keys/values [R, K, d] (KV head = head // group)."""
    batch, query_len, heads, dim = q.shape
    q_blocks = q.view(batch, query_len // BLOCK_SIZE, BLOCK_SIZE, heads, dim)
    q_rows = q_blocks[chunk.batch, chunk.qblock, :, chunk.head].to(dtype)
    kv_batch, kv_head = chunk.batch[:, None], (chunk.head // group)[:, None]
    k_rows = k[kv_batch, chunk.columns, kv_head].to(dtype)
    v_rows = v[kv_batch, chunk.columns, kv_head].to(dtype)
    return q_rows, k_rows, v_rows


def _masked_scores(q_rows, k_rows, chunk: _Chunk, softmax_scale: float) -> torch.Tensor:
    scores = torch.bmm(q_rows, k_rows.transpose(1, 2)).mul_(softmax_scale)
    return scores.masked_fill_(~chunk.keep, float("-inf"))


def _add_rows(buffer: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``buffer[rows[m]] += values[m]`` for every m, duplicates summed in a fixed order.

    On CUDA ``index_put_(accumulate=True)`` always takes the sort-based ordered path. On CPU its
    fp32 path uses parallel atomics unless deterministic algorithms are on, so they are switched on
    around the call (the serial loop is also the faster one there).
    """
    if buffer.device.type == "cuda" or torch.are_deterministic_algorithms_enabled():
        buffer.index_put_((rows,), values, accumulate=True)
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        buffer.index_put_((rows,), values, accumulate=True)
    finally:
        torch.use_deterministic_algorithms(False, warn_only=warn_only)


# ---------------------------------------------------------------------------------------- launchers
def output_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta ``[b, Hq, N]`` = rowsum(out ⊙ dout) over d in the accumulator dtype, from ``[b, N, Hq, d]``."""
    acc = accumulator_dtype(out.dtype)
    return (out.to(acc) * dout.to(acc)).sum(dim=-1).transpose(1, 2).contiguous()


def block_bar_forward(
    q,
    k,
    v,
    blk_ptr,
    blk_col,
    bar_ptr,
    bar_col,
    out,
    lse,
    *,
    causal_diag: bool,
    softmax_scale: float,
    query_doc_ids=None,
    key_doc_ids=None,
    fresh: bool = False,
) -> None:
    """Attend one source chunk through one step's lists and merge into (out, lse) in place.

    q ``[b, Nq, Hq, d]``; k, v ``[b, Nk, Hkv, d]`` (Nk == Nq); blk_ptr/bar_ptr int32
    ``[b, Hq, nb+1]`` with absolute offsets into blk_col/bar_col (int32, 1-D); out
    ``[b, Nq, Hq, d]`` and lse ``[b, Hq, Nq]`` in the accumulator dtype (fp32; fp64 for fp64
    inputs), contiguous. lse = −inf means "nothing yet"; rows without work stay bit-identical.
    ``causal_diag`` applies the token causal mask to query block i's sub-tiles 2i and 2i+1.
    ``query_doc_ids`` int32 ``[b, Nq]`` and ``key_doc_ids`` int32 ``[b, Nk]`` (packed documents, both or
    neither): keep only the listed scores with doc(i) == doc(j). ``fresh``: out and lse hold nothing yet
    and this is the only step; out may be in q's dtype (the values of merging into zeros and −inf, cast).
    """
    acc = _check_inputs(q, k, v, blk_ptr, blk_col, bar_ptr, bar_col, softmax_scale)
    batch, query_len, heads, dim = q.shape
    check_doc_ids(query_doc_ids, key_doc_ids, batch, query_len, k.shape[1], q.device)
    out_dtype = out.dtype if fresh and isinstance(out, torch.Tensor) and out.dtype == q.dtype else acc
    check_accumulator("out", out, tuple(q.shape), out_dtype, q.device, "the running output [b, Nq, Hq, d]")
    check_accumulator("lse", lse, (batch, heads, query_len), acc, q.device, "the running lse [b, Hq, Nq]")
    running_out = torch.zeros(q.shape, dtype=acc, device=q.device) if fresh else out
    if fresh:
        lse.fill_(float("-inf"))
    q = q.contiguous()
    group = heads // k.shape[2]
    num_blocks = query_len // BLOCK_SIZE
    step_out = torch.zeros(batch, num_blocks, BLOCK_SIZE, heads, dim, dtype=acc, device=q.device)
    step_lse = torch.full((batch, heads, num_blocks, BLOCK_SIZE), float("-inf"), dtype=acc, device=q.device)
    documents = dict(query_doc_ids=query_doc_ids, key_doc_ids=key_doc_ids)
    for chunk in _chunks(blk_ptr, blk_col, bar_ptr, bar_col, causal_diag=causal_diag, **documents):
        q_rows, k_rows, v_rows = _gather(q, k, v, chunk, group, acc)
        scores = _masked_scores(q_rows, k_rows, chunk, softmax_scale)
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
        probs = scores.sub_(row_max).exp_()
        total = probs.sum(dim=-1, keepdim=True)
        seen = total != 0  # 0: no key in this step; NaN (poisoned logits) is kept, not dropped
        rows_out = torch.bmm(probs, v_rows) / torch.where(seen, total, 1.0)
        rows_lse = torch.where(seen, row_max + torch.log(torch.where(seen, total, 1.0)), float("-inf"))
        step_out[chunk.batch, chunk.qblock, :, chunk.head] = rows_out
        step_lse[chunk.batch, chunk.head, chunk.qblock] = rows_lse.squeeze(-1)
    merged_out, merged_lse = merge_attention(running_out, lse, step_out.view_as(running_out), step_lse.view_as(lse))
    out.copy_(merged_out)
    lse.copy_(merged_lse)


def block_bar_backward(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    blk_ptr,
    blk_col,
    bar_ptr,
    bar_col,
    dq,
    dk,
    dv,
    *,
    causal_diag: bool,
    softmax_scale: float,
    deterministic: bool = False,
    query_doc_ids=None,
    key_doc_ids=None,
    key_lists=None,
    bar_chunks=None,
    bar_width=None,
    fresh_dq: bool = False,
    fresh_dkv: bool = False,
    out=None,
    validated: bool = False,
) -> None:
    """Accumulate one step's gradients in place.

    lse ``[b, Hq, Nq]`` is the FINAL merged lse and delta ``[b, Hq, Nq]`` = rowsum(out ⊙ dout), both in
    the accumulator dtype (delta None: computed here from ``out``, the forward's ``[b, Nq, Hq, d]``); dout
    ``[b, Nq, Hq, d]`` (input or accumulator dtype). With
    P = exp(scale·q·kᵀ − lse) and dS = P ⊙ (dout·vᵀ − delta): dq ``[b, Nq, Hq, d]`` += scale·dS·k,
    dk ``[b, Nk, Hkv, d]`` += scale·dSᵀ·q, dv += Pᵀ·dout (accumulator dtype, contiguous).
    This backend's backward is always deterministic (bitwise repeatable); ``deterministic`` is
    accepted for signature parity with the Triton backend, and so are ``key_lists``, ``bar_chunks`` and
    ``bar_width`` (the lists by key and by bar column that the Triton backward reads, and the bound of the
    latter; this one walks the lists by query block), and ``validated`` (this reference backend always checks).
    Document ids as in :func:`block_bar_forward`.
    ``fresh_dq``: dq holds nothing yet and this is its only step; it is written, in its own dtype (q's or the
    accumulator's). ``fresh_dkv``: the same for dk and dv (k's dtype or the accumulator's).
    """
    acc = _check_inputs(q, k, v, blk_ptr, blk_col, bar_ptr, bar_col, softmax_scale)
    batch, query_len, heads, dim = q.shape
    check_doc_ids(query_doc_ids, key_doc_ids, batch, query_len, k.shape[1], q.device)
    if not isinstance(dout, torch.Tensor) or dout.dtype not in (q.dtype, acc):
        raise ValueError(f"dout must be a tensor of dtype {q.dtype} or {acc}, got {getattr(dout, 'dtype', type(dout))}")
    if dout.shape != q.shape or dout.device != q.device:
        raise ValueError(f"dout {tuple(dout.shape)} on {dout.device} must match q {tuple(q.shape)} on {q.device}")
    check_accumulator("lse", lse, (batch, heads, query_len), acc, q.device, "the final lse [b, Hq, Nq]")
    if delta is not None:
        check_accumulator("delta", delta, (batch, heads, query_len), acc, q.device, "rowsum(out * dout) [b, Hq, Nq]")
    elif not isinstance(out, torch.Tensor) or out.shape != q.shape or out.device != q.device:
        raise ValueError(
            f"delta is None, so out must be the forward's output of q's shape {tuple(q.shape)} on {q.device}, got "
            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}; pass it, or pass delta"
        )
    dq_dtype = dq.dtype if fresh_dq and isinstance(dq, torch.Tensor) and dq.dtype == q.dtype else acc
    check_accumulator("dq", dq, tuple(q.shape), dq_dtype, q.device, "the dq accumulator [b, Nq, Hq, d]")
    dkv_dtype = dk.dtype if fresh_dkv and isinstance(dk, torch.Tensor) and dk.dtype == k.dtype else acc
    check_accumulator("dk", dk, tuple(k.shape), dkv_dtype, q.device, "the dk accumulator [b, Nk, Hkv, d]")
    check_accumulator("dv", dv, tuple(v.shape), dkv_dtype, q.device, "the dv accumulator [b, Nk, Hkv, d]")
    if delta is None:
        delta = output_delta(out, dout)
    running_dq = torch.zeros(q.shape, dtype=acc, device=q.device) if fresh_dq else dq
    running_dk, running_dv = (
        (torch.zeros(t.shape, dtype=acc, device=q.device) for t in (k, v)) if fresh_dkv else (dk, dv)
    )
    q, dout = q.contiguous(), dout.contiguous()
    key_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    num_blocks = query_len // BLOCK_SIZE
    dout_blocks = dout.view(batch, num_blocks, BLOCK_SIZE, heads, dim)
    dq_blocks = running_dq.view(batch, num_blocks, BLOCK_SIZE, heads, dim)
    lse_blocks = lse.view(batch, heads, num_blocks, BLOCK_SIZE)
    delta_blocks = delta.view(batch, heads, num_blocks, BLOCK_SIZE)
    dk_rows, dv_rows = running_dk.view(-1, dim), running_dv.view(-1, dim)
    documents = dict(query_doc_ids=query_doc_ids, key_doc_ids=key_doc_ids)
    for chunk in _chunks(blk_ptr, blk_col, bar_ptr, bar_col, causal_diag=causal_diag, **documents):
        q_rows, k_rows, v_rows = _gather(q, k, v, chunk, group, acc)
        dout_rows = dout_blocks[chunk.batch, chunk.qblock, :, chunk.head].to(acc)
        row_lse = lse_blocks[chunk.batch, chunk.head, chunk.qblock]
        row_delta = delta_blocks[chunk.batch, chunk.head, chunk.qblock]
        scores = _masked_scores(q_rows, k_rows, chunk, softmax_scale)
        # a row whose final lse is −inf saw no key anywhere, so all its scores are −inf too
        row_lse = torch.where(torch.isfinite(row_lse), row_lse, 0.0)
        probs = scores.sub_(row_lse[..., None]).exp_()
        dprobs = torch.bmm(dout_rows, v_rows.transpose(1, 2))
        dscores = dprobs.sub_(row_delta[..., None]).mul_(probs)
        dq_blocks[chunk.batch, chunk.qblock, :, chunk.head] += torch.bmm(dscores, k_rows).mul_(softmax_scale)
        dk_part = torch.bmm(dscores.transpose(1, 2), q_rows).mul_(softmax_scale)
        dv_part = torch.bmm(probs.transpose(1, 2), dout_rows)
        target = (chunk.batch[:, None] * key_len + chunk.columns) * kv_heads + (chunk.head // group)[:, None]
        target = target[chunk.valid]
        _add_rows(dk_rows, target, dk_part[chunk.valid])
        _add_rows(dv_rows, target, dv_part[chunk.valid])
    if fresh_dq:
        dq.copy_(running_dq)
    if fresh_dkv:
        dk.copy_(running_dk)
        dv.copy_(running_dv)
