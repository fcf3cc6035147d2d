"""Triton kernel of the estimation's selection (DESIGN.md §2.2): each row's best entries by radix select, no sort.

``estimation.rank_candidates`` is defined as a stable sort of a (sample, head) row's N int64 keys, of which the first
few thousand are kept. :func:`top_positions` finds the same set without sorting (the estimation's path on CUDA).
One program per row:

1. reads the row's largest and smallest key: the bits above the highest one that differs are every key's;
2. narrows a threshold down the remaining bits, 8 per pass, with a histogram of the keys still tied with it on
   the bits found so far; once few keys are tied (at most 1/``TIED_FRACTION`` of the row) they are copied to a
   scratch row and the later passes read only those;
3. writes the positions of the keys above the threshold, and of the first ones equal to it, in position order.

The order ranked is (key descending, position ascending), a strict total order, so the set is exactly the sort's
first ``count``. Random scores need about four reads of the row; equal keys all of them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

RADIX_BITS = 8  # key bits resolved per pass
ENTRIES_PER_STEP = 4096  # entries one program reads per loop step (8 per thread)
NUM_WARPS = 16
TIED_FRACTION = 16  # the scratch row holds n / 16 keys


@triton.jit
def _load_keys(SOURCE, positions, inside, num_forced):
    """int64 keys at ``positions`` of SOURCE, the largest key at positions below ``num_forced`` (forced entries)."""
    keys = tl.load(SOURCE + positions, mask=inside, other=0)
    return tl.where(positions < num_forced, 2**63 - 1, keys)


@triton.jit
def _tied_histogram(
    SOURCE, length, num_forced, known, threshold, shift, steps, RADIX: tl.constexpr, STEP: tl.constexpr
):
    """Histogram ``[2^RADIX]`` of the digit at ``shift`` of SOURCE[0 : length]'s keys (see :func:`_load_keys`) tied
    with ``threshold`` on the ``known`` bits (keys read with the sign bit flipped, see the kernel)."""
    sign = tl.full([], 1, tl.int64) << 63
    histogram = tl.zeros([1 << RADIX], dtype=tl.int32)
    for start in range(0, length, STEP):
        inside = start + steps < length
        flipped = _load_keys(SOURCE, start + steps, inside, num_forced) ^ sign
        digit = ((flipped >> shift) & ((1 << RADIX) - 1)).to(tl.int32)
        histogram += tl.histogram(digit, 1 << RADIX, mask=inside & ((flipped & known) == threshold))
    return histogram


@triton.jit
def _top_positions_kernel(
    KEYS,
    COUNTS,
    OUT,
    SECOND_KEYS,
    SECOND_COUNTS,
    SECOND_OUT,
    SCRATCH,
    first_rows,
    entries,
    second_entries,
    forced,
    second_forced,
    widths,
    second_widths,
    scratch_len,
    stride_keys,
    second_stride_keys,
    stride_out,
    second_stride_out,
    RADIX: tl.constexpr,
    STEP: tl.constexpr,
):
    """Program r < ``first_rows`` takes row r of the first group, the others row r − ``first_rows`` of the second
    (SECOND_*, second_*): of KEYS ``[R, n]`` (int64, n = ``entries``), OUT ``[R, widths]`` (int32) gets the
    positions of its first COUNTS[row] entries by (key desc, position asc), ascending, then n up to the width;
    the entries at positions below ``forced`` rank first. SCRATCH ``[rows of both, scratch_len]`` int64 is
    working memory.

    Digits are read from the keys with the sign bit flipped (their order as unsigned numbers); ``threshold``
    holds the bits found so far in that form, ``known`` is their mask (always the top bits, so a masked key
    flipped back compares as a signed number in the keys' order)."""
    program = tl.program_id(0).to(tl.int64)
    scratch_row = SCRATCH + program * scratch_len
    zero = tl.zeros([], dtype=tl.int32)
    if program < first_rows:
        keys_row = KEYS + program * stride_keys
        out_row = OUT + program * stride_out
        count = tl.load(COUNTS + program).to(tl.int32)
        num_entries = zero + entries  # a tensor in both branches, even if the launch made the int a constant
        num_forced = zero + forced
        width = zero + widths
    else:
        keys_row = SECOND_KEYS + (program - first_rows) * second_stride_keys
        out_row = SECOND_OUT + (program - first_rows) * second_stride_out
        count = tl.load(SECOND_COUNTS + program - first_rows).to(tl.int32)
        num_entries = zero + second_entries
        num_forced = zero + second_forced
        width = zero + second_widths
    steps = tl.arange(0, STEP)
    bins = tl.arange(0, 1 << RADIX)
    sign = tl.full([], 1, tl.int64) << 63

    anchor = _load_keys(keys_row, 0, True, num_forced)  # a key of the row, standing in for lanes past its end
    largest = tl.zeros([STEP], dtype=tl.int64) + anchor  # per lane, reduced across the block after the loop
    smallest = largest
    for start in range(0, num_entries, STEP):
        inside = start + steps < num_entries
        keys = tl.where(inside, _load_keys(keys_row, start + steps, inside, num_forced), anchor)
        largest = tl.maximum(largest, keys)
        smallest = tl.minimum(smallest, keys)
    largest = tl.max(largest, axis=0)
    smallest = tl.min(smallest, axis=0)
    varying = largest ^ smallest
    top_bit = tl.full([], -1, tl.int32)
    while varying != 0:
        varying = (varying >> 1) & (2**63 - 1)  # a logical shift
        top_bit += 1
    known = tl.full([], 0, tl.int64)
    if top_bit < 63:
        known = -(tl.full([], 1, tl.int64) << (top_bit + 1))  # the bits above top_bit
    threshold = (largest ^ sign) & known
    remaining = count  # entries still to take among those tied with the threshold on its known bits
    tied = num_entries
    shift = tl.maximum(top_bit - RADIX + 1, 0)
    source = keys_row  # the keys the passes read: the row, then the tied ones alone
    source_len = num_entries
    source_forced = num_forced
    done = (count == 0) | (top_bit < 0)
    while done == 0:
        histogram = _tied_histogram(source, source_len, source_forced, known, threshold, shift, steps, RADIX, STEP)
        at_least = tied - tl.cumsum(histogram, 0) + histogram  # tied entries whose digit is ≥ the bin
        chosen = tl.max(tl.where(at_least >= remaining, bins, -1), axis=0)  # nonempty, since remaining ≥ 1
        in_chosen = tl.sum(tl.where(bins == chosen, histogram, 0), axis=0)
        remaining -= tl.sum(tl.where(bins == chosen, at_least, 0), axis=0) - in_chosen
        threshold = threshold | (chosen.to(tl.int64) << shift)
        known = known | (tl.full([], (1 << RADIX) - 1, tl.int64) << shift)
        tied = in_chosen
        done = (shift == 0) | (in_chosen == remaining)
        shift = tl.maximum(shift - RADIX, 0)
        if (done == 0) & (source_len == num_entries) & (tied <= scratch_len):
            copied = 0
            for start in range(0, num_entries, STEP):
                inside = start + steps < num_entries
                keys = _load_keys(keys_row, start + steps, inside, num_forced)
                keep = inside & (((keys ^ sign) & known) == threshold)
                tl.store(scratch_row + copied + tl.cumsum(keep.to(tl.int32), 0) - 1, keys, mask=keep)
                copied += tl.sum(keep.to(tl.int32), axis=0)
            source = scratch_row
            source_len = tied
            source_forced = 0

    # above the threshold: taken; tied with it: the first `remaining` in position order
    bound = threshold ^ sign
    written = 0
    tied_seen = 0
    for start in range(0, num_entries, STEP):
        positions = start + steps
        inside = positions < num_entries
        masked = ((_load_keys(keys_row, positions, inside, num_forced) ^ sign) & known) ^ sign
        equal = inside & (masked == bound)
        tied_rank = tied_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
        take = (inside & (masked > bound)) | (equal & (tied_rank < remaining))
        slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_row + slot, positions, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        tied_seen += tl.sum(equal.to(tl.int32), axis=0)
    for start in range(0, width, STEP):
        slots = start + steps
        tl.store(out_row + slots, num_entries, mask=(slots >= count) & (slots < width))


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
    """:func:`top_positions` of one or two groups of rows (say the vertical and the slash scores) in one launch, so
    their rows run side by side: a program per row, and a batch of rows seldom fills the GPU."""
    if not 1 <= len(groups) <= 2:
        raise ValueError(f"{len(groups)} groups of rows; one launch selects from one or two")
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
    outs = [torch.empty(g.keys.shape[0], g.width, dtype=torch.int32, device=g.keys.device) for g in groups]
    busy = [(group, out) for group, out in zip(groups, outs) if out.numel()]
    if busy:
        first, second = busy[0], busy[-1]  # one group: the second is the first again, and no program reaches it
        rows = sum(out.shape[0] for _, out in busy)
        scratch_len = max(max(group.keys.shape[1] // TIED_FRACTION, 1) for group, _ in busy)
        scratch = torch.empty(rows, scratch_len, dtype=torch.int64, device=first[1].device)
        _top_positions_kernel[(rows,)](
            first[0].keys,
            first[0].counts,
            first[1],
            second[0].keys,
            second[0].counts,
            second[1],
            scratch,
            first[1].shape[0],
            first[0].keys.shape[1],
            second[0].keys.shape[1],
            first[0].num_forced,
            second[0].num_forced,
            first[0].width,
            second[0].width,
            scratch_len,
            first[0].keys.stride(0),
            second[0].keys.stride(0),
            first[1].stride(0),
            second[1].stride(0),
            RADIX=RADIX_BITS,
            STEP=ENTRIES_PER_STEP,
            num_warps=NUM_WARPS,
        )
    return outs
