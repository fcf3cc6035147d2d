"""Bar lists regrouped by key column for the deterministic Triton backward (DESIGN.md §2.6).

:func:`bar_chunks_by_column` builds, for every source step of a :class:`~mtraining_kernels.index.BlockBarIndex`
at once, the chunks that ``triton_bwd.bar_chunk_backward_kernel`` reads and the CSR by dk/dv row that
``triton_bwd.bar_member_sum_kernel`` reduces its scratch rows with. It runs on the lists' device with no
host sync: every tensor has a size fixed by the shapes, the vertical list width and the number of bar entries
E (bounds of the distinct columns, chunks, pairs and targets), its unused tail padding, and the launch grids
are the per-step bounds ``max_*``, whose surplus programs read the step's real counts from the ``source_*``
offsets and do nothing.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

BAR_CHUNK_COLUMNS = 64  # columns per chunk: one 64-bit membership word per (chunk, query block)


@dataclasses.dataclass(frozen=True, eq=False)
class BarChunks:
    """The deterministic bar pass's work lists of all source steps; ``source`` picks the step launched.

    A head is (w, z, h) of the lists ``[W, b, Hq, nb+1]``; a slot is a distinct (head, bar column), slots
    ascending by head, then column. A vertical has one source, so (z, h) has at most V = min(Vmax, W·N_loc)
    slots over all its heads, Vmax the vertical list width, and at most V//64 + min(W, V) chunks (one partial
    chunk per head with slots). Of E bar entries, with bounds S = min(E, b·Hq·V) slots,
    C = min(E, W·b·Hq + E/64, b·Hq·(V//64 + min(W, V))) chunks and P = min(E, C·nb) pairs (the rows past the
    real ones are padding):

    * ``column`` int32 ``[S]``: each slot's local key column;
    * chunks, int32 ``[C]``: ``chunk_head`` z·Hq + h, ``chunk_first`` its first slot and ``chunk_length``
      (≤ 64): a head's slots in runs of 64, the last one shorter;
    * pairs: ``pair_ptr`` int32 ``[C+1]`` CSR by chunk over ``pair_qblock`` int32 ``[P]`` (ascending) and
      ``pair_bits`` int64 ``[P]``, whose bit t marks column ``chunk_first + t`` as a bar of that query block;
    * targets, the dk/dv rows the slots add into: ``target_row`` int32 ``[S]`` = (z·Hkv + KV head)·N_loc +
      column within its source, ``target_ptr`` int32 ``[S+1]`` CSR over ``target_slot`` int32 ``[S]``, the
      target's slots in ascending GQA member order h mod (Hq / Hkv);
    * ``source_slots`` / ``source_chunks`` / ``source_targets`` int32 ``[W+1]``: where source w's slots,
      chunks and targets start (they are consecutive per source);
    * ``max_slots`` / ``max_chunks`` / ``max_targets``: bounds of one source's counts (scratch rows, grids):
      with V_loc = min(Vmax, N_loc) columns per (z, h), min(E, b·Hq·V_loc) slots, min(E, b·Hq + E/64,
      b·Hq·⌈V_loc/64⌉) chunks and min(slots, b·Hkv·N_loc) targets (a target has at least one slot);
      ``shape`` (b, Hq, nb) and ``kv_heads`` that the lists were built for.
    """

    column: Tensor
    chunk_head: Tensor
    chunk_first: Tensor
    chunk_length: Tensor
    pair_ptr: Tensor
    pair_qblock: Tensor
    pair_bits: Tensor
    target_row: Tensor
    target_ptr: Tensor
    target_slot: Tensor
    source_slots: Tensor
    source_chunks: Tensor
    source_targets: Tensor
    max_slots: int
    max_chunks: int
    max_targets: int
    shape: tuple[int, int, int]
    kv_heads: int
    source: int = 0

    def for_source(self, source: int) -> BarChunks:
        """The same lists, launched for the step reading ``source``."""
        return dataclasses.replace(self, source=source)


def _runs(sorted_keys: Tensor) -> tuple[Tensor, Tensor]:
    """(run id of every position, number of runs before every position ``[E+1]``) of sorted keys ``[E]``."""
    starts = torch.ones_like(sorted_keys, dtype=torch.bool)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    runs_before = torch.zeros(sorted_keys.numel() + 1, dtype=torch.int64, device=sorted_keys.device)
    runs_before[1:] = torch.cumsum(starts, 0)
    return runs_before[1:] - 1, runs_before


def _distinct(sorted_keys: Tensor, size: int, padding: int) -> tuple[Tensor, Tensor, Tensor]:
    """Dedup of sorted keys ``[E]`` with at most ``size`` distinct ones, without a host sync: (the distinct keys
    ascending, then ``padding``, ``[size]``; the index of every position's key among them ``[E]``; the number of
    distinct keys before every position ``[E+1]``)."""
    run_of_position, runs_before = _runs(sorted_keys)
    distinct = torch.full((size,), padding, dtype=sorted_keys.dtype, device=sorted_keys.device)
    return distinct.scatter_(0, run_of_position, sorted_keys), run_of_position, runs_before


def _marked(marked: Tensor, size: int) -> Tensor:
    """The positions of the true entries of bool ``marked [T]``, ascending, then T, ``[size]`` (size ≥ their number);
    without a host sync."""
    return torch.nonzero_static(marked, size=size, fill_value=marked.numel()).squeeze(1)


def bar_chunks_by_column(
    bar_ptr: Tensor, bar_col: Tensor, first: int, last: int, key_len: int, kv_heads: int, vertical_width: int
) -> BarChunks:
    """The :class:`BarChunks` of bar lists ``bar_ptr`` int32 ``[W, b, Hq, nb+1]`` (absolute offsets, rows back
    to back in ``bar_col[first:last]``), local key columns in ``[0, key_len)``, for ``kv_heads`` KV heads;
    ``vertical_width`` bounds the distinct bar columns of one (z, h) over all W sources (Vmax). No host sync, and no
    sort of the E bar entries: the distinct slots and pairs are marked in tables over every (head, column), bool
    ``[W·b·Hq·key_len]``, and every (chunk, query block), int64 ``[C·nb]``, then compacted in order."""
    world, batch, heads, num_blocks = bar_ptr.shape[0], bar_ptr.shape[1], bar_ptr.shape[2], bar_ptr.shape[3] - 1
    group = heads // kv_heads
    device = bar_ptr.device
    entries = last - first
    num_heads = world * batch * heads
    per_source = batch * heads
    width = BAR_CHUNK_COLUMNS
    verticals = min(vertical_width, world * key_len)  # distinct columns of one (z, h), all sources
    step_verticals = min(vertical_width, key_len)  # … of one source

    def arange(n: int) -> Tensor:
        return torch.arange(n, device=device)

    counts = (bar_ptr[..., 1:] - bar_ptr[..., :-1]).reshape(-1)
    list_row = torch.repeat_interleave(arange(counts.numel()), counts, output_size=entries)
    entry_head, entry_qblock = list_row // num_blocks, list_row % num_blocks
    # slots: the distinct (head, column), ascending: marked in a table over every (head, column)
    num_slot_rows = min(entries, per_source * verticals)
    entry_slot_key = entry_head * key_len + bar_col[first:last].long()
    marked = torch.zeros(num_heads * key_len, dtype=torch.bool, device=device).index_fill_(0, entry_slot_key, True)
    slot_key = _marked(marked, num_slot_rows)
    slot_of_entry = torch.searchsorted(slot_key, entry_slot_key)
    head_slots = torch.searchsorted(slot_key, arange(num_heads + 1) * key_len)  # [H+1]
    slot_head = slot_key // key_len  # num_heads on padding
    slot_column = slot_key % key_len
    slot_rank = arange(num_slot_rows) - head_slots[slot_head]  # rank within its head
    # chunks: each head's slots in runs of 64
    slots_per_head = head_slots[1:] - head_slots[:-1]
    head_chunks = torch.zeros(num_heads + 1, dtype=torch.int64, device=device)
    head_chunks[1:] = torch.cumsum((slots_per_head + width - 1) // width, 0)
    num_chunk_rows = min(
        entries, num_heads + entries // width, per_source * (verticals // width + min(world, verticals))
    )
    chunk = arange(num_chunk_rows)
    chunk_head = (torch.searchsorted(head_chunks, chunk, right=True) - 1).clamp(max=num_heads - 1)
    chunk_offset = (chunk - head_chunks[chunk_head]) * width
    chunk_length = (slots_per_head[chunk_head] - chunk_offset).clamp(0, width)
    # pairs: the distinct (chunk, query block), ascending, and their membership words
    slot_chunk = head_chunks[slot_head] + slot_rank // width
    slot_bit = torch.bitwise_left_shift(torch.ones_like(slot_rank), slot_rank % width)
    # a table over every (chunk, query block) adds each entry's bit, distinct per pair: the sum is their OR
    num_pairs = num_chunk_rows * num_blocks
    pair_words = torch.zeros(num_pairs, dtype=torch.int64, device=device)
    pair_words.index_add_(0, slot_chunk[slot_of_entry] * num_blocks + entry_qblock, slot_bit[slot_of_entry])
    num_pair_rows = min(entries, num_pairs)
    pair_key = _marked(pair_words != 0, num_pair_rows)
    pair_bits = torch.where(pair_key < num_pairs, pair_words[pair_key.clamp(max=max(num_pairs - 1, 0))], 0)
    pair_ptr = torch.searchsorted(pair_key, arange(num_chunk_rows + 1) * num_blocks)
    # targets: the distinct (w, z, KV head, column) of the slots, each slot listed in GQA member order
    targets_per_source = batch * kv_heads * key_len
    slot_target = torch.where(
        slot_head < num_heads,
        (slot_head // heads * kv_heads + slot_head % heads // group) * key_len + slot_column,
        world * targets_per_source,
    )
    sorted_member_keys, target_slot = torch.sort(slot_target * group + slot_head % heads % group)
    target_key, target_of_sorted, targets_before = _distinct(
        sorted_member_keys // group, num_slot_rows, world * targets_per_source
    )
    target_ptr = torch.searchsorted(target_of_sorted, arange(num_slot_rows + 1))
    source_start = torch.searchsorted(sorted_member_keys, arange(world + 1) * targets_per_source * group)

    def int32(t: Tensor) -> Tensor:
        return t.to(torch.int32)

    max_slots = min(entries, per_source * step_verticals)
    return BarChunks(
        column=int32(slot_column),
        chunk_head=int32(chunk_head % per_source),
        chunk_first=int32(head_slots[chunk_head] + chunk_offset),
        chunk_length=int32(chunk_length),
        pair_ptr=int32(pair_ptr),
        pair_qblock=int32(pair_key % num_blocks),
        pair_bits=pair_bits,
        target_row=int32(target_key % targets_per_source),
        target_ptr=int32(target_ptr),
        target_slot=int32(target_slot),
        source_slots=int32(head_slots[::per_source]),
        source_chunks=int32(head_chunks[::per_source]),
        source_targets=int32(targets_before[source_start]),
        max_slots=max_slots,
        max_chunks=min(entries, per_source + entries // width, per_source * -(-step_verticals // width)),
        max_targets=min(max_slots, targets_per_source),
        shape=(batch, heads, num_blocks),
        kv_heads=kv_heads,
    )
