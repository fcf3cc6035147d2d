"""Triton kernel of the estimation's selection (DESIGN.md §2.2): each row's best entries by radix select, no sort.

``estimation.rank_candidates`` is defined as a stable sort of a (sample, head) row's N int64 keys, of which the first
few thousand are kept. :func:`top_positions` finds the same set without sorting (the estimation's path on CUDA).
Each row is split into ``CHUNKS`` chunks, one program each, and four launches (stages of one kernel) narrow an
interval of keys that holds the row's last chosen key (the threshold):

1. a histogram per chunk of every key's magnitude class (sign, then |key| in half octaves: a monotone map, so one
   pass places the threshold whatever the keys' range);
2. twice, every program first sums the chunks' histograms of the levels so far (each the same way, so all agree on
   the interval), then histograms the next 8 bits of its chunk's keys inside it, or, once few keys are left in it
   (n / 16, or n / 4 at the last level), copies those to a scratch row in position order;
3. every program finishes the narrowing on the scratch row (or on the row, if it never got that small) and writes
   its chunk's chosen positions: the keys above the threshold, and the first ones equal to it, in position order.

The order ranked is (key descending, position ascending), a strict total order, so the set is exactly the sort's
first ``count``. Random scores need about three reads of the row, spread over all its chunks, and a few of the
copied keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .direct_launch import direct

RADIX_BITS = 8  # key bits resolved per level: histograms of 2^8 bins
CHUNKS = 8  # programs per row
LEVELS = 3  # histogram levels over whole rows: the magnitude class, then two 8-bit digits
ENTRIES_PER_STEP = 2048  # entries one program reads per loop step (8 per thread)
NUM_WARPS = 8
TIED_FRACTION = 4  # the scratch row holds n / 4 keys (the levels before the last copy at most n / 16)


@triton.jit
def _load_keys(SOURCE, positions, inside, num_forced):
    """int64 keys at ``positions`` of SOURCE, the largest key at positions below ``num_forced`` (forced entries)."""
    keys = tl.load(SOURCE + positions, mask=inside, other=0)
    return tl.where(positions < num_forced, 2**63 - 1, keys)


@triton.jit
def _floor_log2(x):
    """⌊log2 x⌋ of int64 x ≥ 1 (0 for x = 0), any shape."""
    log2 = x * 0
    rest = x
    for step in tl.static_range(6):
        high = rest >> (32 >> step)
        wide = high != 0
        log2 += tl.where(wide, 32 >> step, 0)
        rest = tl.where(wide, high, rest)
    return log2


@triton.jit
def _magnitude_class(keys):
    """int32 class in [1, 254] of int64 keys, nondecreasing in the key: its sign, then ⌊log2 m⌋ and the bit below
    the highest of m = |key| (m = −key − 1 for negative keys)."""
    negative = keys < 0
    magnitude = tl.where(negative, ~keys, keys)
    log2 = _floor_log2(magnitude)
    half = tl.where(log2 >= 1, (magnitude >> tl.maximum(log2 - 1, 0)) & 1, 0)
    rank = tl.where(magnitude == 0, 0, 1 + 2 * log2 + half).to(tl.int32)  # in [0, 126]
    return tl.where(negative, 127 - rank, 128 + rank)


@triton.jit
def _class_bounds(chosen):
    """(lowest, highest) int64 key of the magnitude class ``chosen`` (a scalar that some key has)."""
    negative = chosen < 128
    rank = tl.where(negative, 127 - chosen, chosen - 128).to(tl.int64)
    log2 = tl.maximum(rank - 1, 0) >> 1
    half = tl.maximum(rank - 1, 0) & 1
    step = tl.full([], 1, tl.int64) << tl.maximum(log2 - 1, 0)
    lowest = tl.where(rank == 0, 0, (tl.full([], 1, tl.int64) << log2) + half * step)
    highest = tl.where(rank == 0, 0, lowest + step - 1)
    return tl.where(negative, ~highest, lowest), tl.where(negative, ~lowest, highest)


@triton.jit
def _digit_shift(low, high):
    """Shift that leaves at most 8 bits of (key − low) for keys in [low, high]."""
    width = high - low
    bits = tl.where(width == 0, 0, _floor_log2(width) + 1)
    return tl.maximum(bits - 8, 0)


@triton.jit
def _digit_bounds(low, high, shift, digit):
    """The keys of [low, high] whose (key − low) >> shift is ``digit``, as (low, high)."""
    low = low + (digit.to(tl.int64) << shift)
    return low, low + tl.minimum(high - low, (tl.full([], 1, tl.int64) << shift) - 1)


@triton.jit
def _choose_bin(histogram, remaining, bins):
    """The bin holding the ``remaining``-th largest of the histogram's entries (remaining ≥ 1): (bin, its entries,
    entries still to take in it)."""
    tied = tl.sum(histogram, axis=0)
    at_least = tied - tl.cumsum(histogram, 0) + histogram  # entries whose bin is ≥ this one
    chosen = tl.max(tl.where(at_least >= remaining, bins, -1), axis=0)
    in_chosen = tl.sum(tl.where(bins == chosen, histogram, 0), axis=0)
    above = tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_chosen
    return chosen, in_chosen, remaining - above


@triton.jit
def _choose_bin_of_chunks(PARTIALS, remaining, CHUNKS: tl.constexpr, BINS: tl.constexpr):
    """:func:`_choose_bin` of the chunks' histograms PARTIALS ``[CHUNKS, BINS]`` summed, and per chunk its entries
    above the bin and in it (``[CHUNKS]`` each)."""
    bins = tl.arange(0, BINS)
    partials = tl.load(PARTIALS + tl.arange(0, CHUNKS)[:, None] * BINS + bins[None, :])
    chosen, in_chosen, remaining = _choose_bin(tl.sum(partials, axis=0), remaining, bins)
    chunk_above = tl.sum(tl.where(bins[None, :] > chosen, partials, 0), axis=1)
    chunk_inside = tl.sum(tl.where(bins[None, :] == chosen, partials, 0), axis=1)
    return chosen, in_chosen, remaining, chunk_above, chunk_inside


@triton.jit
def _copies(tied, scratch_len, level: tl.constexpr, LEVELS: tl.constexpr):
    """Whether the launch of ``level`` may copy the ``tied`` keys to the scratch row: at most a quarter of it (n / 16)
    before the last level, where one more level would shrink them, and all of it (n / 4) at the last, where the
    alternative is narrowing on the whole row."""
    limit = scratch_len
    if level < LEVELS - 1:
        limit = scratch_len // 4
    return tied <= limit


@triton.jit
def _narrowed(
    PARTIALS_ROW,
    count,
    scratch_len,
    LEVELS_READ: tl.constexpr,
    LEVELS: tl.constexpr,
    CHUNKS: tl.constexpr,
    BINS: tl.constexpr,
):
    """The interval [low, high] of keys holding the threshold after the histogram levels below ``LEVELS_READ``
    (count ≥ 1): (low, high, entries still to take in it, entries in it, per chunk the entries above it and in it,
    the level whose launch copied the interval's keys to the scratch row or ``LEVELS`` if none did). Every program
    of the row computes the same, so the launches agree on what each level histogrammed."""
    chosen, tied, remaining, above, inside = _choose_bin_of_chunks(PARTIALS_ROW, count, CHUNKS, BINS)
    low, high = _class_bounds(chosen)
    copied_at = tl.full([], LEVELS, tl.int32)
    for level in tl.static_range(1, LEVELS_READ):
        few = _copies(tied, scratch_len, level, LEVELS)
        copied_at = tl.where(few & (copied_at == LEVELS), level, copied_at)
        if (few == 0) & (remaining != tied) & (low != high):
            shift = _digit_shift(low, high)
            digit, tied, remaining, level_above, inside = _choose_bin_of_chunks(
                PARTIALS_ROW + level * CHUNKS * BINS, remaining, CHUNKS, BINS
            )
            above += level_above
            low, high = _digit_bounds(low, high, shift, digit)
    return low, high, remaining, tied, above, inside, copied_at


@triton.jit
def _digit_histogram(SOURCE, begin, end, num_forced, low, high, shift, STEP: tl.constexpr, BINS: tl.constexpr):
    """Histogram ``[BINS]`` of (key − low) >> shift over the keys of SOURCE[begin : end] inside [low, high]."""
    steps = tl.arange(0, STEP)
    histogram = tl.zeros([BINS], dtype=tl.int32)
    for start in range(begin, end, STEP):
        positions = start + steps
        inside = positions < end
        keys = _load_keys(SOURCE, positions, inside, num_forced)
        tied = inside & (keys >= low) & (keys <= high)
        digit = ((keys - low) >> shift).to(tl.int32) & (BINS - 1)
        histogram += tl.histogram(digit, BINS, mask=tied)
    return histogram


@triton.jit
def _count_inside(SOURCE, end, num_forced, low, high, boundary, STEP: tl.constexpr):
    """Keys of SOURCE[0 : end] inside [low, high]: (how many are above ``boundary``, how many are not)."""
    steps = tl.arange(0, STEP)
    above = tl.zeros([], dtype=tl.int32)
    rest = tl.zeros([], dtype=tl.int32)
    for start in range(0, end, STEP):
        positions = start + steps
        inside = positions < end
        keys = _load_keys(SOURCE, positions, inside, num_forced)
        tied = inside & (keys >= low) & (keys <= high)
        above += tl.sum((tied & (keys > boundary)).to(tl.int32), axis=0)
        rest += tl.sum((tied & (keys <= boundary)).to(tl.int32), axis=0)
    return above, rest


@triton.jit
def _class_histogram(keys_row, begin, end, num_forced, PARTIALS_CHUNK, STEP: tl.constexpr, BINS: tl.constexpr):
    """Level 0: PARTIALS_CHUNK ``[BINS]`` counts the magnitude classes of keys_row[begin : end]."""
    steps = tl.arange(0, STEP)
    histogram = tl.zeros([BINS], dtype=tl.int32)
    for start in range(begin, end, STEP):
        positions = start + steps
        inside = positions < end
        classes = _magnitude_class(_load_keys(keys_row, positions, inside, num_forced))
        histogram += tl.histogram(classes, BINS, mask=inside)
    tl.store(PARTIALS_CHUNK + tl.arange(0, BINS), histogram)


@triton.jit
def _narrow(
    keys_row,
    begin,
    end,
    num_forced,
    count,
    chunk,
    PARTIALS_ROW,
    SCRATCH_ROW,
    scratch_len,
    LEVEL: tl.constexpr,
    LEVELS: tl.constexpr,
    CHUNKS: tl.constexpr,
    BINS: tl.constexpr,
    STEP: tl.constexpr,
):
    """Level ``LEVEL`` ≥ 1 of the chunk keys_row[begin : end]: once the levels before it leave few keys in the
    threshold's interval (:func:`_copies`), the first launch to see it copies them to SCRATCH_ROW (in position
    order, chunk after chunk); while more are left and the threshold is not yet found, PARTIALS_ROW[LEVEL,
    chunk] counts the next 8 bits of the chunk's keys in the interval."""
    low, high, remaining, tied, _above, inside, copied_at = _narrowed(
        PARTIALS_ROW, count, scratch_len, LEVEL, LEVELS, CHUNKS, BINS
    )
    if _copies(tied, scratch_len, LEVEL, LEVELS):
        if copied_at == LEVELS:
            steps = tl.arange(0, STEP)
            copied = tl.sum(tl.where(tl.arange(0, CHUNKS) < chunk, inside, 0), axis=0)  # by the earlier chunks
            for start in range(begin, end, STEP):
                positions = start + steps
                inside_chunk = positions < end
                keys = _load_keys(keys_row, positions, inside_chunk, num_forced)
                keep = inside_chunk & (keys >= low) & (keys <= high)
                tl.store(SCRATCH_ROW + copied + tl.cumsum(keep.to(tl.int32), 0) - 1, keys, mask=keep)
                copied += tl.sum(keep.to(tl.int32), axis=0)
    elif (remaining != tied) & (low != high):
        shift = _digit_shift(low, high)
        histogram = _digit_histogram(keys_row, begin, end, num_forced, low, high, shift, STEP, BINS)
        tl.store(PARTIALS_ROW + (LEVEL * CHUNKS + chunk) * BINS + tl.arange(0, BINS), histogram)


@triton.jit
def _finish(
    keys_row,
    out_row,
    begin,
    end,
    num_entries,
    num_forced,
    count,
    chunk,
    PARTIALS_ROW,
    SCRATCH_ROW,
    scratch_len,
    LEVELS: tl.constexpr,
    CHUNKS: tl.constexpr,
    BINS: tl.constexpr,
    STEP: tl.constexpr,
):
    """Narrows the interval to the threshold on the copied keys (or on the row's keys in it, if none were copied),
    then writes the chunk keys_row[begin : end]'s chosen positions to out_row at their place among the row's."""
    chunks = tl.arange(0, CHUNKS)
    low, high, remaining, tied, above, inside, copied_at = _narrowed(
        PARTIALS_ROW, count, scratch_len, LEVELS, LEVELS, CHUNKS, BINS
    )
    source = keys_row  # the keys the last passes read: the row's, or the copied ones alone
    source_len = num_entries
    source_forced = num_forced
    earlier = begin  # the source's keys of the chunks before this one: source[0 : earlier]
    if copied_at < LEVELS:
        source = SCRATCH_ROW
        source_len = tied
        source_forced = num_forced * 0
        earlier = tl.sum(tl.where(chunks < chunk, inside, 0), axis=0)
    outer_high = high
    taken_before = tl.sum(tl.where(chunks < chunk, above, 0), axis=0)  # above the interval, earlier chunks
    tied_before = tl.sum(tl.where(chunks < chunk, inside, 0), axis=0)  # in it, earlier chunks
    narrowed = tl.zeros([], dtype=tl.int32)
    while (remaining != tied) & (low != high):
        shift = _digit_shift(low, high)
        histogram = _digit_histogram(source, 0, source_len, source_forced, low, high, shift, STEP, BINS)
        digit, tied, remaining = _choose_bin(histogram, remaining, tl.arange(0, BINS))
        low, high = _digit_bounds(low, high, shift, digit)
        narrowed = 1
    if narrowed != 0:  # the interval shrank: count the earlier chunks' keys above it and in it again
        above_now, tied_before = _count_inside(source, earlier, source_forced, low, outer_high, high, STEP)
        taken_before += above_now
    # above the interval: taken; in it (all one key, unless all are taken): the first `remaining` by position
    steps = tl.arange(0, STEP)
    written = taken_before + tl.minimum(tied_before, remaining)
    tied_seen = tied_before
    for start in range(begin, end, STEP):
        positions = start + steps
        inside_chunk = positions < end
        keys = _load_keys(keys_row, positions, inside_chunk, num_forced)
        tied_now = inside_chunk & (keys >= low) & (keys <= high)
        tied_rank = tied_seen + tl.cumsum(tied_now.to(tl.int32), 0) - 1
        take = (inside_chunk & (keys > high)) | (tied_now & (tied_rank < remaining))
        tl.store(out_row + written + tl.cumsum(take.to(tl.int32), 0) - 1, positions, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        tied_seen += tl.sum(tied_now.to(tl.int32), axis=0)


@triton.jit
def _selection_kernel(
    KEYS,
    COUNTS,
    OUT,
    SECOND_KEYS,
    SECOND_COUNTS,
    SECOND_OUT,
    PARTIALS,
    SCRATCH,
    first_rows,
    entries,
    second_entries,
    forced,
    second_forced,
    widths,
    second_widths,
    scratch_stride,
    STAGE: tl.constexpr,
    LEVELS: tl.constexpr,
    CHUNKS: tl.constexpr,
    BINS: tl.constexpr,
    STEP: tl.constexpr,
    TIED_FRACTION: tl.constexpr,
):
    """Stage ``STAGE`` of the selection for chunk program_id(1) of row program_id(0): 0 the class histograms,
    1 … LEVELS − 1 a narrowing level, LEVELS the positions.

    Rows: of KEYS ``[R, n]`` (int64, n = ``entries``, contiguous), OUT ``[R, widths]`` (int32, contiguous) gets the
    positions of its first COUNTS[row] entries by (key desc, position asc), ascending, then n up to the width; the
    entries at positions below ``forced`` rank first. Rows from ``first_rows`` on are those of the SECOND_* group
    (second_* sizes). PARTIALS is int32 ``[rows of both, LEVELS, CHUNKS, BINS]``, SCRATCH int64 ``[rows of both,
    scratch_stride ≥ n / TIED_FRACTION]``."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    zero = tl.zeros([], dtype=tl.int32)
    if row < first_rows:
        keys_row = KEYS + row * entries
        out_row = OUT + row * widths
        count = tl.load(COUNTS + row).to(tl.int32)
        num_entries = zero + entries  # a tensor in both branches, even if the launch made the int a constant
        num_forced = zero + forced
        width = zero + widths
    else:
        keys_row = SECOND_KEYS + (row - first_rows) * second_entries
        out_row = SECOND_OUT + (row - first_rows) * second_widths
        count = tl.load(SECOND_COUNTS + row - first_rows).to(tl.int32)
        num_entries = zero + second_entries
        num_forced = zero + second_forced
        width = zero + second_widths
    count = tl.minimum(tl.maximum(count, 0), num_entries)
    chunk_len = tl.cdiv(num_entries, CHUNKS)
    begin = tl.minimum(chunk * chunk_len, num_entries)
    end = tl.minimum(begin + chunk_len, num_entries)
    partials_row = PARTIALS + row * LEVELS * CHUNKS * BINS
    scratch_row = SCRATCH + row * scratch_stride
    scratch_len = tl.maximum(num_entries // TIED_FRACTION, 1)
    if STAGE == 0:
        _class_histogram(keys_row, begin, end, num_forced, partials_row + chunk * BINS, STEP, BINS)
    elif STAGE < LEVELS:
        if count > 0:
            _narrow(
                keys_row, begin, end, num_forced, count, chunk, partials_row, scratch_row, scratch_len, STAGE, LEVELS,
                CHUNKS, BINS, STEP,
            )  # fmt: skip
    else:
        if count > 0:
            _finish(
                keys_row, out_row, begin, end, num_entries, num_forced, count, chunk, partials_row, scratch_row,
                scratch_len, LEVELS, CHUNKS, BINS, STEP,
            )  # fmt: skip
        if chunk == 0:
            steps = tl.arange(0, STEP)
            for start in range(count, width, STEP):
                slots = start + steps
                tl.store(out_row + slots, num_entries, mask=slots < width)


class SelectionRows(NamedTuple):
    """Rows to select from: ``keys [R, n]`` int64; per row the first ``counts [R]`` (any integer dtype, in
    [0, width], not read on the host) by key descending, then position ascending, positions below ``num_forced``
    first (as if their key were the largest); ``width`` ≤ n slots per row."""

    keys: torch.Tensor
    counts: torch.Tensor
    width: int
    num_forced: int = 0


def top_positions(keys: torch.Tensor, counts: torch.Tensor, width: int, num_forced: int = 0) -> torch.Tensor:
    """The chosen positions of :class:`SelectionRows` ``(keys, counts, width, num_forced)``: int32 ``[R, width]``,
    ascending, padded with n."""
    return top_positions_of_groups([SelectionRows(keys, counts, width, num_forced)])[0]


def top_positions_of_groups(groups: list[SelectionRows]) -> list[torch.Tensor]:
    """:func:`top_positions` of one or two groups of rows (say the vertical and the slash scores) in the same four
    launches, so their rows run side by side: ``CHUNKS`` programs per row."""
    if not 1 <= len(groups) <= 2:
        raise ValueError(f"{len(groups)} groups of rows; one selection takes one or two")
    for keys, counts, width, _ in groups:
        if keys.dim() != 2 or keys.dtype != torch.int64 or counts.shape != keys.shape[:1]:
            raise ValueError(
                f"keys must be int64 [R, n] and counts [R]; got {keys.dtype} {tuple(keys.shape)}, counts "
                f"{tuple(counts.shape)}"
            )
        if not 0 <= width <= keys.shape[1]:
            raise ValueError(f"width={width} must lie in [0, n={keys.shape[1]}]")
    if groups[-1].keys.device != groups[0].keys.device:
        raise ValueError(f"both groups' keys must be on one device, got {[g.keys.device.type for g in groups]}")
    groups = [group._replace(keys=group.keys.contiguous(), counts=group.counts.contiguous()) for group in groups]
    rows = sum(group.keys.shape[0] for group in groups)
    bins = 1 << RADIX_BITS
    sizes = [group.keys.shape[0] * group.width for group in groups]
    device = groups[0].keys.device
    # one int32 allocation: each group's positions, then the levels' histograms [rows, LEVELS, CHUNKS, bins]
    memory = torch.empty(sum(sizes) + rows * LEVELS * CHUNKS * bins, dtype=torch.int32, device=device)
    outs = [
        part.view(group.keys.shape[0], group.width) for part, group in zip(memory[: sum(sizes)].split(sizes), groups)
    ]
    partials = memory[sum(sizes) :]
    busy = [(group, out) for group, out in zip(groups, outs) if out.numel()]
    if not busy:
        return outs
    first, second = busy[0], busy[-1]  # one group: the second is the first again, and no program reaches it
    scratch_stride = max(max(group.keys.shape[1] // TIED_FRACTION, 1) for group, _ in busy)
    scratch = torch.empty(sum(out.shape[0] for _, out in busy), scratch_stride, dtype=torch.int64, device=device)
    arguments = (
        *(first[0].keys, first[0].counts, first[1], second[0].keys, second[0].counts, second[1], partials, scratch),
        *(first[1].shape[0], first[0].keys.shape[1], second[0].keys.shape[1], first[0].num_forced),
        *(second[0].num_forced, first[0].width, second[0].width, scratch_stride),
    )
    constants = dict(
        LEVELS=LEVELS, CHUNKS=CHUNKS, BINS=bins, STEP=ENTRIES_PER_STEP, TIED_FRACTION=TIED_FRACTION,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    for stage in range(LEVELS + 1):
        direct(_selection_kernel)((scratch.shape[0], CHUNKS), *arguments, STAGE=stage, **constants)
    return outs
