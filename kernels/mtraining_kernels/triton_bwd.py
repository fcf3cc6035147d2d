"""Triton backward kernels of one ring step (DESIGN.md §2.6).

Every kernel recomputes P = exp2(scale·log2(e)·q·kᵀ − lse·log2(e)) from the FINAL merged lse and
uses dS = P ⊙ (dO·Vᵀ − delta); the softmax scale is applied once to dq/dk at the store. With
``DOCUMENTS`` (packed documents) P is 0 wherever the query row's and the key's document ids differ;
QUERY_DOCS / KEY_DOCS are int32 ``[b, N]`` with batch stride ``stride_docb``.

* :func:`query_major_backward_kernel` — a program owns a query block's dq rows over its listed
  64-key sub-tiles and its bars (or its bars alone, beside ``gluon_bwd``'s one-pass block tiles); with
  ``ATOMIC_BAR_DKDV`` it also adds the bar tiles' dk/dv into the fp32 buffers with atomics (the default
  mode).
* :func:`key_major_backward_kernel` — a program owns the dk/dv of one 128-key block of one KV head:
  it walks the query heads of its GQA group in order and, for each, the query blocks that list the
  block (a CSR-by-key copy of the block lists) in 64-row slices, and adds its registers into dk/dv
  once (no atomics). It runs after the query-major pass, whose bar atomics it must not race.
* :func:`bar_chunk_backward_kernel` — deterministic dk/dv of the bars: one program per chunk of up
  to 64 distinct bar columns of one (sample, query head) and part of its walk (short steps split a chunk's
  query blocks over several programs); it walks the query blocks that list any of them, with a 64-bit
  membership word per (chunk, query block), and writes its partial dk/dv rows to a scratch buffer;
* :func:`bar_member_sum_kernel` — one program per dk/dv row (sample, key column, KV head) that the
  bars reach: adds its scratch rows into dk/dv in ascending GQA member order, then part (no atomics).

Both bar kernels run on a grid sized by an upper bound of the step's work (``mtraining_kernels.bar_chunks``:
no host sync); programs past the step's real count, read from the device, do nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_fwd import head_rows_tile, query_block_documents

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_query_side(
    q_base,
    do_base,
    lse_base,
    delta_base,
    q_desc,
    do_desc,
    sample,
    head,
    first_row,
    stride_qn,
    stride_dn,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    TMA: tl.constexpr,
):
    """q, dO ``[ROWS, D]``, base-2 lse and delta ``[ROWS]`` of query rows first_row … of one (sample,
    head), whose row 0 the four base pointers address (lse −inf → +inf: P = 0); q and dO through their
    descriptors with ``TMA`` (see :func:`head_rows_tile`)."""
    q_rows = first_row + tl.arange(0, ROWS)
    rows64 = q_rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = head_rows_tile(q_base, q_desc, sample, head, first_row, rows64, offs_d, stride_qn, TMA)
    do = head_rows_tile(do_base, do_desc, sample, head, first_row, rows64, offs_d, stride_dn, TMA)
    lse = tl.load(lse_base + q_rows)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.load(delta_base + q_rows)
    return q, do, lse2, delta, q_rows


@triton.jit
def query_major_backward_kernel(
    Q,
    K,
    V,
    K_DESC,
    V_DESC,
    DO,
    OUT,
    LSE,
    DELTA,
    DQ,
    DK,
    DV,
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
    stride_db,
    stride_dn,
    stride_dh,
    stride_gqb,
    stride_gqn,
    stride_gqh,
    stride_gkb,
    stride_gkn,
    stride_gkh,
    stride_gvb,
    stride_gvn,
    stride_gvh,
    stride_lb,
    stride_lh,
    stride_pb,
    stride_ph,
    stride_docb,
    num_q_blocks,
    group_size,
    softmax_scale,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr,
    ATOMIC_BAR_DKDV: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    FRESH_DQ: tl.constexpr,
    DELTA_FROM_OUT: tl.constexpr,
    TMA: tl.constexpr,
):
    """Grid (nb, Hq, b): the dq of one query block over its listed 64-key sub-tiles and its bars (the
    longest lists, the last query blocks, first). ``FRESH_DQ``: DQ holds nothing yet; every row is written
    in DQ's dtype (rows without work: 0), not added to. ``DELTA_FROM_OUT``: DELTA holds nothing yet; the
    program computes its rows' delta = Σ_d OUT·DO (OUT strided as DO) and writes it for the passes after."""
    qblock = num_q_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    sample = tl.program_id(2).to(tl.int64)
    kv_head = head // group_size
    list_row = sample * stride_pb + head * stride_ph + qblock
    blk_start = tl.load(BLK_PTR + list_row)
    blk_end = tl.load(BLK_PTR + list_row + 1)
    bar_start = tl.load(BAR_PTR + list_row)
    bar_end = tl.load(BAR_PTR + list_row + 1)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_offset = sample * stride_lb + head * stride_lh
    q, do, lse2, delta, q_rows = _load_query_side(
        Q + sample * stride_qb + head * stride_qh,
        DO + sample * stride_db + head * stride_dh,
        LSE + lse_offset,
        DELTA + lse_offset,
        Q,
        DO,
        tl.program_id(2),
        head,
        qblock * BLOCK_M,
        stride_qn,
        stride_dn,
        HEAD_DIM,
        BLOCK_M,
        False,
    )
    if DELTA_FROM_OUT:  # what output_delta_kernel computes, from the dO rows loaded above
        out_rows = OUT + sample * stride_db + head * stride_dh + q_rows.to(tl.int64)[:, None] * stride_dn
        out = tl.load(out_rows + offs_d[None, :])
        delta = tl.sum(out.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + lse_offset + q_rows, delta)
    k_base = K + sample * stride_kb + kv_head * stride_kh
    v_base = V + sample * stride_vb + kv_head * stride_vh
    key_docs_base = KEY_DOCS + sample * stride_docb
    q_docs, q_mixed = query_block_documents(QUERY_DOCS + sample * stride_docb, q_rows, DOCUMENTS)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    for entry in range(blk_start, blk_end):
        tile = tl.load(BLK_COL + entry)
        k_rows = (tile * BLOCK_N + offs_n).to(tl.int64)
        k = head_rows_tile(k_base, K_DESC, tl.program_id(2), kv_head, tile * BLOCK_N, k_rows, offs_d, stride_kn, TMA)
        v = head_rows_tile(v_base, V_DESC, tl.program_id(2), kv_head, tile * BLOCK_N, k_rows, offs_d, stride_vn, TMA)
        probs = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale_log2 - lse2[:, None])
        if CAUSAL_DIAG:
            off_diagonal = (tile // 2) != qblock
            probs = tl.where(off_diagonal | (k_rows[None, :] <= q_rows[:, None]), probs, 0.0)
        if DOCUMENTS:  # the compare only where the query or the key 128-block holds two documents (forward)
            first_key = (tile // 2) * BLOCK_M
            k_mixed = tl.load(key_docs_base + first_key) != tl.load(key_docs_base + first_key + BLOCK_M - 1)
            if q_mixed | k_mixed:
                probs = tl.where(q_docs[:, None] == tl.load(key_docs_base + k_rows)[None, :], probs, 0.0)
        dscores = probs * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(dscores.to(k.dtype), k)

    dk_base = DK + sample * stride_gkb + kv_head * stride_gkh
    dv_base = DV + sample * stride_gvb + kv_head * stride_gvh
    for entry in range(bar_start, bar_end, BLOCK_N):
        listed = entry + offs_n < bar_end
        cols = tl.load(BAR_COL + entry + offs_n, mask=listed, other=0).to(tl.int64)
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=listed[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=listed[:, None], other=0.0)
        probs = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale_log2 - lse2[:, None])
        probs = tl.where(listed[None, :], probs, 0.0)
        if DOCUMENTS:
            same_doc = q_docs[:, None] == tl.load(key_docs_base + cols, mask=listed, other=-1)[None, :]
            probs = tl.where(same_doc, probs, 0.0)
        dscores = probs * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(dscores.to(k.dtype), k)
        if ATOMIC_BAR_DKDV:
            dv_tile = tl.dot(tl.trans(probs.to(do.dtype)), do)
            dk_tile = tl.dot(tl.trans(dscores.to(q.dtype)), q) * softmax_scale
            dv_ptrs = dv_base + cols[:, None] * stride_gvn + offs_d[None, :]
            dk_ptrs = dk_base + cols[:, None] * stride_gkn + offs_d[None, :]
            tl.atomic_add(dv_ptrs, dv_tile, mask=listed[:, None], sem="relaxed")
            tl.atomic_add(dk_ptrs, dk_tile, mask=listed[:, None], sem="relaxed")

    has_work = (blk_end > blk_start) | (bar_end > bar_start)
    dq_ptrs = DQ + sample * stride_gqb + head * stride_gqh + q_rows.to(tl.int64)[:, None] * stride_gqn + offs_d[None, :]
    if FRESH_DQ:
        tl.store(dq_ptrs, (dq * softmax_scale).to(DQ.dtype.element_ty))
    else:
        tl.store(dq_ptrs, tl.load(dq_ptrs) + dq * softmax_scale, mask=has_work)


@triton.jit
def key_major_backward_kernel(
    Q,
    K,
    V,
    DO,
    Q_DESC,
    DO_DESC,
    LSE,
    DELTA,
    DK,
    DV,
    KEY_PTR,
    KEY_QBLOCK,
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
    stride_db,
    stride_dn,
    stride_dh,
    stride_gkb,
    stride_gkn,
    stride_gkh,
    stride_gvb,
    stride_gvn,
    stride_gvh,
    stride_kpb,
    stride_kph,
    stride_lb,
    stride_lh,
    stride_docb,
    num_blocks,
    heads_q,
    group_size,
    softmax_scale,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL_DIAG: tl.constexpr,
    QUERY_ROWS: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Grid (nb, Hkv, b): the dk/dv of one 128-key block over the query blocks of its GQA group that
    list it. KEY_PTR int32 ``[b, Hq, nb+1]`` (strides stride_kpb, stride_kph): row (z, h, key block j)
    spans KEY_QBLOCK[ptr[z, h, j] : ptr[z, h, j+1]], the ascending local query blocks whose list holds
    block j; each is visited in BLOCK_M // QUERY_ROWS slices of QUERY_ROWS rows (smaller tiles keep
    dk/dv in registers)."""
    SLICES: tl.constexpr = BLOCK_M // QUERY_ROWS
    key_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    sample = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    k_rows = key_block * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = k_rows.to(tl.int64)[:, None]
    k = tl.load(K + sample * stride_kb + kv_head * stride_kh + rows64 * stride_kn + offs_d[None, :])
    v = tl.load(V + sample * stride_vb + kv_head * stride_vh + rows64 * stride_vn + offs_d[None, :])
    dk = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_docs = k_rows  # unused without DOCUMENTS
    k_mixed = False
    if DOCUMENTS:
        k_docs = tl.load(KEY_DOCS + sample * stride_docb + k_rows)
        k_mixed = tl.min(k_docs, 0) != tl.max(k_docs, 0)
    visits = 0

    for member in range(0, group_size):
        head = kv_head * group_size + member
        row = sample * stride_kpb + head * stride_kph + key_block
        start = tl.load(KEY_PTR + row)
        end = tl.load(KEY_PTR + row + 1)
        visits += end - start
        q_base = Q + sample * stride_qb + head * stride_qh
        do_base = DO + sample * stride_db + head * stride_dh
        lse_offset = sample * stride_lb + head * stride_lh
        for step in range(start * SLICES, end * SLICES):
            qblock = tl.load(KEY_QBLOCK + step // SLICES)
            q, do, lse2, delta, q_rows = _load_query_side(
                q_base,
                do_base,
                LSE + lse_offset,
                DELTA + lse_offset,
                Q_DESC,
                DO_DESC,
                tl.program_id(2),
                head,
                qblock * BLOCK_M + (step % SLICES) * QUERY_ROWS,
                stride_qn,
                stride_dn,
                HEAD_DIM,
                QUERY_ROWS,
                TMA,
            )
            probs_t = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale_log2 - lse2[None, :])
            if CAUSAL_DIAG:
                off_diagonal = key_block != qblock
                probs_t = tl.where(off_diagonal | (k_rows[:, None] <= q_rows[None, :]), probs_t, 0.0)
            if DOCUMENTS:  # the compare only where the key or the query 128-block holds two documents
                q_docs_base = QUERY_DOCS + sample * stride_docb + qblock * BLOCK_M
                q_mixed = tl.load(q_docs_base) != tl.load(q_docs_base + BLOCK_M - 1)
                if k_mixed | q_mixed:
                    q_docs = tl.load(QUERY_DOCS + sample * stride_docb + q_rows)
                    probs_t = tl.where(k_docs[:, None] == q_docs[None, :], probs_t, 0.0)
            dv += tl.dot(probs_t.to(do.dtype), do)
            dscores_t = probs_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
            dk += tl.dot(dscores_t.to(q.dtype), q)

    has_work = visits > 0
    dk_ptrs = DK + sample * stride_gkb + kv_head * stride_gkh + rows64 * stride_gkn + offs_d[None, :]
    dv_ptrs = DV + sample * stride_gvb + kv_head * stride_gvh + rows64 * stride_gvn + offs_d[None, :]
    tl.store(dk_ptrs, tl.load(dk_ptrs) + dk * softmax_scale, mask=has_work)
    tl.store(dv_ptrs, tl.load(dv_ptrs) + dv, mask=has_work)


@triton.jit
def bar_chunk_backward_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    SCRATCH_DK,
    SCRATCH_DV,
    STEP_CHUNKS,
    STEP_FIRST_SLOT,
    CHUNK_HEAD,
    CHUNK_FIRST,
    CHUNK_LEN,
    BAR_COLUMN,
    PAIR_PTR,
    PAIR_QBLOCK,
    PAIR_BITS,
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
    stride_db,
    stride_dn,
    stride_dh,
    stride_lb,
    stride_lh,
    stride_docb,
    heads_q,
    group_size,
    softmax_scale,
    qk_scale_log2,
    scratch_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QUERY_ROWS: tl.constexpr,
    DOCUMENTS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (p, part) runs chunk c = STEP_CHUNKS[0] + p if c < STEP_CHUNKS[1] (this step's chunks), else
    nothing. Chunk c covers BAR_COLUMN[first : first+len] (distinct local key columns of row CHUNK_HEAD[c] =
    z·Hq + h); pairs PAIR_PTR[c] … PAIR_PTR[c+1] give a query block and a 64-bit word whose bit t says
    column first+t is a bar of that block. Query blocks are visited in BLOCK_M // QUERY_ROWS slices, as in the
    key-major kernel, and the chunk's slices are dealt to its SPLITS parts round-robin: part ``part`` writes
    the scale·dSᵀq and Pᵀ·dO of its slices to scratch rows part·scratch_rows + first − s …, s =
    STEP_FIRST_SLOT[0] (the step's first column slot)."""
    SLICES: tl.constexpr = BLOCK_M // QUERY_ROWS
    part = tl.program_id(1)
    chunk = tl.load(STEP_CHUNKS) + tl.program_id(0)
    live = chunk < tl.load(STEP_CHUNKS + 1)
    sample_head = tl.load(CHUNK_HEAD + chunk, mask=live, other=0).to(tl.int64)
    sample = sample_head // heads_q
    head = sample_head % heads_q
    kv_head = head // group_size
    first = tl.load(CHUNK_FIRST + chunk, mask=live, other=0).to(tl.int64)
    count = tl.load(CHUNK_LEN + chunk, mask=live, other=0)  # 0: no loads, no pairs, no stores

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_chunk = offs_n < count
    cols = tl.load(BAR_COLUMN + first + offs_n, mask=in_chunk, other=0).to(tl.int64)
    k_ptrs = K + sample * stride_kb + kv_head * stride_kh + cols[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + sample * stride_vb + kv_head * stride_vh + cols[:, None] * stride_vn + offs_d[None, :]
    k = tl.load(k_ptrs, mask=in_chunk[:, None], other=0.0)
    v = tl.load(v_ptrs, mask=in_chunk[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    k_docs = cols  # unused without DOCUMENTS
    if DOCUMENTS:
        k_docs = tl.load(KEY_DOCS + sample * stride_docb + cols, mask=in_chunk, other=-1)
    q_base = Q + sample * stride_qb + head * stride_qh
    do_base = DO + sample * stride_db + head * stride_dh
    lse_offset = sample * stride_lb + head * stride_lh

    pairs_start = tl.load(PAIR_PTR + chunk, mask=live, other=0)
    pairs_end = tl.load(PAIR_PTR + chunk + 1, mask=live, other=0)
    for step in range(pairs_start * SLICES + part, pairs_end * SLICES, SPLITS):
        qblock = tl.load(PAIR_QBLOCK + step // SLICES)
        bits = tl.load(PAIR_BITS + step // SLICES)
        listed = ((bits >> offs_n.to(tl.int64)) & 1) != 0
        q, do, lse2, delta, q_rows = _load_query_side(
            q_base,
            do_base,
            LSE + lse_offset,
            DELTA + lse_offset,
            Q,
            DO,
            sample,
            head,
            qblock * BLOCK_M + (step % SLICES) * QUERY_ROWS,
            stride_qn,
            stride_dn,
            HEAD_DIM,
            QUERY_ROWS,
            False,
        )
        probs_t = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale_log2 - lse2[None, :])
        probs_t = tl.where(listed[:, None], probs_t, 0.0)
        if DOCUMENTS:
            q_docs = tl.load(QUERY_DOCS + sample * stride_docb + q_rows)
            probs_t = tl.where(k_docs[:, None] == q_docs[None, :], probs_t, 0.0)
        dv += tl.dot(probs_t.to(do.dtype), do)
        dscores_t = probs_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        dk += tl.dot(dscores_t.to(q.dtype), q)

    rows = part * scratch_rows + first - tl.load(STEP_FIRST_SLOT) + offs_n
    scratch = rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(SCRATCH_DK + scratch, dk * softmax_scale, mask=in_chunk[:, None])
    tl.store(SCRATCH_DV + scratch, dv, mask=in_chunk[:, None])


@triton.jit
def bar_member_sum_kernel(
    SCRATCH_DK,
    SCRATCH_DV,
    DK,
    DV,
    STEP_TARGETS,
    STEP_FIRST_SLOT,
    TARGET_ROW,
    TARGET_PTR,
    TARGET_SLOT,
    stride_dkb,
    stride_dkn,
    stride_dkh,
    stride_dvb,
    stride_dvn,
    stride_dvh,
    key_len,
    kv_heads,
    scratch_rows,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program p owns target t = STEP_TARGETS[0] + p if t < STEP_TARGETS[1], else does nothing: the dk/dv
    row TARGET_ROW[t] = (z·Hkv + KV head)·key_len + column. It adds the scratch rows part·scratch_rows +
    TARGET_SLOT[j] − s, j = TARGET_PTR[t] … TARGET_PTR[t+1] (ascending GQA member, then part; s =
    STEP_FIRST_SLOT[0]), one after the other, to the row's fp32 value and stores it once."""
    target = tl.load(STEP_TARGETS) + tl.program_id(0)
    live = target < tl.load(STEP_TARGETS + 1)
    row = tl.load(TARGET_ROW + target, mask=live, other=0).to(tl.int64)
    column = row % key_len
    kv_head = (row // key_len) % kv_heads
    sample = row // key_len // kv_heads
    offs_d = tl.arange(0, HEAD_DIM)
    dk_ptrs = DK + sample * stride_dkb + column * stride_dkn + kv_head * stride_dkh + offs_d
    dv_ptrs = DV + sample * stride_dvb + column * stride_dvn + kv_head * stride_dvh + offs_d
    dk = tl.load(dk_ptrs, mask=live, other=0.0)
    dv = tl.load(dv_ptrs, mask=live, other=0.0)
    first_slot = tl.load(STEP_FIRST_SLOT)
    members_start = tl.load(TARGET_PTR + target, mask=live, other=0)
    members_end = tl.load(TARGET_PTR + target + 1, mask=live, other=0)
    for member in range(members_start, members_end):
        slot = (tl.load(TARGET_SLOT + member) - first_slot).to(tl.int64)
        for part in tl.static_range(SPLITS):
            scratch_row = (part * scratch_rows + slot) * HEAD_DIM + offs_d
            dk += tl.load(SCRATCH_DK + scratch_row)
            dv += tl.load(SCRATCH_DV + scratch_row)
    tl.store(dk_ptrs, dk, mask=live)
    tl.store(dv_ptrs, dv, mask=live)


@triton.jit
def output_delta_kernel(
    OUT,
    DO,
    DELTA,
    stride_ob,
    stride_on,
    stride_oh,
    stride_db,
    stride_dn,
    stride_dh,
    stride_lb,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Grid (nb, Hq, b): DELTA[b, h, rows] = Σ_d OUT·DO in fp32 for one block of BLOCK_M rows."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    head = tl.program_id(1)
    sample = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    out = tl.load(OUT + sample * stride_ob + head * stride_oh + rows[:, None] * stride_on + offs_d[None, :])
    dout = tl.load(DO + sample * stride_db + head * stride_dh + rows[:, None] * stride_dn + offs_d[None, :])
    delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), axis=1)
    tl.store(DELTA + sample * stride_lb + head * stride_lh + rows, delta)
