"""Triton kernels of the index conversion (DESIGN.md §2.6): the block, bar and by-key lists, equal to the
PyTorch ones.

The PyTorch conversion (``index._block_lists`` / ``index._bar_lists``) materialises a bool
``[W, b, Hq, nb, nb]`` block mask and int64 ``[b, Hq, nb, Vmax]`` bar distances, then runs ``nonzero`` and
a sort of every bar entry (about 135 M at 512K with 4K verticals on one GPU), and
``index.block_lists_by_key`` sorts every block. Here one kernel runs twice per list, one program per row
(source rank w, b, query head h, local block):

* :func:`count_rows` — how many entries each row has (the caller turns the counts into CSR offsets);
* :func:`write_rows` — the entries themselves, stored from each row's offset in candidate order.

A row's candidates are a range of an ascending list (its bound from ``torch.searchsorted``):

* **blocks** (row: query block qb) — source w's key blocks kb ≤ qb, kept when active (``hit[b, h, qb − kb]``);
  block j is stored as its two 64-wide sub-tiles 2j, 2j+1;
* **keys** (row: source w's key block kb) — this rank's query blocks qb ≥ kb, kept when active; stored as
  local query blocks i, so row j lists the i whose block list holds j, ascending;
* **bars** (row: query block qb) — the verticals with kb < qb, kept when source w owns them and their block
  is not active; stored as local columns, which every layout keeps in global order, so the lists equal the
  sorted PyTorch ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

CANDIDATES_PER_STEP = 128  # candidates one program reads per loop step


# the three lists of one conversion
_BLOCKS, _BARS, _KEYS = (tl.constexpr(i) for i in range(3))


@triton.jit
def _list_rows_kernel(
    KEY_BLOCK,
    OWNER,
    VALUE,
    BOUND,
    HIT,
    QUERY_BLOCK,
    ROW_START,
    COUNT,
    COL,
    cand_stride_bh,
    cand_stride_w,
    bound_stride_bh,
    bound_stride_w,
    num_global_blocks,
    num_local_blocks,
    batch_heads,
    LIST: tl.constexpr,
    WRITE: tl.constexpr,
    STEP: tl.constexpr,
):
    """One row (w, b·Hq, ``program_id(0)``) of one list: count its entries, or write them from ROW_START[row].
    Blocks and bars: the row is local query block i, its candidates source w's key blocks (or verticals) before
    ``BOUND``; keys: the row is source w's local key block j, its candidates this rank's query blocks from
    ``BOUND`` on. The block diagonal of a (query, key) pair is HIT's column."""
    i = tl.program_id(0)
    bh = tl.program_id(1)
    w = tl.program_id(2)
    row = (w * batch_heads + bh) * num_local_blocks + i
    candidates = bh * cand_stride_bh + w * cand_stride_w
    bound = tl.load(BOUND + bh * bound_stride_bh + w * bound_stride_w + i)
    if LIST == _KEYS:
        own_block = tl.load(KEY_BLOCK + candidates + i)
        first, last = bound, num_local_blocks
    else:
        own_block = tl.load(QUERY_BLOCK + i)
        first, last = 0, bound
    found = 0
    for start in range(first, last, STEP):
        offsets = start + tl.arange(0, STEP)
        inside = offsets < last
        if LIST == _KEYS:
            distance = tl.load(QUERY_BLOCK + offsets, mask=inside, other=0) - own_block
        else:
            distance = own_block - tl.load(KEY_BLOCK + candidates + offsets, mask=inside, other=0)
        if LIST == _BARS:
            inside = inside & (tl.load(OWNER + candidates + offsets, mask=inside, other=-1) == w)
        active = tl.load(HIT + bh * num_global_blocks + distance, mask=inside, other=0)
        if LIST == _BARS:
            take = inside & (active == 0)
        else:
            take = inside & (active != 0)
        if WRITE:
            rank_in_row = found + tl.cumsum(take.to(tl.int32), 0) - 1
            if LIST == _BARS:
                column = tl.load(VALUE + candidates + offsets, mask=take, other=0)
                tl.store(COL + tl.load(ROW_START + row) + rank_in_row, column, mask=take)
            elif LIST == _KEYS:
                tl.store(COL + tl.load(ROW_START + row) + rank_in_row, offsets, mask=take)
            else:
                position = tl.load(ROW_START + row) + 2 * rank_in_row
                tl.store(COL + position, 2 * offsets, mask=take)
                tl.store(COL + position + 1, 2 * offsets + 1, mask=take)
        found += tl.sum(take.to(tl.int32), 0)
    if not WRITE:
        if LIST == _BLOCKS:
            tl.store(COUNT + row, 2 * found)  # two sub-tiles per block
        else:
            tl.store(COUNT + row, found)


class ListCandidates(NamedTuple):
    """One list's candidates in kernel form (int32, contiguous); build with :func:`block_candidates`,
    :func:`key_candidates` or :func:`bar_candidates`."""

    kind: int  # which list: _BLOCKS, _BARS or _KEYS
    key_block: torch.Tensor  # blocks, keys: source key blocks [W, nb]; bars: verticals' key blocks [b·Hq, V]
    owner: torch.Tensor  # bars: the verticals' source ranks [b·Hq, V] (otherwise key_block, unread)
    value: torch.Tensor  # bars: the verticals' local columns [b·Hq, V] (otherwise key_block, unread)
    bound: torch.Tensor  # blocks [W, nb], bars [b·Hq, nb]: candidates before query block i; keys [W, nb]: first
    hit: torch.Tensor  # int8 [b·Hq, NB] of kernel_hits, hit[bh, δ] = block diagonal δ is active
    query_blocks: torch.Tensor  # [nb] global ids of this rank's query blocks
    world_size: int
    batch_heads: int


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


class BlockTables(NamedTuple):
    """``index.block_tables`` in kernel form (int32, contiguous): what the block lists' candidates of one
    (layout, rank, N) are, whatever the index."""

    query_blocks: torch.Tensor  # [nb] global ids of this rank's query blocks, ascending
    source_blocks: torch.Tensor  # [W, nb] global ids of every source's key blocks, ascending per source
    prefix: torch.Tensor  # [W, nb] how many of source w's key blocks are ≤ query block i
    first_query: torch.Tensor  # [W, nb] how many query blocks are < source w's key block j


def block_tables(source_blocks: torch.Tensor, query_blocks: torch.Tensor) -> BlockTables:
    """``source_blocks [W, nb]`` and ``query_blocks [nb]`` (global ids, ascending per row), any integer dtype."""
    world, nb = source_blocks.shape
    key_block, queries = _int32(source_blocks), _int32(query_blocks)
    prefix = torch.searchsorted(key_block, queries.expand(world, nb).contiguous(), right=True, out_int32=True)
    first_query = torch.searchsorted(queries, key_block, out_int32=True)
    return BlockTables(queries, key_block, prefix, first_query)


def kernel_hits(hit: torch.Tensor) -> torch.Tensor:
    """bool ``hit [b, Hq, NB]`` as the kernels read it: int8 ``[b·Hq, NB]``, the same bytes (no copy when
    ``hit`` is contiguous)."""
    return hit.reshape(-1, hit.shape[-1]).contiguous().view(torch.int8)


def _table_candidates(kind: int, tables: BlockTables, bound: torch.Tensor, hit: torch.Tensor) -> ListCandidates:
    key_block = tables.source_blocks
    world = key_block.shape[0]
    return ListCandidates(kind, key_block, key_block, key_block, bound, hit, tables.query_blocks, world, hit.shape[0])


def block_candidates(tables: BlockTables, hit: torch.Tensor) -> ListCandidates:
    """The block lists' candidates: ``tables`` of :func:`block_tables`, ``hit`` int8 ``[b·Hq, NB]`` of
    :func:`kernel_hits`."""
    return _table_candidates(_BLOCKS.value, tables, tables.prefix, hit)


def key_candidates(tables: BlockTables, hit: torch.Tensor) -> ListCandidates:
    """The block lists by key (``index.block_lists_by_key``'s, row (w, b, h, j) the local query blocks i whose
    block list holds j, ascending): ``tables`` and ``hit`` as in :func:`block_candidates`."""
    return _table_candidates(_KEYS.value, tables, tables.first_query, hit)


def bar_candidates(
    owner: torch.Tensor,
    local: torch.Tensor,
    key_block: torch.Tensor,
    query_blocks: torch.Tensor,
    hit: torch.Tensor,
    world_size: int,
) -> ListCandidates:
    """The verticals' ``owner``, ``local`` column and ``key_block``, each ``[b, Hq, V]`` (ascending per row, any
    integer dtype); ``query_blocks`` int32 ``[nb]`` (:attr:`BlockTables.query_blocks`), ``hit`` int8
    ``[b·Hq, NB]`` of :func:`kernel_hits`."""
    rows = key_block.shape[0] * key_block.shape[1]
    blocks = _int32(key_block.reshape(rows, -1))
    prefix = torch.searchsorted(blocks, query_blocks.expand(rows, -1).contiguous(), out_int32=True)
    return ListCandidates(
        _BARS.value,
        blocks,
        _int32(owner.reshape(rows, -1)),
        _int32(local.reshape(rows, -1)),
        prefix,
        hit,
        query_blocks,
        world_size,
        rows,
    )


def _launch(c: ListCandidates, row_start: torch.Tensor, counts: torch.Tensor, col: torch.Tensor, write: bool) -> None:
    num_local_blocks = c.query_blocks.numel()
    width = c.key_block.shape[1]
    bars = c.kind == _BARS.value
    cand_strides = (width, 0) if bars else (0, width)
    bound_strides = (num_local_blocks, 0) if bars else (0, num_local_blocks)
    _list_rows_kernel[(num_local_blocks, c.batch_heads, c.world_size)](
        c.key_block,
        c.owner,
        c.value,
        c.bound,
        c.hit,
        c.query_blocks,
        row_start,
        counts,
        col,
        *cand_strides,
        *bound_strides,
        c.hit.shape[1],
        num_local_blocks,
        c.batch_heads,
        LIST=c.kind,
        WRITE=write,
        STEP=CANDIDATES_PER_STEP,
    )


def count_rows(c: ListCandidates, counts: torch.Tensor) -> None:
    """Write the entries per row into ``counts``, contiguous int32 of W·b·Hq·nb elements in row order (w, b·Hq, i)."""
    _launch(c, counts, counts, counts, write=False)  # row_start and col are not read


def write_rows(c: ListCandidates, row_start: torch.Tensor, total: int) -> torch.Tensor:
    """The entries, int32 ``[total]``: row r's at ``row_start[r] …`` (rows as :func:`count_rows`'s, flattened)."""
    col = torch.empty(total, dtype=torch.int32, device=c.key_block.device)
    if total:
        _launch(c, _int32(row_start), row_start, col, write=True)
    return col
