"""Bar lists regrouped by column for the one-pass backward of the bars (``gluon_bwd``, DESIGN.md §2.6).

:func:`bar_words_by_column` turns one step's bar lists (by query block) into work for key-major programs:
each (sample, query head) row's distinct bar columns, ascending, are its *slots*; slots go in chunks of
:data:`BAR_WORD_COLUMNS`, and a 128-bit membership word per (chunk, query block) says which of the chunk's
columns are bars of that block. A chunk's walk runs from the first to the last query block with a nonzero
word; it is cut into *items* of at most ``walk`` query blocks, one program each, so that every program has
about the same work whatever the chunk (a chunk holding the sinks walks the whole sequence, a late one a few
blocks). Two Triton kernels and a few PyTorch ops on the lists' device, with no host sync: the item table
has a length fixed by the shapes and a caller's bound of the chunks, its unused tail empty items.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

BAR_WORD_COLUMNS = 128  # columns per chunk: two 64-bit membership words per (chunk, query block)
ENTRIES_PER_STEP = 128  # bar entries one program reads per loop step
MIN_WALK, MAX_WALK = 16, 128  # query blocks per item
ITEMS_PER_MULTIPROCESSOR = 64  # the item table's length at most this many per multiprocessor, where MAX_WALK allows


@dataclasses.dataclass(frozen=True, eq=False)
class BarWords:
    """One step's bars by column; rows are (sample, query head), z·Hq + h, C chunks of up to 128 slots
    (every tensor contiguous, as the kernel indexes them):

    * ``column`` int32 ``[b·Hq, C·128]``: each row's distinct bar columns ascending, then 0 (padding);
    * ``count`` int32 ``[b·Hq]``: how many there are;
    * ``words`` int64 ``[b·Hq, C, nb, 2]``: bit t of word t // 64 says slot 128·c + t is a bar of the
      query block;
    * ``items`` int32 ``[I, 4]``: (row, chunk, first, end), a program's walk over query blocks [first, end)
      of one chunk, at most ``walk`` long; the real items first, by row, chunk and walk, then empty ones
      (first = end).
    """

    column: Tensor
    count: Tensor
    words: Tensor
    items: Tensor
    walk: int


def walk_length(chunk_rows: int, num_blocks: int, multiprocessors: int) -> int:
    """Query blocks per item: the smallest power of two from :data:`MIN_WALK` to :data:`MAX_WALK` whose item
    table (``chunk_rows`` chunks, each cut into ⌈nb / walk⌉ items) holds at most
    :data:`ITEMS_PER_MULTIPROCESSOR` items per multiprocessor: shorter walks balance the programs better,
    longer ones add each chunk's dk/dv rows fewer times."""
    walk = MIN_WALK
    while walk < MAX_WALK and chunk_rows * -(-num_blocks // walk) > ITEMS_PER_MULTIPROCESSOR * multiprocessors:
        walk *= 2
    return walk


@triton.jit
def _mark_columns_kernel(BAR_PTR, BAR_COL, PRESENT, key_len, STEP: tl.constexpr):
    """Program (i, row): PRESENT[row, c] = 1 for every bar column c of query block i of row."""
    i = tl.program_id(0)
    row = tl.program_id(1)
    num_blocks = tl.num_programs(0)
    start = tl.load(BAR_PTR + row * (num_blocks + 1) + i)
    end = tl.load(BAR_PTR + row * (num_blocks + 1) + i + 1)
    offs = tl.arange(0, STEP)
    for entry in range(start, end, STEP):
        listed = entry + offs < end
        cols = tl.load(BAR_COL + entry + offs, mask=listed, other=0)
        tl.store(PRESENT + row.to(tl.int64) * key_len + cols, tl.full([STEP], 1, tl.int8), mask=listed)


@triton.jit
def _words_kernel(BAR_PTR, BAR_COL, SLOT_END, WORDS, key_len, num_chunks, STEP: tl.constexpr, COLUMNS: tl.constexpr):
    """Program (i, row): sets, for every bar column c of query block i of row, the bit of slot
    SLOT_END[row, c] − 1 in the words of (row, its chunk, i). A row's slots are distinct, so each bit is set
    once and an add is an OR."""
    i = tl.program_id(0)
    row = tl.program_id(1)
    num_blocks = tl.num_programs(0)
    start = tl.load(BAR_PTR + row * (num_blocks + 1) + i)
    end = tl.load(BAR_PTR + row * (num_blocks + 1) + i + 1)
    offs = tl.arange(0, STEP)
    for entry in range(start, end, STEP):
        listed = entry + offs < end
        cols = tl.load(BAR_COL + entry + offs, mask=listed, other=0)
        slot = tl.load(SLOT_END + row.to(tl.int64) * key_len + cols, mask=listed, other=1) - 1
        chunk = slot // COLUMNS
        bit = (slot % COLUMNS).to(tl.int64)
        word = ((row.to(tl.int64) * num_chunks + chunk) * num_blocks + i) * 2 + bit // 64
        in_bound = listed & (chunk < num_chunks)  # past the caller's bound: no write out of WORDS
        tl.atomic_add(WORDS + word, tl.full([STEP], 1, tl.int64) << (bit % 64), mask=in_bound, sem="relaxed")


def bar_words_by_column(
    bar_ptr: Tensor, bar_col: Tensor, key_len: int, max_columns: int | None, multiprocessors: int
) -> BarWords:
    """The :class:`BarWords` of one step's bar lists: ``bar_ptr`` int32 ``[b, Hq, nb+1]`` (absolute offsets
    into ``bar_col``, rows back to back), local key columns in ``[0, key_len)``; ``max_columns`` bounds one
    row's distinct bar columns (the index's vertical width): no host sync. Without it they are counted (one
    host sync). ``multiprocessors``: the device's, which sizes the items (:func:`walk_length`)."""
    batch, heads, num_blocks = bar_ptr.shape[0], bar_ptr.shape[1], bar_ptr.shape[2] - 1
    rows = batch * heads
    device = bar_ptr.device
    bar_ptr = bar_ptr.contiguous()
    grid = (num_blocks, rows)
    present = torch.zeros(rows, key_len, dtype=torch.int8, device=device)
    _mark_columns_kernel[grid](bar_ptr, bar_col, present, key_len, STEP=ENTRIES_PER_STEP)
    slot_end = torch.cumsum(present, 1, dtype=torch.int32)  # slot + 1 of every present column
    count = slot_end[:, -1]
    if max_columns is None:
        max_columns = int(count.max())
    num_chunks = max(1, -(-min(max_columns, key_len) // BAR_WORD_COLUMNS))
    width = num_chunks * BAR_WORD_COLUMNS
    column = torch.zeros(rows, width + 1, dtype=torch.int32, device=device)
    target = torch.where(present.bool(), (slot_end - 1).clamp(max=width), width).long()
    column.scatter_(1, target, torch.arange(key_len, dtype=torch.int32, device=device).expand(rows, key_len))
    words = torch.zeros(rows, num_chunks, num_blocks, 2, dtype=torch.int64, device=device)
    _words_kernel[grid](
        bar_ptr, bar_col, slot_end, words, key_len, num_chunks, STEP=ENTRIES_PER_STEP, COLUMNS=BAR_WORD_COLUMNS
    )
    walk = walk_length(rows * num_chunks, num_blocks, multiprocessors)
    return BarWords(
        column=column[:, :width].contiguous(),
        count=count.contiguous(),
        words=words,
        items=_walk_items(words, walk),
        walk=walk,
    )


def _walk_items(words: Tensor, walk: int) -> Tensor:
    """int32 ``[rows·C·⌈nb / walk⌉, 4]``: each chunk's query blocks from the first to the last nonzero word of
    ``words`` ``[rows, C, nb, 2]``, cut into items (row, chunk, first, end) of at most ``walk`` blocks, the
    real ones first (by row, chunk, walk), then empty ones (0, 0, 0, 0)."""
    rows, num_chunks, num_blocks = words.shape[:3]
    device = words.device
    used = (words != 0).any(-1).view(rows * num_chunks, num_blocks)
    position = torch.arange(num_blocks, device=device)
    first = torch.where(used, position, num_blocks).amin(-1)
    end = torch.maximum(first, torch.where(used, position + 1, 0).amax(-1))  # an empty chunk: first = nb = end
    parts = (end - first + walk - 1) // walk
    items_through = torch.cumsum(parts, 0)  # items of the chunks up to each one
    item = torch.arange(rows * num_chunks * -(-num_blocks // walk), device=device)
    chunk = torch.searchsorted(items_through, item, right=True)  # rows·C past the real items
    real = chunk < rows * num_chunks
    chunk = chunk.clamp(max=rows * num_chunks - 1)
    item_first = first[chunk] + (item - items_through[chunk] + parts[chunk]) * walk
    item_end = torch.minimum(item_first + walk, end[chunk])
    table = torch.stack([chunk // num_chunks, chunk % num_chunks, item_first, item_end], 1)
    return torch.where(real[:, None], table, 0).to(torch.int32).contiguous()
