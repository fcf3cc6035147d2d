"""Forward of the block tiles and bars on Hopper, two warpgroups in ping-pong (Gluon; DESIGN.md §2.6).

A persistent program (one per multiprocessor) takes the items (one 128-row query block of one query head) one
after another from a counter, the heaviest blocks first, so the items running together stay neighbours, as the
hardware would launch them (fixed shares drift apart, and so do the K/V blocks they read: slower at 512K,
docs/benchmarks.md, session 36). For each it walks the block list (128-key blocks, each two 64-wide sub-tile
entries as ``convert_index`` writes them), then the bar list in chunks of 128 columns:

* the loader (1 warp; 4 with bars) — each item's query block (two buffers, so the next item's is loaded while
  this one is attended), then each listed block's k and v by tensor-memory copies, then each bar chunk's k and v
  rows by asynchronous copies (``cp.async``: Hopper's tensor-memory copies cannot gather rows), two stages ahead,
  the stages running on from one item into the next;
* two softmax warpgroups (4 warps each), one per 64-row half of the query block: S = q_h·kᵀ, the online
  softmax in base 2 (the scale folded into one FMA with the row max), O += P·v with P from registers. They take
  turns to issue S (named barriers 14/15 over their 256 threads), so one's softmax runs under the other's
  products (FlashAttention-3's ping-pong). Each writes its output through its half of the q buffer, which its
  products no longer read, by one tensor-memory copy, while the other attends.

The last listed block of query block i is its diagonal block i when ``CAUSAL_DIAG`` (as in ``triton_fwd``); bar
columns lie before it, so they are never masked by causality. For one ring step without documents (``fresh``:
every row is written, rows without work 0 and −inf); documents and the merge into running buffers stay with
``triton_fwd``. Inputs: q ``[b, N, Hq, d]`` and k, v ``[b, N, Hkv, d]`` contiguous bf16/fp16 (read as ``[b·N,
H·d]``), d = 128; out ``[b, N, Hq, d]`` in q's dtype and lse fp32 ``[b, Hq, N]``. Written in the Gluon API of
Triton 3.6.
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
from triton.runtime import driver

from .direct_launch import direct
from .gluon_descriptors import rows_descriptor

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
BLOCK = 128  # query rows per program and keys per listed block
SUB_TILE = 64  # keys per block-list entry
STAGES = 2  # k/v blocks in flight
SOFTMAX_WARPS = 4  # the default partition: the first half's warpgroup
LOADER_REGISTERS = gl.constexpr(24)
BAR_LOADER_WARPS = gl.constexpr(4)  # with bars: the loader warps that gather them (one alone cannot keep up)
BAR_LOADER_REGISTERS = gl.constexpr(56)  # with bars: a chunk's addresses at once
ITEM_FIELDS = gl.constexpr(8)  # int32 fields per item the loader passes to the softmax warpgroups (5 used)


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
def _gather_bars(
    k_smem,
    v_smem,
    bars,
    first,
    sample,
    kv_head,
    seq_len,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    WARPS: gl.constexpr,
):
    """Starts the asynchronous copies of the k and v rows of bar entries first … first + BLOCK − 1 into k_smem and
    v_smem ``[BLOCK, HEAD_DIM]``; ``bars`` = (BAR_COL, first entry, end entry, K, V, row stride of the 2-D views
    ``[b·N, Hkv·d]``). Entries past the end copy key column 0's rows (finite values; the scores mask them). One copy
    per tensor: the chunk's column indices are all loaded before it (copies in groups of rows would each wait for
    their indices, behind the barriers the compiler puts between writes into one buffer)."""
    BAR_COL, _, end, K, V, row_stride = bars
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [WARPS, 1], [1, 0])
    entries = first + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    cols = gl.load(BAR_COL + entries, mask=entries < end, other=0)
    offsets = ((sample * seq_len + cols).to(gl.int64) * row_stride + kv_head * HEAD_DIM)[:, None] + offs_d[None, :]
    async_copy.async_copy_global_to_shared(k_smem, K + offsets)
    async_copy.async_copy_global_to_shared(v_smem, V + offsets)


@gluon.jit
def _loader(
    q_desc,
    k_desc,
    v_desc,
    COUNTER,
    buffers,
    work,
    seq_len,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    SUB_TILE: gl.constexpr,
    STAGES: gl.constexpr,
    BARS: gl.constexpr,
):
    """``buffers`` = (q_bufs, k_bufs, v_bufs, q_ready, q_empty, ready_bars, empty_bars, item_slots); ``work`` as in
    :func:`_item_lists`. Takes the next item from COUNTER (int32, 0 at the launch) while any is left, so the items
    running together stay neighbours, as the hardware would launch them; the program whose take is the launch's last
    (num_items + programs takes in all, one past the end per program) sets it back to 0. Per item: its number into
    the item's slot and its query block into the item's q buffer once both halves have released them, the listed
    blocks by tensor-memory copies, then (``BARS``) the bars in chunks of BLOCK entries by asynchronous copies, each
    stage's ready barrier completing once the loader warps' copies have landed. Then num_items into the next slot:
    the end."""
    q_bufs, k_bufs, v_bufs, q_ready, q_empty, ready_bars, empty_bars, item_slots = buffers
    num_items = work[0]
    fields_layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [BAR_LOADER_WARPS if BARS else 1], [0])
    field_ids = gl.arange(0, ITEM_FIELDS, layout=fields_layout)
    step = 0
    taken = 0
    item = gl.atomic_add(COUNTER, 1, sem="relaxed")
    while item < num_items:
        BLK_COL, start, end, qblock, head, kv_head, sample, bars = _item_lists(item, work, BARS)
        q_slot = taken % 2
        mbarrier.wait(q_empty.index(q_slot), ((taken // 2) & 1) ^ 1)
        fields = _item_fields(field_ids, item, start, end, bars[1], bars[2])
        item_slots.index(q_slot).store(fields)
        gl.thread_barrier()  # stored by every loader warp before the arrival that publishes it
        q_bar = q_ready.index(q_slot)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)  # an arrival: the halves that wait on it see the item
        q_coords = [sample * seq_len + qblock * BLOCK, head * HEAD_DIM]
        tma.async_copy_global_to_shared(q_desc, q_coords, q_bar, q_bufs.index(q_slot))
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
        if BARS:
            for first in range(bars[1], bars[2], BLOCK):
                slot = step % STAGES
                mbarrier.wait(empty_bars.index(slot), ((step // STAGES) & 1) ^ 1)
                k_slot, v_slot = k_bufs.index(slot), v_bufs.index(slot)
                _gather_bars(k_slot, v_slot, bars, first, sample, kv_head, seq_len, HEAD_DIM, BLOCK, BAR_LOADER_WARPS)
                ready = ready_bars.index(slot)
                async_copy.mbarrier_arrive(ready)  # per thread: counted now, released once its copies land
                gl.thread_barrier()  # every loader warp has counted its copies before the one arrival
                mbarrier.arrive(ready, count=1)
                step += 1
        taken += 1
        item = gl.atomic_add(COUNTER, 1, sem="relaxed")
    if item == num_items + gl.num_programs(0) - 1:  # the launch's last take: every other one is done
        gl.atomic_xchg(COUNTER, 0, sem="relaxed")  # 0 again for the stream's next launch
    q_slot = taken % 2  # no items left: the halves read num_items and stop
    mbarrier.wait(q_empty.index(q_slot), ((taken // 2) & 1) ^ 1)
    item_slots.index(q_slot).store(_item_fields(field_ids, num_items, 0, 0, 0, 0))
    gl.thread_barrier()
    mbarrier.arrive(q_ready.index(q_slot), count=1)


@gluon.jit
def _scores(
    q_half, k_tile, thread_ids, HALF: gl.constexpr, ROWS: gl.constexpr, BLOCK: gl.constexpr, mma_layout: gl.constexpr
):
    """S = q_half·k_tileᵀ ``[ROWS, BLOCK]``, issued in this warpgroup's turn."""
    _wait_turn(thread_ids, HALF)
    s_tok = warpgroup_mma(
        q_half,
        k_tile.permute((1, 0)),
        gl.zeros([ROWS, BLOCK], gl.float32, mma_layout),
        use_acc=False,
        is_async=True,
    )
    _pass_turn(thread_ids, HALF)
    return warpgroup_mma_wait(0, deps=[s_tok])


@gluon.jit
def _attend(scores, v_tile, row_max, row_sum, acc, qk_scale_log2, p_layout: gl.constexpr):
    """One online-softmax step in base 2 (the scale folded into one FMA with the row max): (row max, row sum,
    acc) after the scores ``[ROWS, BLOCK]`` (−inf where masked) and v_tile ``[BLOCK, HEAD_DIM]``."""
    new_max = gl.maximum(row_max, gl.max(scores, 1))
    shift = gl.where(new_max == float("-inf"), 0.0, new_max)  # rows that saw only masked scores
    rescale = gl.exp2((row_max - shift) * qk_scale_log2)
    probs = gl.exp2(scores * qk_scale_log2 - (shift * qk_scale_log2)[:, None])
    row_sum = row_sum * rescale + gl.sum(probs, 1)
    acc = acc * rescale[:, None]
    o_tok = warpgroup_mma(gl.convert_layout(probs.to(v_tile.dtype), p_layout), v_tile, acc, is_async=True)
    return new_max, row_sum, warpgroup_mma_wait(0, deps=[o_tok])


@gluon.jit
def _softmax_warpgroup(
    operands,
    HALF: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    SUB_TILE: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL_DIAG: gl.constexpr,
    BARS: gl.constexpr,
):
    """Rows HALF·BLOCK/2 … of each item's query block: acc ``[BLOCK/2, HEAD_DIM]`` fp32 in registers, written once
    per item through this half's rows of the q buffer (after its last product) by a tensor-memory copy, then the
    buffer released. ``operands`` (both halves take the same) = (the loader's ``buffers``, the output's descriptor
    (``[BLOCK/2, HEAD_DIM]`` tiles of ``[b·N, Hq·d]``), LSE, lse_strides (batch, head) of LSE, N, work as in
    :func:`_item_lists`, qk_scale_log2). The listed blocks, then (``BARS``) the bar chunks the loader gathered."""
    buffers, o_desc, LSE, lse_strides, seq_len, work, qk_scale_log2 = operands
    q_bufs, k_bufs, v_bufs, q_ready, q_empty, ready_bars, empty_bars, item_slots = buffers
    ROWS: gl.constexpr = BLOCK // 2
    # S [ROWS, BLOCK] and acc [ROWS, HEAD_DIM] share one layout (d = BLOCK = 128): a row's statistics apply to both
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    k_offsets = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, mma_layout))
    thread_ids = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    if HALF == 1:
        _pass_turn(thread_ids, HALF)  # the first half goes first
    fields_layout: gl.constexpr = gl.BlockedLayout([ITEM_FIELDS], [32], [4], [0])
    field_ids = gl.arange(0, ITEM_FIELDS, layout=fields_layout)
    step = 0
    taken = 0
    mbarrier.wait(q_ready.index(0), 0)
    fields = item_slots.index(0).load(fields_layout)
    item = _field(fields, field_ids, 0)
    while item < work[0]:
        start, end = _field(fields, field_ids, 1), _field(fields, field_ids, 2)
        bar_start, bar_end = _field(fields, field_ids, 3), _field(fields, field_ids, 4)
        qblock, head, sample = _item_coordinates(item, work[1], work[2])
        q_slot = taken % 2
        q_half = q_bufs.index(q_slot).slice(HALF * ROWS, ROWS, dim=0)
        q_rows = qblock * BLOCK + HALF * ROWS + gl.arange(0, ROWS, layout=rows_layout)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, mma_layout)
        row_max = gl.full([ROWS], float("-inf"), gl.float32, rows_layout)
        row_sum = gl.zeros([ROWS], gl.float32, rows_layout)
        for entry in range(start, end, 2):
            slot = step % STAGES
            mbarrier.wait(ready_bars.index(slot), (step // STAGES) & 1)
            scores = _scores(q_half, k_bufs.index(slot), thread_ids, HALF, ROWS, BLOCK, mma_layout)
            if CAUSAL_DIAG:
                if entry + 2 == end:  # the last listed block is the diagonal one: key offset ≤ query offset
                    keys = qblock * BLOCK + k_offsets
                    scores = gl.where(keys[None, :] <= q_rows[:, None], scores, float("-inf"))
            row_max, row_sum, acc = _attend(scores, v_bufs.index(slot), row_max, row_sum, acc, qk_scale_log2, p_layout)
            mbarrier.arrive(empty_bars.index(slot), count=1)
            step += 1
        if BARS:  # bar columns precede the diagonal block: no causal mask
            for first in range(bar_start, bar_end, BLOCK):
                slot = step % STAGES
                mbarrier.wait(ready_bars.index(slot), (step // STAGES) & 1)
                fence_async_shared()  # the gathered rows were written by the generic proxy, the products read them
                scores = _scores(q_half, k_bufs.index(slot), thread_ids, HALF, ROWS, BLOCK, mma_layout)
                scores = gl.where((first + k_offsets < bar_end)[None, :], scores, float("-inf"))
                row_max, row_sum, acc = _attend(
                    scores, v_bufs.index(slot), row_max, row_sum, acc, qk_scale_log2, p_layout
                )
                mbarrier.arrive(empty_bars.index(slot), count=1)
                step += 1
        has_work = row_sum != 0.0
        safe_sum = gl.where(has_work, row_sum, 1.0)
        lse = gl.where(has_work, (row_max * qk_scale_log2 + gl.log2(safe_sum)) * LN2, float("-inf"))
        out = gl.where(has_work[:, None], acc * (1.0 / safe_sum)[:, None], 0.0)
        gl.store(LSE + sample * lse_strides[0] + head * lse_strides[1] + q_rows, lse)
        # the output through this half's q rows, which its products no longer read, by one tensor-memory copy
        q_half.store(out.to(q_half.dtype))
        fence_async_shared()
        gl.thread_barrier()  # the warpgroup's rows are all in shared memory before the copy reads them
        tma.async_copy_shared_to_global(
            o_desc, [sample * seq_len + qblock * BLOCK + HALF * ROWS, head * HEAD_DIM], q_half
        )
        tma.store_wait(0)  # read: the loader may refill the buffer
        mbarrier.arrive(q_empty.index(q_slot), count=1)
        taken += 1
        mbarrier.wait(q_ready.index(taken % 2), (taken // 2) & 1)
        fields = item_slots.index(taken % 2).load(fields_layout)
        item = _field(fields, field_ids, 0)


@gluon.jit
def _item_fields(field_ids, item, start, end, bar_start, bar_end):
    """The item's fields as the loader passes them to the softmax warpgroups: (item, first entry, end entry, first
    bar, end bar, unused …) ``[ITEM_FIELDS]`` int32, every field held by every thread (``field_ids``' layout)."""
    fields = gl.where(field_ids == 0, item, gl.where(field_ids == 1, start, gl.where(field_ids == 2, end, 0)))
    return gl.where(field_ids == 3, bar_start, gl.where(field_ids == 4, bar_end, fields))


@gluon.jit
def _field(fields, field_ids, number: gl.constexpr):
    """Field ``number`` of :func:`_item_fields`' vector, a scalar (a reduction within each thread)."""
    return gl.sum(gl.where(field_ids == number, fields, 0), 0)


@gluon.jit
def _item_coordinates(item, num_blocks, heads):
    """(query block, head, sample) of item ``item``: the query blocks from the last (the heaviest) down, then the
    heads, then the samples."""
    return num_blocks - 1 - item % num_blocks, (item // num_blocks) % heads, item // (num_blocks * heads)


@gluon.jit
def _item_lists(item, work, BARS: gl.constexpr):
    """(BLK_COL, first entry, end entry, query block, head, KV head, sample, bars as in :func:`_gather_bars`) of
    item ``item``; ``work`` = (items, query blocks nb, heads Hq, group size, BLK_PTR, BLK_COL, BAR_PTR, BAR_COL,
    list strides (batch, head) of BLK_PTR, of BAR_PTR, K, V, row stride of the 2-D views ``[b·N, Hkv·d]``)."""
    (
        _,
        num_blocks,
        heads,
        group_size,
        BLK_PTR,
        BLK_COL,
        BAR_PTR,
        BAR_COL,
        list_strides,
        bar_strides,
        K,
        V,
        row_stride,
    ) = work
    qblock, head, sample = _item_coordinates(item, num_blocks, heads)
    list_row = sample * list_strides[0] + head * list_strides[1] + qblock
    if BARS:
        bar_row = sample * bar_strides[0] + head * bar_strides[1] + qblock
        bars = (BAR_COL, gl.load(BAR_PTR + bar_row), gl.load(BAR_PTR + bar_row + 1), K, V, row_stride)
    else:
        bars = (BAR_COL, 0, 0, K, V, row_stride)
    start = gl.load(BLK_PTR + list_row)
    end = gl.load(BLK_PTR + list_row + 1)
    return BLK_COL, start, end, qblock, head, head // group_size, sample, bars


@gluon.jit
def block_forward_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    K,
    V,
    LSE,
    BLK_PTR,
    BLK_COL,
    BAR_PTR,
    BAR_COL,
    COUNTER,
    seq_len,
    heads,
    num_items,
    stride_lb,
    stride_lh,
    stride_pb,
    stride_ph,
    stride_bpb,
    stride_bph,
    group_size,
    qk_scale_log2,
    HEAD_DIM: gl.constexpr,
    BLOCK: gl.constexpr,
    SUB_TILE: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL_DIAG: gl.constexpr,
    BARS: gl.constexpr,
):
    """Grid (programs,) over num_items = nb·Hq·b items, taken from COUNTER (int32 ``[1]``, 0 at the launch and
    again at its end).
    BLK_PTR int32 ``[b, Hq, nb+1]`` (strides stride_pb, stride_ph) spans BLK_COL, the listed sub-tiles of every query
    block (pairs 2j, 2j+1 per 128-key block); with ``BARS``, BAR_PTR (strides stride_bpb, stride_bph) spans BAR_COL,
    its bar columns, whose rows of K and V (the raw k and v) are gathered."""
    row_stride = heads // group_size * HEAD_DIM  # of the 2-D views [b·N, Hkv·d]
    work = (
        num_items,
        seq_len // BLOCK,
        heads,
        group_size,
        BLK_PTR,
        BLK_COL,
        BAR_PTR,
        BAR_COL,
        (stride_pb, stride_ph),
        (stride_bpb, stride_bph),
        K,
        V,
        row_stride,
    )
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    item_slots = gl.allocate_shared_memory(gl.int32, [2, ITEM_FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per half
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)  # one arrival per half
    fence_async_shared()
    buffers = (q_bufs, k_bufs, v_bufs, q_ready, q_empty, ready_bars, empty_bars, item_slots)
    softmax_operands = (buffers, o_desc, LSE, (stride_lb, stride_lh), seq_len, work, qk_scale_log2)
    gl.warp_specialize(
        [
            (_softmax_warpgroup, (softmax_operands, 0, HEAD_DIM, BLOCK, SUB_TILE, STAGES, CAUSAL_DIAG, BARS)),
            (
                _loader,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    COUNTER,
                    buffers,
                    work,
                    seq_len,
                    HEAD_DIM,
                    BLOCK,
                    SUB_TILE,
                    STAGES,
                    BARS,
                ),
            ),
            (_softmax_warpgroup, (softmax_operands, 1, HEAD_DIM, BLOCK, SUB_TILE, STAGES, CAUSAL_DIAG, BARS)),
        ],
        [BAR_LOADER_WARPS if BARS else 1, 4],
        [BAR_LOADER_REGISTERS if BARS else LOADER_REGISTERS, 240],
    )


_ITEM_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _item_counter(device: torch.device) -> torch.Tensor:
    """The int32 ``[1]`` item counter of ``device``'s current stream, kept from launch to launch: each launch
    finds it 0 and leaves it 0 (its last take resets it), so no fill is launched before it. While a CUDA graph is
    captured, a fresh zero counter instead (captured with its fill): a kept one made there would only be zeroed
    by the graph's replays."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():  # CPU: compile_sm90's stand-in inputs
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device.index, driver.active.get_current_stream(device.index))  # the raw stream, as the launch takes it
    if key not in _ITEM_COUNTERS:
        _ITEM_COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _ITEM_COUNTERS[key]


def block_forward(
    q,
    k,
    v,
    blk_ptr,
    blk_col,
    out,
    lse,
    *,
    causal_diag: bool,
    softmax_scale: float,
    programs: int,
    bar_ptr=None,
    bar_col=None,
) -> None:
    """out, lse of the block tiles listed in ``blk_ptr`` int32 ``[b, Hq, nb+1]`` / ``blk_col`` and, where given,
    the bars listed in ``bar_ptr`` / ``bar_col`` (local key columns), written whole (``fresh``); shapes and dtypes
    as in the module docstring, checked by the caller. ``programs``: the persistent programs at most (the
    device's multiprocessors: one program fills one)."""
    batch, length, heads, dim = q.shape
    bars = bar_col is not None
    bar_ptr, bar_col = (bar_ptr, bar_col) if bars else (blk_ptr, blk_col)  # without bars: never read
    num_items = length // BLOCK * heads * batch
    direct(block_forward_kernel)(
        (min(programs, num_items),),
        rows_descriptor(q, BLOCK),
        rows_descriptor(k, BLOCK),
        rows_descriptor(v, BLOCK),
        rows_descriptor(out, BLOCK // 2),
        k,
        v,
        lse,
        blk_ptr,
        blk_col,
        bar_ptr,
        bar_col,
        _item_counter(q.device),  # the next item
        length,
        heads,
        num_items,
        lse.stride(0),
        lse.stride(1),
        blk_ptr.stride(0),
        blk_ptr.stride(1),
        bar_ptr.stride(0),
        bar_ptr.stride(1),
        heads // k.shape[2],
        softmax_scale * LOG2E.value,
        HEAD_DIM=dim,
        BLOCK=BLOCK,
        SUB_TILE=SUB_TILE,
        STAGES=STAGES,
        CAUSAL_DIAG=bool(causal_diag),
        BARS=bars,
        num_warps=SOFTMAX_WARPS,
    )
