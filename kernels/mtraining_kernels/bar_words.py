"""Bar lists regrouped by column for the one-pass backward of the bars (``gluon_bwd``, DESIGN.md §2.6).

:func:`bar_words_by_column` turns one step's bar lists (by query block) into work for key-major programs:
each (sample, query head) row's distinct bar columns, ascending, are its *slots*; slots go in chunks of
:data:`BAR_WORD_COLUMNS`, and a 128-bit membership word per (chunk, query block) says which of the chunk's
columns are bars of that block. A chunk's walk runs from the first to the last query block with a nonzero
word (its *bounds*); the backward cuts it along segments of ``walk`` query blocks, one program per (row,
segment, chunk), so that every program has about the same work whatever the chunk (a chunk holding the sinks
walks the whole sequence, a late one a few blocks), and the programs of a row's chunks that share a segment run
side by side and read the same query blocks' q, dO and dq from L2. Three Triton launches and two zeroed
allocations on the lists' device, with no host sync (the regrouping runs on every backward step, so its host
time counts at short lengths): the sizes follow from the shapes and a caller's bound of the chunks.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from .direct_launch import direct

BAR_WORD_COLUMNS = 128  # columns per chunk: two 64-bit membership words per (chunk, query block)
ENTRIES_PER_STEP = 128  # bar entries one program reads per loop step
COLUMNS_PER_SCAN = 2048  # key columns one scan step numbers
MIN_WALK, MAX_WALK = 16, 128  # query blocks per segment
PROGRAMS_PER_MULTIPROCESSOR = 64  # the bars' programs at most this many per multiprocessor, where MAX_WALK allows


@dataclasses.dataclass(frozen=True, eq=False)
class BarWords:
    """One step's bars by column; rows are (sample, query head), z·Hq + h, C chunks of up to 128 slots
    (every tensor contiguous, as the kernel indexes them):

    * ``column`` int32 ``[b·Hq, C·128]``: each row's distinct bar columns ascending, then 0 (padding);
    * ``count`` int32 ``[b·Hq]``: how many there are;
    * ``words`` int64 ``[b·Hq, C, nb, 2]``: bit t of word t // 64 says slot 128·c + t is a bar of the
      query block;
    * ``bounds`` int32 ``[b·Hq, C, 2]``: (nb − first, end) of each chunk's walk, its first and past-the-last
      query block with a nonzero word; (0, 0) for a chunk without bars;
    * ``walk``: query blocks per segment.
    """

    column: Tensor
    count: Tensor
    words: Tensor
    bounds: Tensor
    walk: int


def walk_length(chunk_rows: int, num_blocks: int, multiprocessors: int) -> int:
    """Query blocks per segment: the smallest power of two from :data:`MIN_WALK` to :data:`MAX_WALK` whose
    programs (``chunk_rows`` chunks, each cut into ⌈nb / walk⌉ segments) are at most
    :data:`PROGRAMS_PER_MULTIPROCESSOR` per multiprocessor: shorter walks balance the programs better, longer
    ones add each chunk's dk/dv rows fewer times."""
    walk = MIN_WALK
    while walk < MAX_WALK and chunk_rows * -(-num_blocks // walk) > PROGRAMS_PER_MULTIPROCESSOR * multiprocessors:
        walk *= 2
    return walk


@triton.jit
def _program_entries(BAR_PTR):
    """(query block i, row, nb, first entry, end entry) of program (i, row) over the bar lists."""
    i = tl.program_id(0)
    row = tl.program_id(1)
    num_blocks = tl.num_programs(0)
    start = tl.load(BAR_PTR + row * (num_blocks + 1) + i)
    end = tl.load(BAR_PTR + row * (num_blocks + 1) + i + 1)
    return i, row, num_blocks, start, end


@triton.jit
def _mark_columns_kernel(BAR_PTR, BAR_COL, SLOTS, key_len, STEP: tl.constexpr):
    """Program (i, row): SLOTS[row, c] = 1 for every bar column c of query block i of row."""
    i, row, num_blocks, start, end = _program_entries(BAR_PTR)
    offs = tl.arange(0, STEP)
    for entry in range(start, end, STEP):
        listed = entry + offs < end
        cols = tl.load(BAR_COL + entry + offs, mask=listed, other=0)
        tl.store(SLOTS + row.to(tl.int64) * key_len + cols, tl.full([STEP], 1, tl.int32), mask=listed)


@triton.jit
def _slots_kernel(SLOTS, COUNT, COLUMN, key_len, width, SCAN: tl.constexpr):
    """Program row: numbers the marked columns of SLOTS[row] in one ascending scan, leaving slot + 1 at each
    marked column (a running count), the column at COLUMN[row, slot] (slots below ``width``) and the count
    at COUNT[row]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SCAN)
    counted = tl.full([], 0, tl.int32)
    for start in range(0, key_len, SCAN):
        inside = start + offs < key_len
        marked = tl.load(SLOTS + row * key_len + start + offs, mask=inside, other=0)
        slot_end = tl.cumsum(marked, 0) + counted
        tl.store(SLOTS + row * key_len + start + offs, slot_end, mask=inside)
        placed = (marked != 0) & (slot_end <= width)
        tl.store(COLUMN + row * width + slot_end - 1, start + offs, mask=placed)
        counted += tl.sum(marked, 0)
    tl.store(COUNT + row, counted)


@triton.jit
def _words_kernel(
    BAR_PTR,
    BAR_COL,
    SLOTS,
    WORDS,
    BOUNDS,
    key_len,
    num_chunks,
    STEP: tl.constexpr,
    COLUMNS: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Program (i, row): sets, for every bar column c of query block i of row, the bit of slot SLOTS[row, c] − 1
    in the words of (row, its chunk, i), and raises the walk bounds of each chunk it sets a bit in:
    BOUNDS[row·C + chunk] = (nb − first block, end block), both atomic maxima over the programs. A row's slots
    are distinct, so each bit is set once and an add is an OR."""
    i, row, num_blocks, start, end = _program_entries(BAR_PTR)
    offs = tl.arange(0, STEP)
    hits = tl.zeros([CHUNKS], dtype=tl.int32)
    for entry in range(start, end, STEP):
        listed = entry + offs < end
        cols = tl.load(BAR_COL + entry + offs, mask=listed, other=0)
        slot = tl.load(SLOTS + row.to(tl.int64) * key_len + cols, mask=listed, other=1) - 1
        chunk = slot // COLUMNS
        bit = (slot % COLUMNS).to(tl.int64)
        word = ((row.to(tl.int64) * num_chunks + chunk) * num_blocks + i) * 2 + bit // 64
        in_bound = listed & (chunk < num_chunks)  # past the caller's bound: no write out of WORDS
        tl.atomic_add(WORDS + word, tl.full([STEP], 1, tl.int64) << (bit % 64), mask=in_bound, sem="relaxed")
        hits += tl.histogram(chunk, CHUNKS, mask=in_bound)
    chunks = tl.arange(0, CHUNKS)
    bound = (row * num_chunks + chunks) * 2
    touched = hits > 0
    tl.atomic_max(BOUNDS + bound, tl.full([CHUNKS], 0, tl.int32) + num_blocks - i, mask=touched, sem="relaxed")
    tl.atomic_max(BOUNDS + bound + 1, tl.full([CHUNKS], 0, tl.int32) + i + 1, mask=touched, sem="relaxed")


def bar_words_by_column(
    bar_ptr: Tensor, bar_col: Tensor, key_len: int, max_columns: int | None, multiprocessors: int
) -> BarWords:
    """The :class:`BarWords` of one step's bar lists: ``bar_ptr`` int32 ``[b, Hq, nb+1]`` (absolute offsets
    into ``bar_col``, rows back to back), local key columns in ``[0, key_len)``; ``max_columns`` bounds one
    row's distinct bar columns (the index's vertical width): no host sync. Without it they are counted (one
    host sync). ``multiprocessors``: the device's, which sizes the segments (:func:`walk_length`)."""
    batch, heads, num_blocks = bar_ptr.shape[0], bar_ptr.shape[1], bar_ptr.shape[2] - 1
    rows = batch * heads
    device = bar_ptr.device
    bar_ptr = bar_ptr.contiguous()
    grid = (num_blocks, rows)
    if max_columns is None:
        marked = torch.zeros(rows, key_len, dtype=torch.int32, device=device)
        direct(_mark_columns_kernel)(grid, bar_ptr, bar_col, marked, key_len, STEP=ENTRIES_PER_STEP)
        max_columns = int(marked.sum(1).max())
    num_chunks = max(1, -(-min(max_columns, key_len) // BAR_WORD_COLUMNS))
    width = num_chunks * BAR_WORD_COLUMNS
    chunk_rows = rows * num_chunks
    sizes = (rows * key_len, rows, rows * width, chunk_rows * 2)
    slots, count, column, bounds = torch.zeros(sum(sizes), dtype=torch.int32, device=device).split(sizes)
    words = torch.zeros(rows, num_chunks, num_blocks, 2, dtype=torch.int64, device=device)
    direct(_mark_columns_kernel)(grid, bar_ptr, bar_col, slots, key_len, STEP=ENTRIES_PER_STEP)
    direct(_slots_kernel)((rows,), slots, count, column, key_len, width, SCAN=COLUMNS_PER_SCAN, num_warps=8)
    direct(_words_kernel)(
        grid,
        bar_ptr,
        bar_col,
        slots,
        words,
        bounds,
        key_len,
        num_chunks,
        STEP=ENTRIES_PER_STEP,
        COLUMNS=BAR_WORD_COLUMNS,
        CHUNKS=triton.next_power_of_2(num_chunks),
    )
    return BarWords(
        column=column.view(rows, width),
        count=count,
        words=words,
        bounds=bounds.view(rows, num_chunks, 2),
        walk=walk_length(chunk_rows, num_blocks, multiprocessors),
    )
