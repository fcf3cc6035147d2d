"""Bar lists regrouped by column for the one-pass backward of the bars (``gluon_bwd``, DESIGN.md §2.6).

:func:`bar_words_by_column` turns one step's bar lists (by query block) into work for key-major programs:
each (sample, query head) row's distinct bar columns, ascending, are its *slots*; slots go in chunks of
:data:`BAR_WORD_COLUMNS`, and a 128-bit membership word per (chunk, query block) says which of the chunk's
columns are bars of that block. A program owns one part of one chunk: the query blocks from the first to the
last with a nonzero word, split into :func:`word_splits` parts of equal length. Two Triton kernels and a few
PyTorch ops on the lists' device, with no host sync (the chunk count comes from a caller's bound).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

BAR_WORD_COLUMNS = 128  # columns per chunk: two 64-bit membership words per (chunk, query block)
ENTRIES_PER_STEP = 128  # bar entries one program reads per loop step
WORD_PROGRAMS = 1024  # about eight per multiprocessor of an H100/H200: the first chunks' walks are the longest
MAX_WORD_SPLITS = 16


@dataclasses.dataclass(frozen=True, eq=False)
class BarWords:
    """One step's bars by column; rows are (sample, query head), ``[b, Hq]``, C chunks of up to 128 slots
    (every tensor contiguous, as the kernel indexes them):

    * ``column`` int32 ``[b, Hq, C·128]``: each row's distinct bar columns ascending, then 0 (padding);
    * ``count`` int32 ``[b, Hq]``: how many there are;
    * ``words`` int64 ``[b, Hq, C, nb, 2]``: bit t of word t // 64 says slot 128·c + t is a bar of the
      query block;
    * ``ranges`` int32 ``[b, Hq, C·splits, 2]``: part p of chunk c (row c·splits + p) walks query blocks
      [first, end); empty parts have first = end.
    """

    column: Tensor
    count: Tensor
    words: Tensor
    ranges: Tensor
    splits: int


def word_splits(programs: int) -> int:
    """Parts each chunk's walk is split into: the smallest power of two (up to :data:`MAX_WORD_SPLITS`) that
    gives ``programs`` chunks :data:`WORD_PROGRAMS` programs."""
    splits = 1
    while splits < MAX_WORD_SPLITS and splits * programs < WORD_PROGRAMS:
        splits *= 2
    return splits


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


def bar_words_by_column(bar_ptr: Tensor, bar_col: Tensor, key_len: int, max_columns: int | None) -> BarWords:
    """The :class:`BarWords` of one step's bar lists: ``bar_ptr`` int32 ``[b, Hq, nb+1]`` (absolute offsets
    into ``bar_col``, rows back to back), local key columns in ``[0, key_len)``; ``max_columns`` bounds one
    row's distinct bar columns (the index's vertical width): no host sync. Without it they are counted (one
    host sync)."""
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
    splits = word_splits(rows * num_chunks)
    return BarWords(
        column=column[:, :width].reshape(batch, heads, width).contiguous(),
        count=count.reshape(batch, heads).contiguous(),
        words=words.view(batch, heads, num_chunks, num_blocks, 2),
        ranges=_walk_ranges(words, splits).view(batch, heads, num_chunks * splits, 2),
        splits=splits,
    )


def _walk_ranges(words: Tensor, splits: int) -> Tensor:
    """int32 ``[rows, C·splits, 2]``: each chunk's query blocks from the first to the last nonzero word of
    ``words`` ``[rows, C, nb, 2]``, cut into ``splits`` parts of equal length."""
    num_blocks = words.shape[2]
    used = (words != 0).any(-1)  # [rows, C, nb]
    position = torch.arange(num_blocks, device=words.device)
    first = torch.where(used, position, num_blocks).amin(-1)
    end = torch.where(used, position + 1, 0).amax(-1)
    end = torch.maximum(first, end)  # an empty chunk: first = nb = end
    part = torch.arange(splits + 1, device=words.device)
    bounds = first[..., None] + (end - first)[..., None] * part // splits  # [rows, C, splits+1]
    return torch.stack([bounds[..., :-1], bounds[..., 1:]], -1).flatten(1, 2).to(torch.int32)
