"""Triton forward kernel of one ring step: fused block + bar flash attention (DESIGN.md §2.6).

One program owns one (128-row local query block i, query head h, sample z). It walks

1. the block list: the listed 128-key blocks of the source chunk (each two consecutive 64-wide sub-tile
   entries 2j, 2j+1, as ``convert_index`` writes them), ascending, one 128 × 128 tile per block, in two
   loops: those before the diagonal without a mask, then (only when ``CAUSAL_DIAG``) the diagonal block
   i — the list's last pair — with the token causal mask;
2. the bar list: single key columns gathered by index, 64 at a time (the tail is masked);

with an online softmax in base 2 (``qk_scale_log2 = softmax_scale · log2(e)``, applied with the row max in
one FMA per score) and fp32 accumulators, then merges the step's (out, lse) into the running fp32 buffers
in place with the stable log-sum-exp merge of DESIGN.md §2.4. Rows without work are not written.
With ``DOCUMENTS`` (packed documents, DESIGN.md §2.7) a listed score (i, j) counts only where the query
row's and the key's document ids agree.

GQA: KV head = h // group; K/V are read in place from ``[b, Nk, Hkv, d]`` (never repeated).
All row offsets are formed in int64, so sequences past 2^31 elements per tensor are safe.
"""

from __future__ import annotations

import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _online_softmax_step(acc, row_max, row_sum, scores, values, qk_scale_log2):
    """Fold one tile of raw scores q·kᵀ ``[M, N]`` (−inf = masked) and its values ``[N, D]`` in. ``row_max`` is
    in raw units too, so a probability is exp2 of one FMA, scores · scale − max · scale."""
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    # a row that has seen only masked scores keeps max −inf; shift by 0 then, so exp2 gives 0, not NaN
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2((row_max - shift) * qk_scale_log2)  # exactly 1 while the max holds
    probs = tl.exp2(scores * qk_scale_log2 - (shift * qk_scale_log2)[:, None])
    row_sum = row_sum * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values)
    return acc, new_max, row_sum


@triton.jit
def query_block_documents(query_docs_base, q_rows, DOCUMENTS: tl.constexpr):
    """(the document of every query row ``[M]``, whether the block holds two documents) with ``DOCUMENTS``;
    (q_rows, False), unused, without."""
    q_docs = q_rows
    q_mixed = False
    if DOCUMENTS:
        q_docs = tl.load(query_docs_base + q_rows)
        q_mixed = tl.min(q_docs, 0) != tl.max(q_docs, 0)
    return q_docs, q_mixed


@triton.jit
def head_rows_tile(base, desc, sample, head, first_row, rows64, offs_d, stride_n, TMA: tl.constexpr):
    """Rows ``first_row …`` of one (sample, head) of a ``[b, N, H, d]`` tensor, ``[len(rows64), d]``: one
    tensor-memory copy through ``desc`` (block ``[1, rows, 1, d]``) with ``TMA``, else a gather from ``base``
    (the (sample, head) row 0) at ``rows64`` (int64, ``first_row + arange``)."""
    if TMA:
        tile = desc.load([sample, first_row, head, 0])
        return tl.reshape(tile, [tile.shape[1], tile.shape[3]])
    return tl.load(base + rows64[:, None] * stride_n + offs_d[None, :])


@triton.jit
def _block_tile_step(
    acc,
    row_max,
    row_sum,
    q,
    q_rows,
    k_base,
    v_base,
    k_desc,
    v_desc,
    sample,
    kv_head,
    qblock,
    first_sub_tile,
    offs_block,
    offs_d,
    stride_kn,
    stride_vn,
    qk_scale_log2,
    q_docs,
    q_mixed,
    key_docs_base,
    SUB_TILE: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Fold the listed 128-key block whose sub-tiles start at ``first_sub_tile`` in (with ``CAUSAL_DIAG`` the
    token causal mask when it is query block ``qblock``'s diagonal block; with ``DOCUMENTS`` the document mask
    where the query block (``q_mixed``) or the key block holds more than one document: a listed block pair
    inside one document each is one document's, so it needs no compare). The masks are branches, not
    selects on every tile: the compare costs only the tiles that need it."""
    first_key = first_sub_tile * SUB_TILE
    k_rows = (first_key + offs_block).to(tl.int64)
    k = head_rows_tile(k_base, k_desc, sample, kv_head, first_key, k_rows, offs_d, stride_kn, TMA)
    v = head_rows_tile(v_base, v_desc, sample, kv_head, first_key, k_rows, offs_d, stride_vn, TMA)
    scores = tl.dot(q, tl.trans(k))
    if CAUSAL_DIAG:
        if first_sub_tile // 2 == qblock:
            scores = tl.where(k_rows[None, :] <= q_rows[:, None], scores, float("-inf"))
    if DOCUMENTS:
        key_block_size: tl.constexpr = 2 * SUB_TILE
        k_mixed = tl.load(key_docs_base + first_key) != tl.load(key_docs_base + first_key + key_block_size - 1)
        if q_mixed | k_mixed:
            scores = tl.where(q_docs[:, None] == tl.load(key_docs_base + k_rows)[None, :], scores, float("-inf"))
    return _online_softmax_step(acc, row_max, row_sum, scores, v, qk_scale_log2)


@triton.jit
def block_bar_forward_kernel(
    Q,
    K,
    V,
    K_DESC,
    V_DESC,
    OUT,
    LSE,
    BLK_PTR,
    BLK_COL,
    BAR_PTR,
    BAR_COL,
    QUERY_DOCS,
    KEY_DOCS,
    stride_qb,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_pb,
    stride_ph,
    stride_docb,
    num_q_blocks,
    group_size,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    FRESH: tl.constexpr,
    TMA: tl.constexpr,
):
    """QUERY_DOCS / KEY_DOCS int32 ``[b, N]`` (batch stride ``stride_docb``): the document of every local
    query row and source key column, read only with ``DOCUMENTS``. ``FRESH``: OUT and LSE hold nothing yet;
    every row is written (rows without work: 0 and −inf), OUT in its own dtype, nothing is read."""
    # heavy query blocks (late in the sequence) start first
    qblock = num_q_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    sample = tl.program_id(2).to(tl.int64)
    kv_head = head // group_size

    list_row = sample * stride_pb + head * stride_ph + qblock
    blk_start = tl.load(BLK_PTR + list_row)
    blk_end = tl.load(BLK_PTR + list_row + 1)
    bar_start = tl.load(BAR_PTR + list_row)
    bar_end = tl.load(BAR_PTR + list_row + 1)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = qblock * BLOCK_M + offs_m
    q = tl.load(Q + sample * stride_qb + head * stride_qh + q_rows.to(tl.int64)[:, None] * stride_qn + offs_d[None, :])
    k_base = K + sample * stride_kb + kv_head * stride_kh
    v_base = V + sample * stride_vb + kv_head * stride_vh
    key_docs_base = KEY_DOCS + sample * stride_docb
    q_docs, q_mixed = query_block_documents(QUERY_DOCS + sample * stride_docb, q_rows, DOCUMENTS)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)

    # ---- loop 1: listed key blocks, one 128-key tile per pair of sub-tiles (2j, 2j + 1). One pipelined loop
    # whose causal mask is a branch on the diagonal block: faster than an unmasked loop followed by a diagonal
    # loop, and than a select on every tile (docs/benchmarks.md, kernels v2 step 6)
    offs_block = tl.arange(0, BLOCK_M)
    for entry in range(blk_start, blk_end, 2):
        acc, row_max, row_sum = _block_tile_step(
            acc,
            row_max,
            row_sum,
            q,
            q_rows,
            k_base,
            v_base,
            K_DESC,
            V_DESC,
            tl.program_id(2),
            kv_head,
            qblock,
            tl.load(BLK_COL + entry),
            offs_block,
            offs_d,
            stride_kn,
            stride_vn,
            qk_scale_log2,
            q_docs,
            q_mixed,
            key_docs_base,
            BLOCK_N,
            CAUSAL_DIAG,
            DOCUMENTS,
            TMA,
        )

    # ---- loop 2: bar columns, gathered 64 at a time (bars are never causal)
    for entry in range(bar_start, bar_end, BLOCK_N):
        listed = entry + offs_n < bar_end
        cols = tl.load(BAR_COL + entry + offs_n, mask=listed, other=0).to(tl.int64)
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=listed[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=listed[:, None], other=0.0)
        scores = tl.where(listed[None, :], tl.dot(q, tl.trans(k)), float("-inf"))
        if DOCUMENTS:
            same_doc = q_docs[:, None] == tl.load(key_docs_base + cols, mask=listed, other=-1)[None, :]
            scores = tl.where(same_doc, scores, float("-inf"))
        acc, row_max, row_sum = _online_softmax_step(acc, row_max, row_sum, scores, v, qk_scale_log2)

    # ---- epilogue: stable merge into the running (out, lse); rows without work stay untouched
    has_work = row_sum != 0.0  # 0: no key in this step; NaN (poisoned logits) is written, not dropped
    safe_sum = tl.where(has_work, row_sum, 1.0)
    step_lse = (tl.where(has_work, row_max * qk_scale_log2, 0.0) + tl.log2(safe_sum)) * LN2
    step_out = acc / safe_sum[:, None]

    lse_ptrs = LSE + sample * stride_lb + head * stride_lh + q_rows
    out_ptrs = OUT + sample * stride_ob + head * stride_oh + q_rows.to(tl.int64)[:, None] * stride_on + offs_d[None, :]
    if FRESH:
        tl.store(lse_ptrs, tl.where(has_work, step_lse, float("-inf")))
        tl.store(out_ptrs, tl.where(has_work[:, None], step_out, 0.0).to(OUT.dtype.element_ty))
    else:
        old_lse = tl.load(lse_ptrs)
        old_out = tl.load(out_ptrs, mask=has_work[:, None], other=0.0)
        larger = tl.maximum(old_lse, step_lse)
        tail = tl.exp(-tl.abs(old_lse - step_lse))
        merged_lse = larger + tl.log(1.0 + tail)
        # weights relative to the larger side, not to the rounded merged_lse: at |lse| ~ 1e4 its fp32 ulp would
        # scale even the dominant side by 1 ± 5e-4, which dq amplifies for rows that attend to one key
        old_weight = tl.exp(old_lse - larger) / (1.0 + tail)
        new_weight = tl.exp(step_lse - larger) / (1.0 + tail)
        merged_out = tl.where(
            (old_lse == float("-inf"))[:, None],
            step_out,
            old_weight[:, None] * old_out + new_weight[:, None] * step_out,
        )
        tl.store(lse_ptrs, merged_lse, mask=has_work)
        tl.store(out_ptrs, merged_out, mask=has_work[:, None])
