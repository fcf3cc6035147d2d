"""Forward of one ring step on Hopper, warp-specialised (Gluon; DESIGN.md §2.6).

Same contract as ``triton_fwd.block_bar_forward_kernel`` (one program per (128-row query block, query
head, sample), heavy query blocks first; the block list's 128-key tiles, then the bar columns; online
softmax in base 2; FRESH or merge epilogue), arranged as FlashAttention-3 arranges its forward:

* the loader (4 warps) — q once by a tensor-memory copy; then, through two rings of two stages (k's slot is
  released when its scores are in, v's when its product is), each listed block's k and v tiles by
  tensor-memory copies, then the bar columns' k and v rows, 128 a tile, gathered by asynchronous copies;
* the softmax partition (8 warps, two warpgroups of 64 rows) — one loop over the block tiles and then the bar
  tiles: S_t = q·k_tᵀ is issued before the product P_{t−1}·v_{t−1}, so the softmax of tile t runs while the
  tensor cores add tile t−1; P is the register operand of its product.

Inputs: q ``[b, N, Hq, d]``, k/v ``[b, N, Hkv, d]`` contiguous bf16/fp16 (read as ``[b·N, H·d]``), d = 128;
lists and (out, lse) as in ``triton_fwd``. No documents (they keep the Triton kernel). Written in the Gluon
API of Triton 3.6.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LN2 = gl.constexpr(0.6931471805599453)
BLOCK = 128  # query rows per program, keys per tile
SUB_TILE = gl.constexpr(64)  # the lists' key unit: a listed block is the sub-tile pair 2j, 2j + 1
STAGES = 2
SOFTMAX_WARPS = 8
LOADER_WARPS = gl.constexpr(4)
LOADER_REGISTERS = gl.constexpr(64)
GATHER_ROWS = gl.constexpr(32)  # bar rows per gather step of the loader


@gluon.jit
def _loader(
    descs, smem, bars, tiles, K, V, kv_offset, kv_row_stride, rows, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr
):
    """``descs`` = (q, k, v); ``smem`` = (q, k ring, v ring); ``bars`` = (q, k ready, k empty, v ready,
    v empty); ``tiles`` = (BLK_COL, blk_start, num_tiles, BAR_COL, bar_start, bar_end); ``rows`` = (q's first
    row, the sample's first k/v row, query head, KV head); ``kv_offset``: the (sample, KV head) row 0 of K/V."""
    q_desc, k_desc, v_desc = descs
    q_smem, k_bufs, v_bufs = smem
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    BLK_COL, blk_start, num_tiles, BAR_COL, bar_start, bar_end = tiles
    q_row, kv_row0, head, kv_head = rows
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, head * HEAD_DIM], q_bar, q_smem)
    for t in range(0, num_tiles):
        first_key = gl.load(BLK_COL + blk_start + 2 * t) * SUB_TILE
        slot = t % STAGES
        phase = (t // STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [kv_row0 + first_key, kv_head * HEAD_DIM], k_ready.index(slot), k_bufs.index(slot)
        )
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [kv_row0 + first_key, kv_head * HEAD_DIM], v_ready.index(slot), v_bufs.index(slot)
        )
    # the bars: each tile's rows gathered in chunks, the copies awaited and made visible to the tensor cores
    # (fence) before the slot is marked ready
    gather_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [LOADER_WARPS, 1], [1, 0])
    tile_rows: gl.constexpr = k_bufs.shape[1]
    offs_r = gl.arange(0, GATHER_ROWS, layout=gl.SliceLayout(1, gather_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gather_layout))
    for b in range(0, gl.cdiv(bar_end - bar_start, tile_rows)):
        t = num_tiles + b
        slot = t % STAGES
        phase = (t // STAGES) & 1
        mbarrier.wait(k_empty.index(slot), phase ^ 1)
        mbarrier.wait(v_empty.index(slot), phase ^ 1)
        for chunk in gl.static_range(tile_rows // GATHER_ROWS):
            entry = bar_start + b * tile_rows + chunk * GATHER_ROWS + offs_r
            listed = entry < bar_end
            cols = gl.load(BAR_COL + entry, mask=listed, other=0).to(gl.int64)
            offsets = kv_offset + cols[:, None] * kv_row_stride + offs_d[None, :]
            k_rows = k_bufs.index(slot).slice(chunk * GATHER_ROWS, GATHER_ROWS, dim=0)
            v_rows = v_bufs.index(slot).slice(chunk * GATHER_ROWS, GATHER_ROWS, dim=0)
            async_copy.async_copy_global_to_shared(k_rows, K + offsets, mask=listed[:, None])
            async_copy.async_copy_global_to_shared(v_rows, V + offsets, mask=listed[:, None])
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()  # each thread its own copies, before the barrier the arrival follows
        gl.thread_barrier()
        mbarrier.arrive(k_ready.index(slot), count=1)
        mbarrier.arrive(v_ready.index(slot), count=1)


@gluon.jit
def _softmax_step(scores, row_max, row_sum, qk_scale_log2):
    """(P in fp32, new max, new sum, the factor the accumulator is rescaled by) after one tile of raw scores
    (−inf = masked); max in raw units, as in ``triton_fwd._online_softmax_step``."""
    new_max = gl.maximum(row_max, gl.max(scores, 1))
    shift = gl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = gl.exp2((row_max - shift) * qk_scale_log2)
    probs = gl.exp2(scores * qk_scale_log2 - (shift * qk_scale_log2)[:, None])
    return probs, new_max, row_sum * rescale + gl.sum(probs, 1), rescale


@gluon.jit
def _tile_scores(scores, t, tiles, qblock, q_rows, offs_key, BLOCK: gl.constexpr, CAUSAL_DIAG: gl.constexpr):
    """Tile t's scores masked: a block tile with the token causal mask when it is the diagonal block (with
    ``CAUSAL_DIAG``), a bar tile beyond the step's last bar (``tiles`` as the loader's)."""
    BLK_COL, blk_start, num_tiles, _, bar_start, bar_end = tiles
    if t < num_tiles:
        if CAUSAL_DIAG:
            first_key = gl.load(BLK_COL + blk_start + 2 * t) * SUB_TILE
            if first_key // BLOCK == qblock:
                scores = gl.where((first_key + offs_key)[None, :] <= q_rows[:, None], scores, float("-inf"))
    else:
        entry = bar_start + (t - num_tiles) * BLOCK
        scores = gl.where((entry + offs_key < bar_end)[None, :], scores, float("-inf"))
    return scores


@gluon.jit
def _softmax_partition(
    smem,
    bars,
    tiles,
    qblock,
    OUT,
    LSE,
    out_offset,
    stride_on,
    lse_offset,
    qk_scale_log2,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL_DIAG: gl.constexpr,
    FRESH: gl.constexpr,
):
    """``tiles`` = (BLK_COL, blk_start, num_tiles, BAR_COL, bar_start, bar_end): the block tiles, then the bar
    tiles, in the order the loader fills the rings."""
    q_smem, k_bufs, v_bufs = smem
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype

    q_rows = qblock * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_layout))
    offs_key = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
    row_max = gl.full([BLOCK], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    row_sum = gl.zeros([BLOCK], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout)
    zeros_s = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)

    # S_t is issued before P_{t-1}·v_{t-1}: the softmax of t overlaps that product
    total = tiles[2] + gl.cdiv(tiles[5] - tiles[4], BLOCK)
    if total > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(0), count=1)
        scores = _tile_scores(scores, 0, tiles, qblock, q_rows, offs_key, BLOCK, CAUSAL_DIAG)
        probs, row_max, row_sum, rescale = _softmax_step(scores, row_max, row_sum, qk_scale_log2)
        for t in range(1, total):
            slot = t % STAGES
            previous = (t - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (t // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(previous), ((t - 1) // STAGES) & 1)
            o_tok = warpgroup_mma(
                gl.convert_layout(probs.to(dtype), p_layout), v_bufs.index(previous), acc, is_async=True
            )
            scores = warpgroup_mma_wait(1, deps=[s_tok])
            mbarrier.arrive(k_empty.index(slot), count=1)
            scores = _tile_scores(scores, t, tiles, qblock, q_rows, offs_key, BLOCK, CAUSAL_DIAG)
            probs, row_max, row_sum, rescale = _softmax_step(scores, row_max, row_sum, qk_scale_log2)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(v_empty.index(previous), count=1)
            acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o_layout))[:, None]
        last = (total - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((total - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(gl.convert_layout(probs.to(dtype), p_layout), v_bufs.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])

    # ---- epilogue, as triton_fwd's: rows without work stay untouched (FRESH: 0 and −inf)
    has_work = row_sum != 0.0
    safe_sum = gl.where(has_work, row_sum, 1.0)
    step_lse = (gl.where(has_work, row_max * qk_scale_log2, 0.0) + gl.log2(safe_sum)) * LN2
    out_rows = qblock * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    step_out = acc / gl.convert_layout(safe_sum, gl.SliceLayout(1, o_layout))[:, None]
    out_work = gl.convert_layout(has_work, gl.SliceLayout(1, o_layout))[:, None]
    lse_ptrs = LSE + lse_offset + q_rows
    out_ptrs = OUT + out_offset + out_rows.to(gl.int64)[:, None] * stride_on + offs_d[None, :]
    if FRESH:
        gl.store(lse_ptrs, gl.where(has_work, step_lse, float("-inf")))
        gl.store(out_ptrs, gl.where(out_work, step_out, 0.0).to(OUT.dtype.element_ty))
    else:
        old_lse = gl.load(lse_ptrs)
        old_out = gl.load(out_ptrs, mask=out_work, other=0.0)
        larger = gl.maximum(old_lse, step_lse)
        tail = gl.exp(-gl.abs(old_lse - step_lse))
        merged_lse = larger + gl.log(1.0 + tail)
        old_weight = gl.convert_layout(gl.exp(old_lse - larger) / (1.0 + tail), gl.SliceLayout(1, o_layout))
        new_weight = gl.convert_layout(gl.exp(step_lse - larger) / (1.0 + tail), gl.SliceLayout(1, o_layout))
        empty_before = gl.convert_layout(old_lse == float("-inf"), gl.SliceLayout(1, o_layout))
        merged_out = gl.where(
            empty_before[:, None], step_out, old_weight[:, None] * old_out + new_weight[:, None] * step_out
        )
        gl.store(lse_ptrs, merged_lse, mask=has_work)
        gl.store(out_ptrs, merged_out, mask=out_work)


@gluon.jit
def block_bar_forward_kernel(
    q_desc,
    k_desc,
    v_desc,
    K,
    V,
    OUT,
    LSE,
    BLK_PTR,
    BLK_COL,
    BAR_PTR,
    BAR_COL,
    seq_len,
    stride_ob,
    stride_on,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_pb,
    stride_ph,
    group_size,
    qk_scale_log2,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL_DIAG: gl.constexpr,
    FRESH: gl.constexpr,
):
    """Grid (nb, Hq, b); query block nb − 1 − program_id(0) first. K, V: the k/v tensors' data as pointers
    (the bars' gathers), rows of ``H·d`` elements."""
    qblock = gl.num_programs(0) - 1 - gl.program_id(0)
    head = gl.program_id(1)
    sample = gl.program_id(2)
    kv_head = head // group_size
    list_row = sample * stride_pb + head * stride_ph + qblock
    blk_start = gl.load(BLK_PTR + list_row)
    num_tiles = (gl.load(BLK_PTR + list_row + 1) - blk_start) // 2
    bar_start = gl.load(BAR_PTR + list_row)
    bar_end = gl.load(BAR_PTR + list_row + 1)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    fence_async_shared()

    kv_row0 = sample * seq_len
    kv_row_stride = (gl.num_programs(1) // group_size) * HEAD_DIM
    kv_offset = kv_row0.to(gl.int64) * kv_row_stride + kv_head * HEAD_DIM
    smem = (q_smem, k_bufs, v_bufs)
    bars = (q_bar, k_ready, k_empty, v_ready, v_empty)
    tiles = (BLK_COL, blk_start, num_tiles, BAR_COL, bar_start, bar_end)
    gl.warp_specialize(
        [
            (
                _softmax_partition,
                (
                    smem,
                    bars,
                    tiles,
                    qblock,
                    OUT,
                    LSE,
                    sample.to(gl.int64) * stride_ob + head * stride_oh,
                    stride_on,
                    sample * stride_lb + head * stride_lh,
                    qk_scale_log2,
                    HEAD_DIM,
                    BLOCK,
                    STAGES,
                    CAUSAL_DIAG,
                    FRESH,
                ),
            ),
            (
                _loader,
                (
                    (q_desc, k_desc, v_desc),
                    smem,
                    bars,
                    tiles,
                    K,
                    V,
                    kv_offset,
                    kv_row_stride,
                    (kv_row0 + qblock * BLOCK, kv_row0, head, kv_head),
                    HEAD_DIM,
                    STAGES,
                ),
            ),
        ],
        [LOADER_WARPS],
        [LOADER_REGISTERS],
    )


def _rows_descriptor(t: torch.Tensor) -> TensorDescriptor:
    """Descriptor of contiguous ``[b, N, H, d]`` tensor ``t`` as ``[b·N, H·d]``, copying ``[BLOCK, d]`` tiles."""
    batch, length, heads, dim = t.shape
    element = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK, dim], element)
    return TensorDescriptor.from_tensor(t.view(batch * length, heads * dim), [BLOCK, dim], layout)


def block_bar_forward(
    q, k, v, blk_ptr, blk_col, bar_ptr, bar_col, out, lse, *, causal_diag: bool, qk_scale_log2: float, fresh: bool
) -> None:
    """``triton_backend.block_bar_forward`` on Hopper (shapes, dtypes and strides checked by the caller):
    q, k, v contiguous and 16-byte aligned, d = 128, no documents."""
    batch, length, heads, dim = q.shape
    block_bar_forward_kernel[(length // BLOCK, heads, batch)](
        _rows_descriptor(q),
        _rows_descriptor(k),
        _rows_descriptor(v),
        k,
        v,
        out,
        lse,
        blk_ptr,
        blk_col,
        bar_ptr,
        bar_col,
        length,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        blk_ptr.stride(0),
        blk_ptr.stride(1),
        heads // k.shape[2],
        qk_scale_log2,
        HEAD_DIM=dim,
        BLOCK=BLOCK,
        STAGES=STAGES,
        CAUSAL_DIAG=bool(causal_diag),
        FRESH=bool(fresh),
        num_warps=SOFTMAX_WARPS,
    )
