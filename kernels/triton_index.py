"""Triton kernels of the index conversion's bar lists (DESIGN.md §2.6), equal to the PyTorch conversion's.

The PyTorch path (``index._bar_lists``) materialises int64 ``[b, Hq, nb, Vmax]`` temporaries and sorts
every bar entry (about 135 M at 512K with 4K verticals on one GPU). Here one kernel runs twice over the
verticals, one program per row (source rank w, b, query head h, local query block i):

* :func:`count_bars` — how many bars each row has (the caller turns the counts into CSR offsets);
* :func:`write_bars` — the bars themselves, stored from each row's offset in vertical order.

A row's candidates are the verticals whose key block is before the row's query block, a prefix of the
ascending list (``prefix [b·Hq, nb]``, from ``torch.searchsorted``); a candidate is a bar of the row when
source w owns it and its block is not active (``hit[b, h, qb − kb] == 0``). Vertical order is ascending
local column, because every layout keeps a rank's positions in global order, so the lists equal the
PyTorch path's sorted ones element for element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

VERTICALS_PER_STEP = 128   # candidates one program reads per loop step


@triton.jit
def _bar_rows_kernel(key_block_ptr, owner_ptr, local_ptr, prefix_ptr, hit_ptr, query_block_ptr, row_start_ptr,
                     count_ptr, col_ptr, width, num_global_blocks, num_local_blocks, batch_heads,
                     WRITE: tl.constexpr, STEP: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    w = tl.program_id(2)
    row = (w * batch_heads + bh) * num_local_blocks + i
    query_block = tl.load(query_block_ptr + i)
    prefix = tl.load(prefix_ptr + bh * num_local_blocks + i)
    found = 0
    for start in range(0, prefix, STEP):
        offsets = start + tl.arange(0, STEP)
        inside = offsets < prefix
        key_block = tl.load(key_block_ptr + bh * width + offsets, mask=inside, other=0)
        owner = tl.load(owner_ptr + bh * width + offsets, mask=inside, other=-1)
        mine = inside & (owner == w)
        active = tl.load(hit_ptr + bh * num_global_blocks + (query_block - key_block), mask=mine, other=1)
        take = mine & (active == 0)
        if WRITE:
            position = tl.load(row_start_ptr + row) + found + tl.cumsum(take.to(tl.int32), 0) - 1
            column = tl.load(local_ptr + bh * width + offsets, mask=take, other=0)
            tl.store(col_ptr + position, column, mask=take)
        found += tl.sum(take.to(tl.int32), 0)
    if not WRITE:
        tl.store(count_ptr + row, found)


class BarCandidates:
    """The verticals of ``v_idx`` ``[b, Hq, V]`` in kernel form: int32 ``[b·Hq, V]`` key block, owner rank and
    local column, and ``prefix [b·Hq, nb]``, the number of verticals before each local query block."""

    def __init__(self, v_idx: torch.Tensor, owner: torch.Tensor, local: torch.Tensor, key_block: torch.Tensor,
                 query_blocks: torch.Tensor, hit: torch.Tensor, world_size: int):
        batch, heads, width = v_idx.shape
        self.batch_heads, self.width, self.world_size = batch * heads, width, world_size
        self.key_block = key_block.reshape(batch * heads, width).to(torch.int32).contiguous()
        self.owner = owner.reshape(batch * heads, width).to(torch.int32).contiguous()
        self.local = local.reshape(batch * heads, width).to(torch.int32).contiguous()
        self.query_blocks = query_blocks.to(torch.int32).contiguous()
        targets = self.query_blocks.expand(batch * heads, -1).contiguous()
        self.prefix = torch.searchsorted(self.key_block, targets).to(torch.int32).contiguous()
        self.hit = hit.reshape(batch * heads, -1).to(torch.int8).contiguous()

    def _launch(self, row_start: torch.Tensor, counts: torch.Tensor, col: torch.Tensor, write: bool) -> None:
        num_local_blocks = self.query_blocks.numel()
        grid = (num_local_blocks, self.batch_heads, self.world_size)
        _bar_rows_kernel[grid](self.key_block, self.owner, self.local, self.prefix, self.hit, self.query_blocks,
                               row_start, counts, col, self.width, self.hit.shape[1], num_local_blocks,
                               self.batch_heads, WRITE=write, STEP=VERTICALS_PER_STEP)


def count_bars(candidates: BarCandidates) -> torch.Tensor:
    """Bars per row, int32 ``[W, b·Hq, nb]``."""
    shape = (candidates.world_size, candidates.batch_heads, candidates.query_blocks.numel())
    counts = torch.empty(shape, dtype=torch.int32, device=candidates.key_block.device)
    candidates._launch(counts, counts, counts, write=False)      # row_start and col are not read
    return counts


def write_bars(candidates: BarCandidates, row_start: torch.Tensor, total: int) -> torch.Tensor:
    """The bar columns, int32 ``[total]``: row r's bars at ``row_start[r] …`` (``row_start`` int32, rows as
    :func:`count_bars`'s, flattened)."""
    col = torch.empty(total, dtype=torch.int32, device=candidates.key_block.device)
    if total:
        candidates._launch(row_start.to(torch.int32).contiguous(), row_start, col, write=True)
    return col
