"""Triton kernels of the index conversion (DESIGN.md §2.6): the block, bar and by-key lists, equal to the
PyTorch ones.

The PyTorch conversion (``index._block_lists`` / ``index._bar_lists``) materialises a bool
``[W, b, Hq, nb, nb]`` block mask and int64 ``[b, Hq, nb, Vmax]`` bar distances, then runs ``nonzero`` and
a sort of every bar entry (about 135 M at 512K with 4K verticals on one GPU), and
``index.block_lists_by_key`` sorts every block. Here :func:`slash_block_hits` first turns the slash lists into
the block hits (one launch), then one kernel runs twice, one program per (source rank w, b, query head h, local
block), which handles that row of every list:

* :func:`count_rows` — how many entries each row has (a scan in place turns them into CSR offsets);
* :func:`write_rows` — the entries themselves, stored from each row's offset in candidate order.

A row's candidates are a range of an ascending list (its bound from ``torch.searchsorted``):

* **blocks** (row: query block qb) — source w's key blocks kb ≤ qb, kept when active (``hit[b, h, qb − kb]``);
  block j is stored as its two 64-wide sub-tiles 2j, 2j+1;
* **keys** (row: source w's key block kb) — this rank's query blocks qb ≥ kb, kept when active; stored as
  local query blocks i, so row j lists the i whose block list holds j, ascending;
* **bars** (row: query block qb) — the verticals with kb < qb, kept when source w owns them and their block
  is not active; stored as local columns, which every layout keeps in global order, so the lists equal the
  sorted PyTorch ones.

A program's block row (query block i) and by-key row (key block i) have about nb candidates together.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .direct_launch import direct

CANDIDATES_PER_STEP = 128  # candidates one program reads per loop step
HITS_PER_STEP = 1024  # block diagonals or slash offsets one program of the block hits handles per loop step


# the lists of one conversion, in the order of every per-list tensor here
_BLOCKS, _KEYS, _BARS = (tl.constexpr(i) for i in range(3))
NUM_LISTS = 3
_NUM_LISTS = tl.constexpr(NUM_LISTS)


@triton.jit
def _list_row(
    w,
    own_block,
    first,
    last,
    CANDIDATE_BLOCK,
    OWNER,
    VALUE,
    HIT_ROW,
    ROW_START,
    COL,
    seq_len,
    LIST: tl.constexpr,
    WRITE: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Counts one row's entries into ROW_START + 1 (the next row's start, before the scan), or writes them into
    COL from ROW_START's offset, over its candidates
    ``first`` … ``last`` − 1 of CANDIDATE_BLOCK (blocks), or of the verticals CANDIDATE_BLOCK (bars: columns,
    the sentinel N counting as N − 1, with OWNER and VALUE the owner and local index of every global block). A
    candidate is active when HIT_ROW holds its block diagonal with ``own_block`` (the row's)."""
    found = 0
    for start in range(first, last, STEP):
        offsets = start + tl.arange(0, STEP)
        inside = offsets < last
        candidate_block = tl.load(CANDIDATE_BLOCK + offsets, mask=inside, other=0)
        if LIST == _BARS:
            column = tl.minimum(candidate_block.to(tl.int64), seq_len - 1)
            candidate_block = column // BLOCK
            inside = inside & (tl.load(OWNER + candidate_block, mask=inside, other=-1) == w)
        if LIST == _KEYS:
            distance = candidate_block - own_block
        else:
            distance = own_block - candidate_block
        active = tl.load(HIT_ROW + distance, mask=inside, other=0)
        if LIST == _BARS:
            take = inside & (active == 0)
        else:
            take = inside & (active != 0)
        if WRITE:
            rank_in_row = found + tl.cumsum(take.to(tl.int32), 0) - 1
            row_start = tl.load(ROW_START)
            if LIST == _BARS:
                local = tl.load(VALUE + candidate_block, mask=take, other=0) * BLOCK + column % BLOCK
                tl.store(COL + row_start + rank_in_row, local.to(tl.int32), mask=take)
            elif LIST == _KEYS:
                tl.store(COL + row_start + rank_in_row, offsets, mask=take)
            else:
                position = row_start + 2 * rank_in_row
                tl.store(COL + position, 2 * offsets, mask=take)
                tl.store(COL + position + 1, 2 * offsets + 1, mask=take)
        found += tl.sum(take.to(tl.int32), 0)
    if not WRITE:
        if LIST == _BLOCKS:
            tl.store(ROW_START + 1, 2 * found)  # two sub-tiles per block
        else:
            tl.store(ROW_START + 1, found)


@triton.jit
def _verticals_before(VERTICALS, width, query_block, seq_len, BLOCK: tl.constexpr):
    """How many of the ascending ``VERTICALS[0 : width]`` (the sentinel N counting as N − 1) lie in key blocks
    before ``query_block``: a binary search."""
    low = 0
    high = width
    while low < high:
        middle = (low + high) // 2
        block = tl.minimum(tl.load(VERTICALS + middle).to(tl.int64), seq_len - 1) // BLOCK
        if block < query_block:
            low = middle + 1
        else:
            high = middle
    return low


@triton.jit
def _list_rows_kernel(
    QUERY_BLOCK,
    SOURCE_BLOCK,
    BLOCK_BOUND,
    KEY_FIRST,
    VERTICALS,
    BLOCK_OWNER,
    BLOCK_LOCAL,
    BAR_BOUND,
    HIT,
    ROW_START,
    POINTERS,
    BLOCK_COL,
    KEY_COL,
    BAR_COL,
    num_global_blocks,
    num_local_blocks,
    batch_heads,
    bar_width,
    WRITE: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row (w, b·Hq, local block ``program_id(0)``) of every list, counted or written; ROW_START is int64
    ``[lists, rows + 1]``. Counting stores row r's count at r + 1 and 0 at 0, so an inclusive scan along each
    list turns it into the row starts; writing stores from them, and the CSR offsets into POINTERS
    ``[lists, W·b·Hq, nb + 1]`` int32. Tables as :class:`ListCandidates` holds them. Counting also stores how
    many verticals lie before each query block (BAR_BOUND ``[b·Hq, nb]``), which writing reads."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    w = tl.program_id(2)
    nb = num_local_blocks
    num_rows = tl.num_programs(2) * batch_heads * nb
    row = (w * batch_heads + bh) * nb + i
    hit_row = HIT + bh * num_global_blocks
    query_block = tl.load(QUERY_BLOCK + i)
    source_blocks = SOURCE_BLOCK + w * nb
    seq_len = num_global_blocks * BLOCK
    verticals = VERTICALS + bh * bar_width
    if WRITE:
        bar_bound = tl.load(BAR_BOUND + bh * nb + i)
    else:
        bar_bound = _verticals_before(verticals, bar_width, query_block, seq_len, BLOCK)
        tl.store(BAR_BOUND + bh * nb + i, bar_bound)  # the same value from every source w
    if not WRITE and row == 0:
        for lst in tl.static_range(_NUM_LISTS):
            tl.store(ROW_START + lst * (num_rows + 1), 0)
    if WRITE:  # each row's offset, and the next group's first after the group's last row
        group_pointers = POINTERS + (w * batch_heads + bh) * (nb + 1) + i
        for lst in tl.static_range(_NUM_LISTS):
            row_start = ROW_START + lst * (num_rows + 1) + row
            pointer = group_pointers + lst * (num_rows + tl.num_programs(2) * batch_heads)
            tl.store(pointer, tl.load(row_start).to(tl.int32))
            if i == nb - 1:
                tl.store(pointer + 1, tl.load(row_start + 1).to(tl.int32))
    # blocks: query block i against source w's key blocks up to it
    _list_row(
        w,
        query_block,
        0,
        tl.load(BLOCK_BOUND + w * nb + i),
        source_blocks,
        source_blocks,
        source_blocks,
        hit_row,
        ROW_START + row,
        BLOCK_COL,
        seq_len,
        _BLOCKS,
        WRITE,
        STEP,
        BLOCK,
    )
    # keys: source w's key block i against this rank's query blocks from it on
    _list_row(
        w,
        tl.load(source_blocks + i),
        tl.load(KEY_FIRST + w * nb + i),
        nb,
        QUERY_BLOCK,
        QUERY_BLOCK,
        QUERY_BLOCK,
        hit_row,
        ROW_START + (num_rows + 1) + row,
        KEY_COL,
        seq_len,
        _KEYS,
        WRITE,
        STEP,
        BLOCK,
    )
    # bars: query block i against the (sample, head)'s verticals before it
    _list_row(
        w,
        query_block,
        0,
        bar_bound,
        verticals,
        BLOCK_OWNER,
        BLOCK_LOCAL,
        hit_row,
        ROW_START + 2 * (num_rows + 1) + row,
        BAR_COL,
        seq_len,
        _BARS,
        WRITE,
        STEP,
        BLOCK,
    )


@triton.jit
def _block_hits_kernel(S_IDX, HIT, slash_width, num_blocks, stride_s, BLOCK_SIZE: tl.constexpr, STEP: tl.constexpr):
    """Row ``program_id(0)`` of ``s_idx [b·Hq, Smax]`` → HIT ``[b·Hq, NB]`` (int8): 1 at the block distances δ the
    row's valid offsets s switch on (δ = ⌊s/B⌋ and ⌈s/B⌉ < NB) and at δ = 0, 0 elsewhere."""
    row = tl.program_id(0).to(tl.int64)
    hit_row = HIT + row * num_blocks
    slash_row = S_IDX + row * stride_s
    steps = tl.arange(0, STEP)
    for start in range(0, num_blocks, STEP):
        tl.store(hit_row + start + steps, tl.zeros([STEP], dtype=tl.int8), mask=start + steps < num_blocks)
    tl.debug_barrier()  # every zero lands before any thread writes a one
    ones = tl.full([STEP], 1, dtype=tl.int8)
    for start in range(0, slash_width, STEP):
        inside = start + steps < slash_width
        offset = tl.load(slash_row + start + steps, mask=inside, other=0).to(tl.int64)
        offset = tl.where((offset >= 0) & (offset < num_blocks * BLOCK_SIZE), offset, 0)  # the sentinel N: δ = 0
        tl.store(hit_row + offset // BLOCK_SIZE, ones, mask=inside)
        tl.store(hit_row + tl.minimum((offset + BLOCK_SIZE - 1) // BLOCK_SIZE, num_blocks - 1), ones, mask=inside)
    tl.store(hit_row + steps, ones, mask=steps == 0)


def slash_block_hits(s_idx: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """``vertical_slash.slash_block_hits`` of ``s_idx [b, Hq, Smax]`` in one launch: bool ``[b, Hq, NB]``,
    contiguous (the PyTorch ops take about fourteen)."""
    batch, heads, width = s_idx.shape
    hit = torch.empty(batch, heads, num_blocks, dtype=torch.bool, device=s_idx.device)
    rows = s_idx.reshape(batch * heads, width)
    if width and rows.stride(-1) != 1:
        rows = rows.contiguous()
    direct(_block_hits_kernel)(
        (batch * heads,),
        rows,
        hit.view(torch.int8),
        width,
        num_blocks,
        rows.stride(0),
        BLOCK_SIZE=block_size,
        STEP=HITS_PER_STEP,
    )
    return hit


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


class BlockTables(NamedTuple):
    """``index.block_tables`` in kernel form (int32, contiguous): what the block lists' candidates of one
    (layout, rank, N) are, whatever the index."""

    query_blocks: torch.Tensor  # [nb] global ids of this rank's query blocks, ascending
    source_blocks: torch.Tensor  # [W, nb] global ids of every source's key blocks, ascending per source
    prefix: torch.Tensor  # [W, nb] how many of source w's key blocks are ≤ query block i
    first_query: torch.Tensor  # [W, nb] how many query blocks are < source w's key block j
    block_owner: torch.Tensor  # [NB] the source rank holding each global block
    block_local: torch.Tensor  # [NB] its index among that source's blocks


def block_tables(source_blocks: torch.Tensor, query_blocks: torch.Tensor) -> BlockTables:
    """``source_blocks [W, nb]`` and ``query_blocks [nb]`` (global ids, ascending per row), any integer dtype."""
    world, nb = source_blocks.shape
    key_block, queries = _int32(source_blocks), _int32(query_blocks)
    prefix = torch.searchsorted(key_block, queries.expand(world, nb).contiguous(), right=True, out_int32=True)
    first_query = torch.searchsorted(queries, key_block, out_int32=True)
    block_owner = torch.empty(world * nb, dtype=torch.int32, device=key_block.device)
    block_local = torch.empty_like(block_owner)
    positions = torch.arange(world * nb, dtype=torch.int32, device=key_block.device)
    block_owner[key_block.long().flatten()] = positions // nb
    block_local[key_block.long().flatten()] = positions % nb
    return BlockTables(queries, key_block, prefix, first_query, block_owner, block_local)


class ListCandidates(NamedTuple):
    """The candidates of one conversion's lists in kernel form (contiguous): build with
    :func:`list_candidates`."""

    tables: BlockTables
    hit: torch.Tensor  # int8 [b·Hq, NB], hit[bh, δ] = block diagonal δ is active
    verticals: torch.Tensor  # int32 or int64 [b·Hq, V] the vertical columns, ascending per row, N the sentinel
    bar_bound: torch.Tensor  # int32 [b·Hq, nb] how many verticals lie before query block i: counting writes it
    block_size: int


def list_candidates(tables: BlockTables, hit: torch.Tensor, v_idx: torch.Tensor, block_size: int) -> ListCandidates:
    """``tables`` of :func:`block_tables`; bool ``hit [b, Hq, NB]``; ``v_idx [b, Hq, V]`` (int32 or int64) ascending
    per row, padded with N. The kernels read the verticals as they are: their blocks, owners and local columns come
    from the tables."""
    rows = hit.shape[0] * hit.shape[1]
    kernel_hit = hit.reshape(rows, hit.shape[-1]).contiguous().view(torch.int8)  # the same bytes
    verticals = v_idx.reshape(rows, v_idx.shape[-1]).contiguous()
    bar_bound = torch.empty(rows, tables.query_blocks.numel(), dtype=torch.int32, device=hit.device)
    return ListCandidates(tables, kernel_hit, verticals, bar_bound, block_size)


def _launch(c: ListCandidates, row_starts: torch.Tensor, pointers: torch.Tensor, cols: list, write: bool) -> None:
    tables = c.tables
    world, num_local_blocks = tables.source_blocks.shape
    batch_heads, num_global_blocks = c.hit.shape
    direct(_list_rows_kernel)(
        (num_local_blocks, batch_heads, world),
        tables.query_blocks,
        tables.source_blocks,
        tables.prefix,
        tables.first_query,
        c.verticals,
        tables.block_owner,
        tables.block_local,
        c.bar_bound,
        c.hit,
        row_starts,
        pointers,
        *cols,
        num_global_blocks,
        num_local_blocks,
        batch_heads,
        c.verticals.shape[1],
        WRITE=write,
        STEP=CANDIDATES_PER_STEP,
        BLOCK=c.block_size,
    )


def count_rows(c: ListCandidates, row_starts: torch.Tensor) -> None:
    """Fill ``row_starts``, contiguous int64 ``[NUM_LISTS, W·b·Hq·nb + 1]`` (lists: blocks, by key, bars; rows in
    the order (w, b·Hq, local block)), with 0 then each row's entries, so that ``row_starts.cumsum_(1)`` makes
    them the row starts (the last one the list's total)."""
    _launch(c, row_starts, row_starts, [row_starts] * NUM_LISTS, write=False)  # nothing read, no list written


def write_rows(
    c: ListCandidates, row_starts: torch.Tensor, totals: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The lists' CSR offsets, int32 ``[NUM_LISTS, W, b, Hq, nb + 1]`` (absolute, ``[..., nb]`` the next group's
    first), and their entries, int32 ``[totals[l]]`` each: row r of list l from ``row_starts[l, r]`` on
    (``row_starts`` contiguous int64 ``[NUM_LISTS, W·b·Hq·nb + 1]``, rows as :func:`count_rows`'s; every total
    below 2^31)."""
    world, nb = c.tables.source_blocks.shape
    device = c.hit.device
    pointers = torch.empty(NUM_LISTS, world, *c.bar_bound.shape[:1], nb + 1, dtype=torch.int32, device=device)
    cols = [torch.empty(total, dtype=torch.int32, device=device) for total in totals]
    _launch(c, row_starts, pointers, cols, write=True)
    return pointers, cols
