"""Triton kernels of the index conversion (DESIGN.md §2.6): the block and bar lists, equal to the PyTorch ones.

The PyTorch conversion (``index._block_lists`` / ``index._bar_lists``) materialises a bool
``[W, b, Hq, nb, nb]`` block mask and int64 ``[b, Hq, nb, Vmax]`` bar distances, then runs ``nonzero`` and
a sort of every bar entry (about 135 M at 512K with 4K verticals on one GPU). Here one kernel runs twice
per list, one program per row (source rank w, b, query head h, local query block i):

* :func:`count_rows` — how many entries each row has (the caller turns the counts into CSR offsets);
* :func:`write_rows` — the entries themselves, stored from each row's offset in candidate order.

A row's candidates form a prefix of an ascending list (``prefix``, from ``torch.searchsorted``):

* **blocks** — source w's key blocks kb ≤ qb, kept when active (``hit[b, h, qb − kb]``); block j is stored
  as its two 64-wide sub-tiles 2j, 2j+1;
* **bars** — the verticals with kb < qb, kept when source w owns them and their block is not active; stored
  as local columns, which every layout keeps in global order, so the lists equal the sorted PyTorch ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

CANDIDATES_PER_STEP = 128  # candidates one program reads per loop step


@triton.jit
def _list_rows_kernel(
    KEY_BLOCK,
    OWNER,
    VALUE,
    PREFIX,
    HIT,
    QUERY_BLOCK,
    ROW_START,
    COUNT,
    COL,
    cand_stride_bh,
    cand_stride_w,
    prefix_stride_bh,
    prefix_stride_w,
    num_global_blocks,
    num_local_blocks,
    batch_heads,
    BARS: tl.constexpr,
    WRITE: tl.constexpr,
    STEP: tl.constexpr,
):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    w = tl.program_id(2)
    row = (w * batch_heads + bh) * num_local_blocks + i
    query_block = tl.load(QUERY_BLOCK + i)
    candidates = bh * cand_stride_bh + w * cand_stride_w
    prefix = tl.load(PREFIX + bh * prefix_stride_bh + w * prefix_stride_w + i)
    found = 0
    for start in range(0, prefix, STEP):
        offsets = start + tl.arange(0, STEP)
        inside = offsets < prefix
        key_block = tl.load(KEY_BLOCK + candidates + offsets, mask=inside, other=0)
        if BARS:
            inside = inside & (tl.load(OWNER + candidates + offsets, mask=inside, other=-1) == w)
        active = tl.load(HIT + bh * num_global_blocks + (query_block - key_block), mask=inside, other=0)
        if BARS:
            take = inside & (active == 0)
        else:
            take = inside & (active != 0)
        if WRITE:
            rank_in_row = found + tl.cumsum(take.to(tl.int32), 0) - 1
            if BARS:
                column = tl.load(VALUE + candidates + offsets, mask=take, other=0)
                tl.store(COL + tl.load(ROW_START + row) + rank_in_row, column, mask=take)
            else:
                position = tl.load(ROW_START + row) + 2 * rank_in_row
                tl.store(COL + position, 2 * offsets, mask=take)
                tl.store(COL + position + 1, 2 * offsets + 1, mask=take)
        found += tl.sum(take.to(tl.int32), 0)
    if not WRITE:
        if BARS:
            tl.store(COUNT + row, found)
        else:
            tl.store(COUNT + row, 2 * found)  # two sub-tiles per block


class ListCandidates(NamedTuple):
    """One list's candidates in kernel form (int32, contiguous); build with :func:`block_candidates` or
    :func:`bar_candidates`."""

    bars: bool
    key_block: torch.Tensor  # blocks: source key blocks [W, nb]; bars: verticals' key blocks [b·Hq, V]
    owner: torch.Tensor  # bars: the verticals' source ranks [b·Hq, V] (blocks: key_block, unread)
    value: torch.Tensor  # bars: the verticals' local columns [b·Hq, V] (blocks: key_block, unread)
    prefix: torch.Tensor  # candidates before each local query block: blocks [W, nb], bars [b·Hq, nb]
    hit: torch.Tensor  # int8 [b·Hq, NB] of kernel_hits, hit[bh, δ] = block diagonal δ is active
    query_blocks: torch.Tensor  # [nb] global ids of this rank's query blocks
    world_size: int
    batch_heads: int


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


class BlockTables(NamedTuple):
    """``index.block_tables`` in kernel form (int32, contiguous): what the block lists' candidates of one
    (layout, rank, N) are, whatever the index."""

    query_blocks: torch.Tensor  # [nb] global ids of this rank's query blocks
    source_blocks: torch.Tensor  # [W, nb] global ids of every source's key blocks, ascending per source
    prefix: torch.Tensor  # [W, nb] how many of source w's key blocks are ≤ query block i


def block_tables(source_blocks: torch.Tensor, query_blocks: torch.Tensor) -> BlockTables:
    """``source_blocks [W, nb]`` (global ids, ascending per source) and ``query_blocks [nb]``, any integer dtype."""
    world, nb = source_blocks.shape
    key_block, queries = _int32(source_blocks), _int32(query_blocks)
    prefix = torch.searchsorted(key_block, queries.expand(world, nb).contiguous(), right=True, out_int32=True)
    return BlockTables(queries, key_block, prefix)


def kernel_hits(hit: torch.Tensor) -> torch.Tensor:
    """bool ``hit [b, Hq, NB]`` as the kernels read it: int8 ``[b·Hq, NB]``, the same bytes (no copy when
    ``hit`` is contiguous)."""
    return hit.reshape(-1, hit.shape[-1]).contiguous().view(torch.int8)


def block_candidates(tables: BlockTables, hit: torch.Tensor) -> ListCandidates:
    """The block lists' candidates: ``tables`` of :func:`block_tables`, ``hit`` int8 ``[b·Hq, NB]`` of
    :func:`kernel_hits`."""
    key_block = tables.source_blocks
    world = key_block.shape[0]
    return ListCandidates(
        False, key_block, key_block, key_block, tables.prefix, hit, tables.query_blocks, world, hit.shape[0]
    )


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
        True,
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
    cand_strides = (width, 0) if c.bars else (0, width)
    prefix_strides = (num_local_blocks, 0) if c.bars else (0, num_local_blocks)
    _list_rows_kernel[(num_local_blocks, c.batch_heads, c.world_size)](
        c.key_block,
        c.owner,
        c.value,
        c.prefix,
        c.hit,
        c.query_blocks,
        row_start,
        counts,
        col,
        *cand_strides,
        *prefix_strides,
        c.hit.shape[1],
        num_local_blocks,
        c.batch_heads,
        BARS=c.bars,
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
