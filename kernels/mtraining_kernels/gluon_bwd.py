"""One-pass backward of the block tiles on Hopper, warp-specialised (Gluon; DESIGN.md §2.6).

A program owns the dk/dv of one 128-key block of one KV head (grid (nb, Hkv, b)). It walks, for each query
head of its GQA group, the query blocks that list the block (the key-major lists ``KEY_PTR`` /
``KEY_QBLOCK``) in 64-row slices, and computes every product of a slice once:

* the MMA partition (8 warps along the keys) — Sᵀ = k·qᵀ and dPᵀ = v·dOᵀ, their products started from −lse/scale and
  −delta, so Pᵀ = exp2(c·Sᵀ) and dSᵀ = Pᵀ ⊙ dPᵀ need no per-row vector in registers; dk and dv in registers: dv +=
  Pᵀ·dO with each warpgroup's Pᵀ (its own 64 keys) as a register operand, dk += dSᵀ·q with dSᵀ from registers too; dSᵀ
  also goes to one shared buffer for dq's products; dq_slice = scale·dS·k, in parts of 64 columns, into one shared
  fp32 slice (128-byte swizzled, as the writer's reduce reads it);
* the loader (1 warp) — the slices' q and dO, and their rows' lse and delta, by tensor-memory copies, three
  stages ahead (so the MMA warps read lse and delta from shared memory, not from global memory right before
  their first use);
* the dq writer (1 warp) — adds each dq slice into the fp32 dq by one tensor-memory reduce
  (``cp.reduce.async.bulk.tensor``, add), so the adds pass neither the writer's registers nor the L1's atomic
  path (faster than two warps of vector atomics where the GPU runs at its power limit, as at 512K;
  docs/benchmarks.md, session 40).

So the backward computes 5 matrix products per tile, against 7 for the two passes of
``triton_bwd`` (whose query-major pass recomputes S and dP). In the default mode a second launch (``BARS``)
takes the bars by column: a program per (row, segment, chunk) of ``mtraining_kernels.bar_words`` gathers its
chunk's (up to 128) k/v rows once, walks the chunk's query blocks within the segment, skipping those whose
membership words are zero, keeps P where the words mark a bar, and adds its dk/dv rows with atomics once (other
GQA heads and segments share them).
Without a dq
(the deterministic mode) the pass computes dk and dv alone, with no atomics (4 products; the writer idles), and
``triton_bwd``'s query-major pass the block tiles' dq. Packed documents (``DOCUMENTS``): P is 0 where a query
row's and a key's document ids differ, compared only where the query or the key block holds two documents.

Where the lists are long (``SHARED_WALKS``: 2 query heads from 64 listed query blocks per key block and head, the
dense mode and 512K at 95 %; 4 from 16, 128K) the default mode without documents gives each program fewer query
heads of the group, and the group's programs add their dk/dv with fp32 atomics. A program walks its heads' lists
one after another, so the programs of a whole group drift apart as their lists' lengths differ, while those running
together with fewer heads read the same query blocks at about the same time, from L2 (docs/benchmarks.md, sessions
35–36). Where the lists are short (32K), the extra programs' prologues, k/v loads and dk/dv atomics cost more than
that gains.

Inputs: q, dO ``[b, N, Hq, d]`` and k, v ``[b, N, Hkv, d]`` contiguous bf16/fp16
(read as the 2-D views ``[b·N, H·d]``), d = 128 (the backend's condition: d = 64 is correct but slower
than the two passes, docs/benchmarks.md, kernels v2 step 8); lse, delta contiguous fp32 ``[b, Hq, N]``; dq
contiguous 16-byte-aligned fp32 (the reduces' tensor descriptor);
dk, dv fp32 accumulators, or in k's dtype where the pass is their only contributor (written, not added to).
Written in the Gluon API of Triton 3.6.
"""

from __future__ import annotations

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from . import gluon_descriptors
from .bar_words import BarWords
from .direct_launch import direct
from .gluon_descriptors import dq_descriptor, rows_descriptor, stats_descriptor

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK = 128  # keys per program: one block of the lists
QUERY_ROWS = 64  # query rows per slice
STAGES = 3  # q/dO slices in flight
DQ_BUFFERS = gl.constexpr(1)  # dq slices in shared memory
DQ_SLICE_LAYOUT = gl.constexpr(gluon_descriptors.DQ_SLICE_LAYOUT)  # as the writer's reduce reads them
WRITER_WARPS = 1
MMA_WARPS = 8
# (query heads a default-mode program walks, listed query blocks per (key block, query head) in a step, on average,
# from which it does so), the first that holds
SHARED_WALKS = ((2, 64), (4, 16))


@gluon.jit
def _member_slices(key_lists, member, BLOCK: gl.constexpr, ROWS: gl.constexpr, BARS: gl.constexpr):
    """(query head, first slice, end slice) of GQA member ``member`` in the program's list. Block tiles:
    ``key_lists`` = (KEY_PTR, KEY_QBLOCK, stride_kpb, stride_kph, key_block, kv_head, sample, group_size, Hq,
    first member, end member), the program walking members [first, end) of the group;
    bars: (first, WORDS, end, words_row, chunk, head, sample, 1, Hq, 0, 1), the program's walk [first, end) of
    query blocks, walked from its end down (:func:`_slice_rows`), so the programs of a segment, which end
    together, read the same blocks at the same time."""
    SLICES: gl.constexpr = BLOCK // ROWS
    if BARS:
        head = key_lists[5]
        start_slice, end_slice = 1 - key_lists[2] * SLICES, 1 - key_lists[0] * SLICES
    else:
        head = key_lists[5] * key_lists[7] + member
        list_row = key_lists[6] * key_lists[2] + head * key_lists[3] + key_lists[4]
        start_slice = gl.load(key_lists[0] + list_row) * SLICES
        end_slice = gl.load(key_lists[0] + list_row + 1) * SLICES
    return head, start_slice, end_slice


@gluon.jit
def _slice_rows(key_lists, s, BLOCK: gl.constexpr, ROWS: gl.constexpr, BARS: gl.constexpr):
    """(query block, first local row) of slice ``s`` (of BLOCK // ROWS per listed query block; the bars' walk
    lists every query block from its first to its end, slice −s of the walk's ascending slices)."""
    if BARS:
        t = -s
        qblock = t // (BLOCK // ROWS)
    else:
        t = s
        qblock = gl.load(key_lists[1] + s // (BLOCK // ROWS))
    return qblock, qblock * BLOCK + (t % (BLOCK // ROWS)) * ROWS


@gluon.jit
def _slice_live(key_lists, qblock, BARS: gl.constexpr):
    """Whether the partitions take the slices of query block ``qblock``: always for the block tiles; for the
    bars, where the block's membership words have a bit (every partition reads the same words, so all three
    skip the same slices and their stage counters stay in step)."""
    if BARS:
        words = key_lists[1] + key_lists[3] + qblock * 2
        return (gl.load(words) | gl.load(words + 1)) != 0
    else:
        return True


@gluon.jit
def _loader(
    q_desc,
    do_desc,
    lse_desc,
    delta_desc,
    q_bufs,
    do_bufs,
    lse_bufs,
    delta_bufs,
    ready_bars,
    empty_bars,
    key_lists,
    seq_len,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    BARS: gl.constexpr,
):
    sample = key_lists[6]
    step = 0
    for member in range(key_lists[9], key_lists[10]):
        head, start, end = _member_slices(key_lists, member, BLOCK, ROWS, BARS)
        for s in range(start, end):
            qblock, first_row = _slice_rows(key_lists, s, BLOCK, ROWS, BARS)
            if _slice_live(key_lists, qblock, BARS):  # the bars skip query blocks with no bar of the chunk
                slot = step % STAGES
                mbarrier.wait(empty_bars.index(slot), ((step // STAGES) & 1) ^ 1)
                ready = ready_bars.index(slot)
                mbarrier.expect(ready, 2 * q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
                coords = [sample * seq_len + first_row, head * HEAD_DIM]
                tma.async_copy_global_to_shared(q_desc, coords, ready, q_bufs.index(slot))
                tma.async_copy_global_to_shared(do_desc, coords, ready, do_bufs.index(slot))
                stats_coords = [sample * key_lists[8] + head, first_row]
                tma.async_copy_global_to_shared(lse_desc, stats_coords, ready, lse_bufs.index(slot))
                tma.async_copy_global_to_shared(delta_desc, stats_coords, ready, delta_bufs.index(slot))
                step += 1


@builtin
def _reduce_add_shared_to_global(tensor_desc, coord, src, _semantic=None):
    """global[the descriptor's box at ``coord``] += shared ``src``, by one tensor-memory reduce
    (cp.reduce.async.bulk.tensor, add); it completes as a tensor-memory store does (``tma.store_wait``). Triton
    3.6's Gluon has no public call for it, so this one goes to the builder's op, as ``tma``'s own calls do."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _dq_writer(
    dq_desc,
    dq_slices,
    dq_ready_bars,
    dq_empty_bars,
    key_lists,
    seq_len,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    ROWS: gl.constexpr,
    WRITE_DQ: gl.constexpr,
    BARS: gl.constexpr,
):
    """Adds each dq slice (``dq_slices``: DQ_BUFFERS buffers [ROWS, HEAD_DIM]) into the fp32 dq of ``dq_desc``
    (``[b·N, Hq·d]``) by a tensor-memory reduce, and frees the buffer once the reduce has read it; idle without
    ``WRITE_DQ``."""
    step = 0
    if WRITE_DQ:
        for member in range(key_lists[9], key_lists[10]):
            head, start, end = _member_slices(key_lists, member, BLOCK, ROWS, BARS)
            for s in range(start, end):
                qblock, first_row = _slice_rows(key_lists, s, BLOCK, ROWS, BARS)
                if _slice_live(key_lists, qblock, BARS):  # the bars skip query blocks with no bar of the chunk
                    slot = step % DQ_BUFFERS
                    mbarrier.wait(dq_ready_bars.index(slot), (step // DQ_BUFFERS) & 1)
                    coords = [key_lists[6] * seq_len + first_row, head * HEAD_DIM]
                    _reduce_add_shared_to_global(dq_desc, coords, dq_slices.index(slot))
                    tma.store_wait(0)
                    mbarrier.arrive(dq_empty_bars.index(slot), count=1)
                    step += 1


@gluon.jit
def _gather_bar_keys(k_smem, v_smem, bar_keys, sample, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr):
    """Loads the chunk's k and v rows into shared memory (rows past its length are zero); ``bar_keys`` =
    (K, V, the chunk's columns, their count, KV head, N, row stride of the 2-D views ``[b·N, Hkv·d]``)."""
    K, V, COLUMNS, length, kv_head, seq_len, row_stride = bar_keys
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [8, 1], [1, 0])
    slots = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    listed = slots < length
    cols = gl.load(COLUMNS + slots, mask=listed, other=0)
    rows = (sample * seq_len + cols).to(gl.int64) * row_stride + kv_head * HEAD_DIM
    offsets = rows[:, None] + offs_d[None, :]
    mask = listed[:, None] & (offs_d[None, :] < HEAD_DIM)
    k_smem.store(gl.load(K + offsets, mask=mask, other=0.0))
    v_smem.store(gl.load(V + offsets, mask=mask, other=0.0))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _mma_partition(
    smem,
    bars,
    DK,
    DV,
    dkv_strides,
    key_lists,
    bar_keys,
    documents,
    softmax_scale,
    qk_scale_log2,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL_DIAG: gl.constexpr,
    WRITE_DQ: gl.constexpr,
    DOCUMENTS: gl.constexpr,
    BARS: gl.constexpr,
    SHARED_DKV: gl.constexpr,
):
    """``smem`` = (k, v, q stages, dO stages, dSᵀ, dq slices, lse stages, delta stages); ``bars`` = (k/v,
    ready, empty, dq ready, dq empty); ``dkv_strides`` = (batch, token, head); ``bar_keys`` as in
    :func:`_gather_bar_keys`, read only with ``BARS``; ``documents`` = (QUERY_DOCS, KEY_DOCS, stride_docb), read
    only with ``DOCUMENTS``."""
    k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_slices, lse_bufs, delta_bufs = smem
    stats_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    kv_bar, ready_bars, empty_bars, dq_ready_bars, dq_empty_bars = bars
    key_block, kv_head, sample = key_lists[4], key_lists[5], key_lists[6]
    # Sᵀ, dPᵀ [BLOCK, ROWS] and dk, dv [BLOCK, HEAD_DIM]: 8 warps along the keys, so each warpgroup holds Pᵀ and
    # dSᵀ of its own 64 keys as the A operand of its dv and dk products (from registers); a dq part
    # [ROWS, DQ_COLUMNS]: 4 warps along the rows, 2 along the columns. dq in parts of 64 columns keeps the
    # registers in budget (a whole [64, 128] dq tile spills).
    DQ_COLUMNS: gl.constexpr = 64
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, ROWS, 16]
    )
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, DQ_COLUMNS // 2, 16]
    )
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dtype: gl.constexpr = k_smem.dtype

    k_cols = key_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, st_layout))
    offs_q = gl.arange(0, ROWS, layout=gl.SliceLayout(0, st_layout))
    dk = gl.zeros([BLOCK, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK, HEAD_DIM], gl.float32, kv_layout)
    QUERY_DOCS, KEY_DOCS, stride_docb = documents
    if DOCUMENTS:  # the compare only where the key or the query block holds two documents
        k_docs = gl.load(KEY_DOCS + sample * stride_docb + k_cols)
        k_mixed = gl.min(k_docs, 0) != gl.max(k_docs, 0)
    if BARS:
        _gather_bar_keys(k_smem, v_smem, bar_keys, sample, HEAD_DIM, BLOCK)
    else:
        mbarrier.wait(kv_bar, 0)
    slots = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, st_layout))
    neg_inv_scale = -1.0 / softmax_scale
    step = 0
    for member in range(key_lists[9], key_lists[10]):
        head, start, end = _member_slices(key_lists, member, BLOCK, ROWS, BARS)
        for s in range(start, end):
            qblock, first_row = _slice_rows(key_lists, s, BLOCK, ROWS, BARS)
            if _slice_live(key_lists, qblock, BARS):  # the bars skip query blocks with no bar of the chunk
                q_rows = first_row + offs_q
                if BARS:  # the block's two membership words, as scalars until the scores are in
                    words = key_lists[1] + key_lists[3] + qblock * 2
                    low_word = gl.load(words)
                    high_word = gl.load(words + 1)
                slot = step % STAGES
                mbarrier.wait(ready_bars.index(slot), (step // STAGES) & 1)
                lse_s = lse_bufs.index(slot)._reinterpret(gl.float32, [ROWS], stats_layout)
                delta_s = delta_bufs.index(slot)._reinterpret(gl.float32, [ROWS], stats_layout)
                q_s = q_bufs.index(slot)
                do_s = do_bufs.index(slot)
                # the products start from −lse/scale and −delta, so no per-row value stays in registers:
                # P = exp2(c·(Sᵀ − lse/scale)), dPᵀ − delta straight from the tensor cores
                lse = lse_s.load(gl.SliceLayout(0, st_layout))
                lse_start = gl.where(lse == float("-inf"), float("-inf"), lse * neg_inv_scale)  # empty rows: P = 0
                s_tok = warpgroup_mma(
                    k_smem,
                    q_s.permute((1, 0)),
                    gl.zeros([BLOCK, ROWS], gl.float32, st_layout) + lse_start[None, :],
                    is_async=True,
                )
                delta = delta_s.load(gl.SliceLayout(0, st_layout))
                dp_tok = warpgroup_mma(
                    v_smem,
                    do_s.permute((1, 0)),
                    gl.zeros([BLOCK, ROWS], gl.float32, st_layout) - delta[None, :],
                    is_async=True,
                )
                scores = warpgroup_mma_wait(1, deps=[s_tok])
                probs = gl.exp2(scores * qk_scale_log2)
                if CAUSAL_DIAG:
                    off_diagonal = key_block != qblock
                    probs = gl.where(off_diagonal | (k_cols[:, None] <= q_rows[None, :]), probs, 0.0)
                if BARS:  # bit t of the words: slot t is a bar of the block's rows (read in 32-bit quarters)
                    quarter = gl.where(slots < 64, low_word, high_word) >> (slots // 32 % 2 * 32).to(gl.int64)
                    is_bar = ((quarter.to(gl.int32) >> (slots % 32)) & 1) != 0
                    probs = gl.where(is_bar[:, None], probs, 0.0)
                if DOCUMENTS:
                    q_docs_base = QUERY_DOCS + sample * stride_docb
                    q_mixed = gl.load(q_docs_base + qblock * BLOCK) != gl.load(q_docs_base + qblock * BLOCK + BLOCK - 1)
                    if k_mixed | q_mixed:
                        q_docs = gl.load(q_docs_base + q_rows)
                        probs = gl.where(k_docs[:, None] == q_docs[None, :], probs, 0.0)
                probs_t = gl.convert_layout(probs.to(dtype), operand_layout)
                dv_tok = warpgroup_mma(probs_t, do_s, dv, is_async=True)
                dprobs = warpgroup_mma_wait(1, deps=[dp_tok])
                dscores = (probs * dprobs).to(dtype)
                dscores_t = gl.convert_layout(dscores, operand_layout)  # dk from dSᵀ in registers, as dv from Pᵀ
                dk_tok = warpgroup_mma(dscores_t, q_s, dk, is_async=True)
                if WRITE_DQ:  # dq = dS·k reads every key's dS: dSᵀ through shared memory, behind one barrier
                    gl.static_assert(HEAD_DIM == 2 * DQ_COLUMNS)
                    ds_smem.store(dscores)
                    fence_async_shared()
                    gl.thread_barrier()
                    dq_zeros = gl.zeros([ROWS, DQ_COLUMNS], gl.float32, dq_layout)
                    ds = ds_smem.permute((1, 0))
                    low_tok = warpgroup_mma(
                        ds, k_smem.slice(0, DQ_COLUMNS, dim=1), dq_zeros, use_acc=False, is_async=True
                    )
                    high_tok = warpgroup_mma(
                        ds, k_smem.slice(DQ_COLUMNS, DQ_COLUMNS, dim=1), dq_zeros, use_acc=False, is_async=True
                    )
                    dv, _ = warpgroup_mma_wait(3, deps=[dv_tok, probs_t])
                    dk, _ = warpgroup_mma_wait(2, deps=[dk_tok, dscores_t])
                    gl.thread_barrier()
                    mbarrier.arrive(empty_bars.index(slot), count=1)
                    dq_slot = step % DQ_BUFFERS
                    dq_slice = dq_slices.index(dq_slot)
                    dq_low = warpgroup_mma_wait(1, deps=[low_tok])
                    mbarrier.wait(dq_empty_bars.index(dq_slot), ((step // DQ_BUFFERS) & 1) ^ 1)
                    dq_slice.slice(0, DQ_COLUMNS, dim=1).store(dq_low * softmax_scale)
                    dq_high = warpgroup_mma_wait(0, deps=[high_tok])  # dS is read: the next slice may store its own
                    dq_slice.slice(DQ_COLUMNS, DQ_COLUMNS, dim=1).store(dq_high * softmax_scale)
                    fence_async_shared()  # the writer's tensor-memory reduce reads the slice
                    gl.thread_barrier()
                    mbarrier.arrive(dq_ready_bars.index(dq_slot), count=1)
                else:
                    dv, _ = warpgroup_mma_wait(1, deps=[dv_tok, probs_t])
                    dk, _ = warpgroup_mma_wait(0, deps=[dk_tok, dscores_t])
                    gl.thread_barrier()
                    mbarrier.arrive(empty_bars.index(slot), count=1)
                step += 1

    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    if BARS:  # other heads of the group and other segments of the chunk add into the same rows
        k_slots = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, kv_layout))
        listed = (k_slots < bar_keys[3]) & (step > 0)
        cols = gl.load(bar_keys[2] + k_slots, mask=listed, other=0)
        rows = cols.to(gl.int64)[:, None] * dkv_strides[1]
        offsets = sample * dkv_strides[0] + bar_keys[4] * dkv_strides[2] + rows + offs_d[None, :]
        mask = listed[:, None] & (offs_d[None, :] < HEAD_DIM)
        gl.atomic_add(DK + offsets, dk * softmax_scale, mask=mask, sem="relaxed")
        gl.atomic_add(DV + offsets, dv, mask=mask, sem="relaxed")
    else:
        k_rows = key_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, kv_layout))
        rows = k_rows.to(gl.int64)[:, None] * dkv_strides[1]
        offsets = sample * dkv_strides[0] + kv_head * dkv_strides[2] + rows + offs_d[None, :]
        if SHARED_DKV:  # the group's other programs add into the same rows
            if step > 0:
                gl.atomic_add(DK + offsets, dk * softmax_scale, sem="relaxed")
                gl.atomic_add(DV + offsets, dv, sem="relaxed")
        elif DK.dtype.element_ty == gl.float32:  # accumulators: this pass's part added
            has_work = step > 0
            gl.store(DK + offsets, gl.load(DK + offsets) + dk * softmax_scale, mask=has_work)
            gl.store(DV + offsets, gl.load(DV + offsets) + dv, mask=has_work)
        else:  # the pass is their only contributor: written in their dtype (zeros where no slice came)
            gl.store(DK + offsets, (dk * softmax_scale).to(DK.dtype.element_ty))
            gl.store(DV + offsets, dv.to(DV.dtype.element_ty))


@gluon.jit
def one_pass_backward_kernel(
    q_desc,
    do_desc,
    k_desc,
    v_desc,
    lse_desc,
    delta_desc,
    K,
    V,
    dq_desc,
    DK,
    DV,
    KEY_PTR,
    KEY_QBLOCK,
    BOUNDS,
    WORDS,
    COLUMN,
    COUNT,
    QUERY_DOCS,
    KEY_DOCS,
    stride_docb,
    seq_len,
    num_chunks,
    walk,
    stride_kpb,
    stride_kph,
    stride_gkb,
    stride_gkn,
    stride_gkh,
    group_size,
    members,
    heads,
    softmax_scale,
    qk_scale_log2,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    ROWS: gl.constexpr,
    STAGES: gl.constexpr,
    WRITER_WARPS: gl.constexpr,
    CAUSAL_DIAG: gl.constexpr,
    WRITE_DQ: gl.constexpr,
    DOCUMENTS: gl.constexpr,
    BARS: gl.constexpr,
    SHARED_DKV: gl.constexpr,
):
    """Block tiles: grid (nb, Hkv · group_size / members, b), a program walking ``members`` query heads of its
    group (``SHARED_DKV``: fewer than the group, so the group's programs add their dk/dv with fp32 atomics);
    KEY_PTR int32 ``[b, Hq, nb+1]`` (strides stride_kpb, stride_kph) spans KEY_QBLOCK, the ascending query
    blocks whose list holds key block j (as in ``triton_bwd``). Bars
    (``BARS``): grid (b·Hq·K·C,); program (row·K + k)·C + chunk walks the chunk's query blocks within segment k,
    [k·walk, (k+1)·walk) (K segments), from BOUNDS, WORDS, COLUMN and COUNT of ``bar_words.BarWords``
    (contiguous, C = ``num_chunks`` chunks per row); K and V the raw k and v they gather."""
    dtype: gl.constexpr = q_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ds_smem = gl.allocate_shared_memory(dtype, [BLOCK, ROWS], ds_layout)  # dSᵀ, for dq's products
    dq_slices = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS, ROWS, HEAD_DIM], DQ_SLICE_LAYOUT)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape, delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_ready_bars = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty_bars = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=1)
    for i in gl.static_range(DQ_BUFFERS):
        mbarrier.init(dq_ready_bars.index(i), count=1)
        mbarrier.init(dq_empty_bars.index(i), count=1)
    fence_async_shared()

    row_stride = heads // group_size * HEAD_DIM  # of the 2-D views [b·N, Hkv·d]
    if BARS:
        num_blocks = seq_len // BLOCK
        chunk = gl.program_id(0) % num_chunks
        row_segment = gl.program_id(0) // num_chunks
        segment = row_segment % ((num_blocks + walk - 1) // walk)
        row = row_segment // ((num_blocks + walk - 1) // walk)
        sample = row // heads
        head = row % heads
        chunk_row = row.to(gl.int64) * num_chunks + chunk
        chunk_first = num_blocks - gl.load(BOUNDS + chunk_row * 2)  # an unused chunk: first = nb = end
        first = gl.maximum(chunk_first, segment * walk)
        end = gl.maximum(first, gl.minimum(gl.load(BOUNDS + chunk_row * 2 + 1), segment * walk + walk))
        words_row = chunk_row * num_blocks * 2
        key_lists = (first, WORDS, end, words_row, chunk, head, sample, 1, heads, 0, 1)
        length = gl.minimum(gl.maximum(gl.load(COUNT + row) - chunk * BLOCK, 0), BLOCK)
        length = gl.where(first == end, 0, length)  # a segment the chunk does not reach gathers nothing
        bar_keys = (K, V, COLUMN + chunk_row * BLOCK, length, head // group_size, seq_len, row_stride)
    else:
        key_block = gl.program_id(0)
        kv_head = gl.program_id(1) // (group_size // members)
        first_member = gl.program_id(1) % (group_size // members) * members
        sample = gl.program_id(2)
        kv_row = sample * seq_len + key_block * BLOCK
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row, kv_head * HEAD_DIM], kv_bar, k_smem)
        tma.async_copy_global_to_shared(v_desc, [kv_row, kv_head * HEAD_DIM], kv_bar, v_smem)
        key_lists = (
            KEY_PTR,
            KEY_QBLOCK,
            stride_kpb,
            stride_kph,
            key_block,
            kv_head,
            sample,
            group_size,
            heads,
            first_member,
            first_member + members,
        )
        bar_keys = (K, V, COLUMN, 0, kv_head, seq_len, row_stride)
    gl.warp_specialize(
        [
            (
                _mma_partition,
                (
                    (k_smem, v_smem, q_bufs, do_bufs, ds_smem, dq_slices, lse_bufs, delta_bufs),
                    (kv_bar, ready_bars, empty_bars, dq_ready_bars, dq_empty_bars),
                    DK,
                    DV,
                    (stride_gkb, stride_gkn, stride_gkh),
                    key_lists,
                    bar_keys,
                    (QUERY_DOCS, KEY_DOCS, stride_docb),
                    softmax_scale,
                    qk_scale_log2,
                    HEAD_DIM,
                    BLOCK,
                    ROWS,
                    STAGES,
                    CAUSAL_DIAG,
                    WRITE_DQ,
                    DOCUMENTS,
                    BARS,
                    SHARED_DKV,
                ),
            ),
            (
                _loader,
                (
                    q_desc,
                    do_desc,
                    lse_desc,
                    delta_desc,
                    q_bufs,
                    do_bufs,
                    lse_bufs,
                    delta_bufs,
                    ready_bars,
                    empty_bars,
                    key_lists,
                    seq_len,
                    HEAD_DIM,
                    BLOCK,
                    ROWS,
                    STAGES,
                    BARS,
                ),
            ),
            (
                _dq_writer,
                (
                    dq_desc,
                    dq_slices,
                    dq_ready_bars,
                    dq_empty_bars,
                    key_lists,
                    seq_len,
                    HEAD_DIM,
                    BLOCK,
                    ROWS,
                    WRITE_DQ,
                    BARS,
                ),
            ),
        ],
        [1, WRITER_WARPS],
        [24, 24],
    )


def heads_per_program(group: int, batch: int, heads: int, num_blocks: int, listed: int, steps: int) -> int:
    """Query heads a default-mode block-tile program walks: the first of ``SHARED_WALKS`` whose heads divide the
    group and whose minimum a step's lists reach on average per (sample, query head, key block) (``listed`` entries
    over ``steps`` steps: shapes, so no host sync); else the whole group."""
    lists = steps * batch * heads * num_blocks
    for members, min_blocks in SHARED_WALKS:
        if members < group and group % members == 0 and listed >= min_blocks * lists:
            return members
    return group


def one_pass_backward(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    dq,
    dk,
    dv,
    key_ptr,
    key_qblock,
    *,
    causal_diag: bool,
    softmax_scale: float,
    documents=None,
    bar_words: BarWords | None = None,
    list_steps: int = 1,
) -> None:
    """dq += scale·dS·k (tensor-memory reduces), dk += scale·dSᵀ·q, dv += Pᵀ·dO over the block tiles of the
    key-major lists (``key_ptr`` int32 ``[b, Hq, nb+1]``, ``key_qblock``; one launch), then, with ``bar_words``
    (:class:`~mtraining_kernels.bar_words.BarWords` of this step), over the bars by column (a second launch, one
    program per (row, segment, chunk), dk/dv added with atomics as other programs share their rows; fp32 dq, dk,
    dv). Shapes and dtypes as in the module docstring, checked by the caller; dk and dv in k's dtype are written (dk =
    scale·dSᵀ·q, dv = Pᵀ·dO). ``dq`` None: dk and dv alone, without atomics (the deterministic mode, whose dq the
    query-major pass computes). ``documents``: (query_doc_ids, key_doc_ids) int32 ``[b, N]``, contiguous, or
    None. ``list_steps``: the steps whose lists key_qblock holds (a ring's W), for their mean length."""
    batch, length, heads, dim = q.shape
    group = heads // k.shape[2]
    members = group
    if dq is not None and documents is None:
        members = heads_per_program(group, batch, heads, length // BLOCK, key_qblock.numel(), list_steps)
    written = dk.dtype != torch.float32
    if members < group and written:  # the group's programs add into fp32 sums
        dk_out, dv_out = dk, dv
        dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (dk, dv))
    descriptors = (
        rows_descriptor(q, QUERY_ROWS),
        rows_descriptor(dout, QUERY_ROWS),
        rows_descriptor(k, BLOCK),
        rows_descriptor(v, BLOCK),
        stats_descriptor(lse, QUERY_ROWS),
        stats_descriptor(delta, QUERY_ROWS),
    )
    dq_desc = dq_descriptor(dq, QUERY_ROWS) if dq is not None else None  # None: no kernel argument
    operands = (*descriptors, k, v, dq_desc, dk, dv)
    unused = key_ptr  # the other launch's lists
    block_lists = (key_ptr, key_qblock, unused, unused, unused, unused)
    grid = (length // BLOCK, k.shape[2] * (group // members), batch)
    _launch(
        grid,
        operands,
        block_lists,
        (1, 1),
        key_ptr.stride()[:2],
        q.shape,
        softmax_scale,
        causal_diag,
        documents,
        members,
    )
    if bar_words is not None:
        bar_lists = (unused, unused, bar_words.bounds, bar_words.words, bar_words.column, bar_words.count)
        rows, num_chunks, num_blocks = bar_words.words.shape[:3]
        grid = (rows * -(-num_blocks // bar_words.walk) * num_chunks,)
        walking = (num_chunks, bar_words.walk)
        _launch(grid, operands, bar_lists, walking, (0, 0), q.shape, softmax_scale, False, None, 1, bars=True)
    if members < group and written:
        dk_out.copy_(dk)
        dv_out.copy_(dv)


def _launch(
    grid, operands, lists, walking, key_strides, q_shape, softmax_scale, causal_diag, documents, members, bars=False
) -> None:
    """One launch of :func:`one_pass_backward_kernel`: ``operands`` = (q, dO, k, v, lse, delta descriptors, k,
    v, dq, dk, dv), ``lists`` = (KEY_PTR, KEY_QBLOCK, BOUNDS, WORDS, COLUMN, COUNT), ``walking`` = (the bars'
    chunks per row, their walk), ``members`` the query heads a block-tile program walks."""
    batch, length, heads, dim = q_shape
    *_, k, _, dq_desc, dk, _ = operands
    group = heads // k.shape[2]
    query_docs, key_docs = documents if documents is not None else (None, None)  # None: no kernel argument
    direct(one_pass_backward_kernel)(
        grid,
        *operands,
        *lists,
        query_docs,
        key_docs,
        query_docs.stride(0) if documents is not None else None,
        length,
        *walking,
        *key_strides,
        dk.stride(0),
        dk.stride(1),
        dk.stride(2),
        group,
        members,
        heads,
        softmax_scale,
        softmax_scale * LOG2E.value,
        HEAD_DIM=dim,
        BLOCK=BLOCK,
        ROWS=QUERY_ROWS,
        STAGES=STAGES,
        WRITER_WARPS=WRITER_WARPS,
        CAUSAL_DIAG=bool(causal_diag),
        WRITE_DQ=dq_desc is not None,
        DOCUMENTS=documents is not None,
        BARS=bars,
        SHARED_DKV=not bars and members < group,
        num_warps=MMA_WARPS,
    )
