"""Forward of the block tiles on Hopper, two warpgroups in ping-pong (Gluon; DESIGN.md §2.6).

A program owns one 128-row query block of one query head (grid (nb, Hq, b), the heaviest blocks first) and
walks its block list (128-key blocks, each two 64-wide sub-tile entries as ``convert_index`` writes them):

* the loader (1 warp) — the query block once, then each listed block's k and v by tensor-memory copies, two
  stages ahead;
* two softmax warpgroups (4 warps each), one per 64-row half of the query block: S = q_h·kᵀ, the online
  softmax in base 2 (the scale folded into one FMA with the row max), O += P·v with P from registers. They take
  turns to issue S (named barriers 14/15 over their 256 threads), so one's softmax runs under the other's
  products (FlashAttention-3's ping-pong).

The last listed block of query block i is its diagonal block i when ``CAUSAL_DIAG`` (as in ``triton_fwd``).
For one ring step with no bars and no documents (``fresh``: every row is written, rows without work 0 and
−inf); the bars, documents and the merge into running buffers stay with ``triton_fwd``. Inputs: q ``[b, N, Hq,
d]`` and k, v ``[b, N, Hkv, d]`` contiguous bf16/fp16 (read as ``[b·N, H·d]``), d = 128; out ``[b, N, Hq, d]``
in q's dtype and lse fp32 ``[b, Hq, N]``. Written in the Gluon API of Triton 3.6.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_descriptors import rows_descriptor

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
BLOCK = 128  # query rows per program and keys per listed block
SUB_TILE = 64  # keys per block-list entry
STAGES = 2  # k/v blocks in flight
SOFTMAX_WARPS = 4  # the default partition: the first half's warpgroup


@gluon.jit
def _named_barrier(thread_ids, ASM: gl.constexpr):
    """One ``bar.sync``/``bar.arrive`` of the two softmax warpgroups' 256 threads (``thread_ids``: one per thread)."""
    gl.inline_asm_elementwise(ASM + " mov.u32 $0, 0;", "=r,r", [thread_ids], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_turn(thread_ids, HALF: gl.constexpr):
    """Wait until the other warpgroup has issued its S product (named barrier 14 + HALF)."""
    if HALF == 0:
        _named_barrier(thread_ids, "bar.sync 14, 256;")
    else:
        _named_barrier(thread_ids, "bar.sync 15, 256;")


@gluon.jit
def _pass_turn(thread_ids, HALF: gl.constexpr):
    """Let the other warpgroup issue its S product."""
    if HALF == 0:
        _named_barrier(thread_ids, "bar.arrive 15, 256;")
    else:
        _named_barrier(thread_ids, "bar.arrive 14, 256;")


@gluon.jit
def _loader(
    q_desc,
    k_desc,
    v_desc,
    buffers,
    lists,
    seq_len,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    SUB_TILE: gl.constexpr,
    STAGES: gl.constexpr,
):
    """``buffers`` = (q_smem, k_bufs, v_bufs, q_bar, ready_bars, empty_bars); ``lists`` = (BLK_COL, first entry,
    end entry, query block, head, KV head, sample)."""
    q_smem, k_bufs, v_bufs, q_bar, ready_bars, empty_bars = buffers
    BLK_COL, start, end, qblock, head, kv_head, sample = lists
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [sample * seq_len + qblock * BLOCK, head * HEAD_DIM], q_bar, q_smem)
    step = 0
    for entry in range(start, end, 2):
        first_key = gl.load(BLK_COL + entry) * SUB_TILE
        slot = step % STAGES
        mbarrier.wait(empty_bars.index(slot), ((step // STAGES) & 1) ^ 1)
        ready = ready_bars.index(slot)
        mbarrier.expect(ready, 2 * k_desc.block_type.nbytes)
        coords = [sample * seq_len + first_key, kv_head * HEAD_DIM]
        tma.async_copy_global_to_shared(k_desc, coords, ready, k_bufs.index(slot))
        tma.async_copy_global_to_shared(v_desc, coords, ready, v_bufs.index(slot))
        step += 1


@gluon.jit
def _softmax_warpgroup(
    operands,
    HALF: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    SUB_TILE: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL_DIAG: gl.constexpr,
):
    """Rows HALF·BLOCK/2 … of the query block: acc ``[BLOCK/2, HEAD_DIM]`` fp32 in registers, written once.
    ``operands`` (both halves take the same) = (the loader's ``buffers``, OUT, LSE, out_strides, lse_strides,
    lists, qk_scale_log2), with ``out_strides`` = (batch, token, head) of OUT and ``lse_strides`` = (batch, head)
    of LSE."""
    buffers, OUT, LSE, out_strides, lse_strides, lists, qk_scale_log2 = operands
    q_smem, k_bufs, v_bufs, q_bar, ready_bars, empty_bars = buffers
    BLK_COL, start, end, qblock, head, kv_head, sample = lists
    ROWS: gl.constexpr = BLOCK // 2
    # S [ROWS, BLOCK] and acc [ROWS, HEAD_DIM] share one layout (d = BLOCK = 128): a row's statistics apply to both
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    dtype: gl.constexpr = q_smem.dtype
    q_half = q_smem.slice(HALF * ROWS, ROWS, dim=0)
    q_rows = qblock * BLOCK + HALF * ROWS + gl.arange(0, ROWS, layout=rows_layout)
    k_offsets = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, mma_layout))

    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma_layout)
    row_max = gl.full([ROWS], float("-inf"), gl.float32, rows_layout)
    row_sum = gl.zeros([ROWS], gl.float32, rows_layout)
    thread_ids = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    if HALF == 1:
        _pass_turn(thread_ids, HALF)  # the first half goes first
    mbarrier.wait(q_bar, 0)
    step = 0
    for entry in range(start, end, 2):
        first_sub_tile = gl.load(BLK_COL + entry)
        slot = step % STAGES
        mbarrier.wait(ready_bars.index(slot), (step // STAGES) & 1)
        _wait_turn(thread_ids, HALF)
        s_tok = warpgroup_mma(
            q_half,
            k_bufs.index(slot).permute((1, 0)),
            gl.zeros([ROWS, BLOCK], gl.float32, mma_layout),
            use_acc=False,
            is_async=True,
        )
        _pass_turn(thread_ids, HALF)
        scores = warpgroup_mma_wait(0, deps=[s_tok])
        if CAUSAL_DIAG:
            if first_sub_tile // 2 == qblock:  # the diagonal block: key offset ≤ query offset
                keys = first_sub_tile * SUB_TILE + k_offsets
                scores = gl.where(keys[None, :] <= q_rows[:, None], scores, float("-inf"))
        new_max = gl.maximum(row_max, gl.max(scores, 1))
        shift = gl.where(new_max == float("-inf"), 0.0, new_max)  # rows that saw only masked scores
        rescale = gl.exp2((row_max - shift) * qk_scale_log2)
        probs = gl.exp2(scores * qk_scale_log2 - (shift * qk_scale_log2)[:, None])
        row_sum = row_sum * rescale + gl.sum(probs, 1)
        acc = acc * rescale[:, None]
        o_tok = warpgroup_mma(gl.convert_layout(probs.to(dtype), p_layout), v_bufs.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(empty_bars.index(slot), count=1)
        row_max = new_max
        step += 1

    has_work = row_sum != 0.0
    safe_sum = gl.where(has_work, row_sum, 1.0)
    lse = gl.where(has_work, (row_max * qk_scale_log2 + gl.log2(safe_sum)) * LN2, float("-inf"))
    out = gl.where(has_work[:, None], acc / safe_sum[:, None], 0.0)
    gl.store(LSE + sample * lse_strides[0] + head * lse_strides[1] + q_rows, lse)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_layout))
    rows = sample * out_strides[0] + q_rows.to(gl.int64)[:, None] * out_strides[1] + head * out_strides[2]
    gl.store(OUT + rows + offs_d[None, :], out.to(OUT.dtype.element_ty))


@gluon.jit
def block_forward_kernel(
    q_desc,
    k_desc,
    v_desc,
    OUT,
    LSE,
    BLK_PTR,
    BLK_COL,
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
    SUB_TILE: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL_DIAG: gl.constexpr,
):
    """Grid (nb, Hq, b). BLK_PTR int32 ``[b, Hq, nb+1]`` (strides stride_pb, stride_ph) spans BLK_COL, the
    listed sub-tiles of every query block (pairs 2j, 2j+1 per 128-key block)."""
    num_blocks = gl.num_programs(0)
    qblock = num_blocks - 1 - gl.program_id(0)  # heavy query blocks (late in the sequence) start first
    head = gl.program_id(1)
    sample = gl.program_id(2)
    list_row = sample * stride_pb + head * stride_ph + qblock
    lists = (
        BLK_COL,
        gl.load(BLK_PTR + list_row),
        gl.load(BLK_PTR + list_row + 1),
        qblock,
        head,
        head // group_size,
        sample,
    )
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # one arrival per half
    fence_async_shared()
    buffers = (q_smem, k_bufs, v_bufs, q_bar, ready_bars, empty_bars)
    softmax_operands = (
        buffers,
        OUT,
        LSE,
        (stride_ob, stride_on, stride_oh),
        (stride_lb, stride_lh),
        lists,
        qk_scale_log2,
    )
    gl.warp_specialize(
        [
            (_softmax_warpgroup, (softmax_operands, 0, HEAD_DIM, BLOCK, SUB_TILE, STAGES, CAUSAL_DIAG)),
            (
                _loader,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    buffers,
                    lists,
                    seq_len,
                    HEAD_DIM,
                    BLOCK,
                    SUB_TILE,
                    STAGES,
                ),
            ),
            (_softmax_warpgroup, (softmax_operands, 1, HEAD_DIM, BLOCK, SUB_TILE, STAGES, CAUSAL_DIAG)),
        ],
        [1, 4],
        [24, 240],
    )


def block_forward(q, k, v, blk_ptr, blk_col, out, lse, *, causal_diag: bool, softmax_scale: float) -> None:
    """out, lse of the block tiles listed in ``blk_ptr`` int32 ``[b, Hq, nb+1]`` / ``blk_col``, written whole
    (``fresh``); shapes and dtypes as in the module docstring, checked by the caller."""
    batch, length, heads, dim = q.shape
    block_forward_kernel[(length // BLOCK, heads, batch)](
        rows_descriptor(q, BLOCK),
        rows_descriptor(k, BLOCK),
        rows_descriptor(v, BLOCK),
        out,
        lse,
        blk_ptr,
        blk_col,
        length,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        blk_ptr.stride(0),
        blk_ptr.stride(1),
        heads // k.shape[2],
        softmax_scale * LOG2E.value,
        HEAD_DIM=dim,
        BLOCK=BLOCK,
        SUB_TILE=SUB_TILE,
        STAGES=STAGES,
        CAUSAL_DIAG=bool(causal_diag),
        num_warps=SOFTMAX_WARPS,
    )
