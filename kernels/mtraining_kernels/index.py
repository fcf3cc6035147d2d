"""Index conversion: vertical-slash index → per-source-step block and bar lists (DESIGN.md §2.6).

A query rank r holds ``nb = N/W/128`` local query blocks; in a ring it meets every source rank w's
key chunk once (step t reads w = (r − t) mod W). For each (w, b, query head, local query block i)
the conversion lists

* **blocks**: the active 128-key blocks j of source w, i.e. ``A[qb, kb]`` of DESIGN.md §2.1 with
  ``qb = layout.global_blocks(N, r)[i]`` and ``kb = layout.global_blocks(N, w)[j]``. The kernels
  tile a 128-key block as two 64-wide sub-tiles, so block j is stored as sub-tiles 2j and 2j+1;
* **bars**: the valid verticals v owned by w with ``kb(v) < qb`` whose block is *not* active,
  stored as local key columns of source w. Verticals in the query's own block are covered by the
  diagonal block and verticals beyond it are non-causal, so no bar ever needs a causal mask.

Both lists are CSR: row (w, b, h, i) spans ``col[ptr[w, b, h, i] : ptr[w, b, h, i + 1]]`` with
absolute offsets, and ``ptr[w, b, h, nb]`` is where the next row group starts. The block lists also come
transposed, by key block (row (w, b, h, j): the i whose list holds j), for the key-major backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .bar_chunks import BarChunks, bar_chunks_by_column
from .launch_checks import uses_triton
from .layout import BLOCK_SIZE, Layout
from .vertical_slash import slash_block_hits

_INDEX_DTYPES = (torch.int32, torch.int64)


class KeyLists(NamedTuple):
    """One step's block lists by key: ``ptr`` int32 ``[b, Hq, nb+1]``, absolute offsets into ``qblock`` int32,
    which holds the lists of all ``steps`` steps of its index (a ring's W; 1 on one device)."""

    ptr: Tensor
    qblock: Tensor
    steps: int


@dataclass(frozen=True, eq=False)
class BlockBarIndex:
    """Per-source-step work lists of one query rank, CSR over (source rank w, b, Hq, local query block).

    blk_ptr int32 ``[W, b, Hq, nb+1]``, blk_col int32 ``[total]``: 64-wide key sub-tiles of the source
    chunk (0 … 2·nb−1), ascending per query block, a listed 128-key block j always as the consecutive
    pair 2j, 2j+1 (the Triton forward reads each pair as one tile). bar_ptr int32 ``[W, b, Hq, nb+1]``,
    bar_col int32 ``[total]``: local key columns of the source chunk (0 … N_loc−1), ascending per query
    block. key_ptr int32 ``[W, b, Hq, nb+1]``, key_qblock int32 ``[total/2]``: the block lists by key, CSR
    over (w, b, Hq, local key block j), each row the local query blocks i whose row holds block j, ascending
    (:func:`block_lists_by_key`; the key-major backward reads them).

    ``vertical_width``: the width of the vertical lists converted, Vmax of ``v_idx [b, Hq, Vmax]`` (m_max·Vmax
    of a packed index's): no (sample, query head) has more distinct bar columns over all sources, which bounds
    the deterministic backward's bar lists (:func:`~mtraining_kernels.bar_chunks.bar_chunks_by_column`).

    ``doc_ids`` int32 ``[W, b, N_loc]`` (packed documents, DESIGN.md §2.7; None for an unpacked index): the
    document of every position of each rank's chunk in local order, so a step reads this rank's query rows
    from ``doc_ids[rank]`` and the source's key columns from ``doc_ids[w]``. Every listed score (i, j), tile
    or bar, is then attended iff doc(i) == doc(j) (and j ≤ i on the diagonal); the lists were built from
    the per-document indices (``document_conversion``), so that is all the kernels need.
    """

    blk_ptr: Tensor
    blk_col: Tensor
    bar_ptr: Tensor
    bar_col: Tensor
    key_ptr: Tensor
    key_qblock: Tensor
    seq_len: int
    world_size: int
    rank: int
    layout: Layout
    vertical_width: int
    doc_ids: Tensor | None = None

    @property
    def num_local_blocks(self) -> int:
        """nb, the number of local query blocks (and of key blocks per source chunk)."""
        return self.blk_ptr.shape[-1] - 1

    def source_for_step(self, step: int) -> int:
        """The source rank a flat ring reads at ``step``: (rank − step) mod W."""
        return (self.rank - step) % self.world_size

    def step_lists(self, source: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(blk_ptr ``[b, Hq, nb+1]``, blk_col, bar_ptr ``[b, Hq, nb+1]``, bar_col) of the step reading ``source``,
        the launchers' four list arguments; the views are made once per index and source."""
        views = self._views_by_source
        if ("lists", source) not in views:
            views["lists", source] = (self.blk_ptr[source], self.blk_col, self.bar_ptr[source], self.bar_col)
        return views["lists", source]

    def key_lists(self, source: int) -> KeyLists:
        """The block lists by key of the step reading ``source``, for the launchers' ``key_lists`` keyword; made
        once per index and source."""
        views = self._views_by_source
        if ("keys", source) not in views:
            views["keys", source] = KeyLists(self.key_ptr[source], self.key_qblock, self.key_ptr.shape[0])
        return views["keys", source]

    @functools.cached_property
    def _views_by_source(self) -> dict[tuple[str, int], tuple]:
        return {}

    @functools.cached_property
    def _bar_chunks_by_kv_heads(self) -> dict[int, BarChunks]:
        return {}

    def bar_chunks(self, source: int, kv_heads: int) -> BarChunks:
        """The deterministic backward's bar lists by column of the step reading ``source``, for the Triton
        launcher's ``bar_chunks`` keyword; built once per index and KV head count, for every step, with no
        host sync (see :func:`mtraining_kernels.bar_chunks.bar_chunks_by_column`)."""
        views = self._bar_chunks_by_kv_heads
        if kv_heads not in views:
            local_len = self.seq_len // self.world_size
            views[kv_heads] = bar_chunks_by_column(
                self.bar_ptr, self.bar_col, 0, self.bar_col.numel(), local_len, kv_heads, self.vertical_width
            )
        return views[kv_heads].for_source(source)

    def step_doc_ids(self, source: int) -> dict[str, Tensor]:
        """The launchers' document keywords for a step reading ``source``: ``query_doc_ids [b, N_loc]`` and
        ``key_doc_ids [b, N_loc]``, or none for an unpacked index."""
        if self.doc_ids is None:
            return {}
        return {"query_doc_ids": self.doc_ids[self.rank], "key_doc_ids": self.doc_ids[source]}


def _check_inputs(v_idx: Tensor, s_idx: Tensor, layout: Layout, rank: int, seq_len: int) -> None:
    """Raise ``ValueError`` for arguments of the wrong type, shape, dtype or device, before any work; no host read."""
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a mtraining_kernels.Layout, got {type(layout).__name__}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool):
        raise ValueError(f"seq_len={seq_len!r} must be an int")
    layout.validate(seq_len, BLOCK_SIZE)
    if not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank!r} is outside [0, {layout.world_size}) for world_size={layout.world_size}")
    for name, idx in (("v_idx", v_idx), ("s_idx", s_idx)):
        if not isinstance(idx, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
        if idx.dim() != 3:
            raise ValueError(f"{name} must be [b, Hq, width], got shape {tuple(idx.shape)}")
        if idx.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} has dtype {idx.dtype}; use torch.int32 (or torch.int64)")
    if v_idx.shape[:2] != s_idx.shape[:2]:
        raise ValueError(f"v_idx {tuple(v_idx.shape)} and s_idx {tuple(s_idx.shape)} disagree on [b, Hq]")
    if v_idx.shape[0] < 1 or v_idx.shape[1] < 1:
        raise ValueError(f"v_idx shape {tuple(v_idx.shape)} needs b >= 1 and Hq >= 1")
    if v_idx.device != s_idx.device:
        raise ValueError(f"v_idx is on {v_idx.device} but s_idx is on {s_idx.device}; move both to one device")


def _check_contents(v_idx: Tensor, s_idx: Tensor, seq_len: int) -> None:
    """Raise ``ValueError`` unless both lists hold values in [0, N], valid entries ascending before the sentinels."""
    checked = [(name, idx) for name, idx in (("v_idx", v_idx), ("s_idx", s_idx)) if idx.numel()]
    if not checked:
        return
    # both conditions of both lists in one host read: on a GPU the checks cost one sync, not four
    flags = torch.stack(
        [
            flag
            for _, idx in checked
            for flag in (
                ((idx < 0) | (idx > seq_len)).any(),
                ((idx[..., 1:] <= idx[..., :-1]) & (idx[..., 1:] < seq_len)).any(),
            )
        ]
    ).tolist()
    for (name, idx), out_of_range, not_ascending in zip(checked, flags[0::2], flags[1::2]):
        if out_of_range:
            raise ValueError(
                f"{name} holds values outside [0, {seq_len}] (min {int(idx.min())}, max {int(idx.max())}); "
                f"valid entries are in [0, N) and unused slots hold the sentinel N={seq_len}"
            )
        if not_ascending:
            raise ValueError(
                f"{name} valid entries must be ascending and distinct per [b, h], "
                f"with sentinels N={seq_len} last; sort and deduplicate the index"
            )


@functools.lru_cache(maxsize=64)
def block_tables(layout: Layout, rank: int, seq_len: int, device) -> tuple[Tensor, Tensor]:
    """Global block ids: of ``rank``'s local query blocks ``[nb]`` and of every source's key blocks ``[W, nb]``
    (int64). Built once per argument tuple, so the tensors are shared: read them, never write them."""
    world = layout.world_size
    num_blocks = seq_len // BLOCK_SIZE
    owner, local = layout.to_local(torch.arange(num_blocks, device=device) * BLOCK_SIZE, seq_len)
    source_blocks = torch.empty(world, num_blocks // world, dtype=torch.long, device=device)
    source_blocks[owner, local // BLOCK_SIZE] = torch.arange(num_blocks, device=device)
    return source_blocks[rank], source_blocks


def block_lists_by_key(blk_ptr: Tensor, blk_col: Tensor, first: int, last: int) -> tuple[Tensor, Tensor]:
    """CSR-by-key copy of block lists whose rows lie back to back in ``blk_col[first:last]``.

    blk_ptr int32 ``[..., nb+1]`` (absolute offsets, each group's last entry the next group's first); blk_col
    holds every block j as the sub-tile pair 2j, 2j+1 at an even offset, as every :class:`BlockBarIndex` does.
    Returns key_ptr int32 of the same shape, absolute offsets into key_qblock int32: row (…, j) lists,
    ascending, the query blocks i whose row (…, i) holds block j. No host sync.
    """
    num_blocks = blk_ptr.shape[-1] - 1
    groups = blk_ptr.numel() // (num_blocks + 1)
    device = blk_ptr.device
    pairs_per_row = (blk_ptr[..., 1:] - blk_ptr[..., :-1]).reshape(-1) // 2
    rows = torch.repeat_interleave(
        torch.arange(groups * num_blocks, dtype=torch.int32, device=device),
        pairs_per_row,
        output_size=(last - first) // 2,
    )  # row (group, i) of every pair, over group·nb + i
    qblock = rows % num_blocks
    key_row = rows - qblock + blk_col[first:last:2] // 2  # group·nb + j, from each pair's even sub-tile 2j
    sorted_rows, order = torch.sort(key_row, stable=True)  # stable: ascending query blocks within a row
    row_starts = torch.searchsorted(
        sorted_rows, torch.arange(groups * num_blocks + 1, dtype=torch.int32, device=device), out_int32=True
    )
    return _csr_pointers(row_starts, tuple(blk_ptr.shape[:-1]) + (num_blocks,)), qblock[order]


def _check_list_total(total: int) -> None:
    if total >= 2**31:
        raise ValueError(f"{total} list entries overflow int32 offsets; split the batch or heads")


def _csr_pointers(row_starts: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Row starts int32 ``[W·b·Hq·nb + 1]`` (the last one the list's total) → absolute offsets int32
    ``[W, b, Hq, nb+1]``, ``ptr[..., nb]`` the next group's first."""
    nb = shape[-1]
    return row_starts.unfold(0, nb + 1, nb).contiguous().view(*shape[:-1], nb + 1)


def csr_offsets(row_counts: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Row lengths ``[W·b·Hq·nb]`` → absolute row starts int32 ``[W, b, Hq, nb+1]`` (last = next group start)."""
    row_starts = F.pad(torch.cumsum(row_counts, 0), (1, 0))
    _check_list_total(int(row_starts[-1]))
    return _csr_pointers(row_starts.to(torch.int32), shape)


def _block_lists(hit: Tensor, query_blocks: Tensor, source_blocks: Tensor) -> tuple[Tensor, Tensor]:
    """CSR block lists from hit ``[b, Hq, NB]``, query blocks ``[nb]`` and source key blocks ``[W, nb]``.

    A[qb, kb] = hit[qb − kb] for qb ≥ kb (hit[0] is the diagonal block); transient: bool ``[W, b, Hq, nb, nb]``.
    """
    batch, heads = hit.shape[:2]
    world, nb = source_blocks.shape
    distance = query_blocks[None, :, None] - source_blocks[:, None, :]  # [W, nb, nb]
    active = hit.index_select(-1, distance.clamp(min=0).flatten()).view(batch, heads, world, nb, nb)
    return lists_of_active_blocks((active & (distance >= 0)).permute(2, 0, 1, 3, 4))


def lists_of_active_blocks(active: Tensor) -> tuple[Tensor, Tensor]:
    """CSR block lists (sub-tile pairs) from the bool block mask ``active [W, b, Hq, nb, nb]`` (key block last)."""
    shape = active.shape[:4]
    nb = active.shape[-1]
    rows = active.contiguous().view(-1, nb)  # rows (w, b, h, i)
    key_block = (torch.nonzero(rows.view(-1)).squeeze(1) % nb).to(torch.int32)
    col = torch.stack((2 * key_block, 2 * key_block + 1), dim=1).view(-1)
    return csr_offsets(2 * rows.sum(1), shape), col


def _bar_lists(v_idx: Tensor, hit: Tensor, query_blocks: Tensor, layout: Layout, seq_len: int) -> tuple[Tensor, Tensor]:
    """CSR bar lists: verticals strictly before the query block whose block is not active.

    A sentinel N is clamped into the last block, which is never strictly before a query block, so
    it drops out. Transient: int64 ``[b, Hq, nb, Vmax]`` block distances.
    """
    batch, heads, width = v_idx.shape
    world, nb, local_len = layout.world_size, query_blocks.numel(), seq_len // layout.world_size
    column = v_idx.long().clamp(max=seq_len - 1)  # [b, Hq, V]
    owner, local = layout.to_local(column, seq_len)
    distance = query_blocks[None, None, :, None] - (column // BLOCK_SIZE)[:, :, None, :]  # [b, Hq, nb, V]
    block_hit = hit.gather(-1, distance.clamp(min=0).view(batch, heads, nb * width)).view_as(distance)
    flat = torch.nonzero(((distance > 0) & ~block_hit).view(-1)).squeeze(1)  # over (b, h, i, v)
    head_row = flat // width  # (b, h)·nb + i
    vertical = head_row // nb * width + flat % width  # over (b, h, v)
    row = owner.view(-1)[vertical] * (batch * heads * nb) + head_row  # over (w, b, h, i)
    return lists_of_bar_entries(row, local.view(-1)[vertical], (world, batch, heads, nb), local_len)


def lists_of_bar_entries(row: Tensor, column: Tensor, shape: tuple[int, ...], local_len: int) -> tuple[Tensor, Tensor]:
    """CSR bar lists from entries: int64 ``row [E]`` over (w, b, h, i) of ``shape`` = (W, b, Hq, nb) and local
    key ``column [E]``, distinct per row; each row's columns come out ascending."""
    order_key = torch.sort(row * local_len + column).values
    num_rows = shape[0] * shape[1] * shape[2] * shape[3]
    row_starts = torch.searchsorted(order_key // local_len, torch.arange(num_rows + 1, device=row.device))
    _check_list_total(int(row_starts[-1]))
    col = (order_key % local_len).to(torch.int32)
    return _csr_pointers(row_starts.to(torch.int32), shape), col


@functools.lru_cache(maxsize=64)
def _kernel_block_tables(layout: Layout, rank: int, seq_len: int, device):
    """:func:`block_tables` in the Triton kernels' form (``triton_index.BlockTables``), built once per argument
    tuple like them."""
    from . import triton_index

    query_blocks, source_blocks = block_tables(layout, rank, seq_len, device)
    return triton_index.block_tables(source_blocks, query_blocks)


def _triton_lists(v_idx: Tensor, s_idx: Tensor, layout: Layout, rank: int, seq_len: int) -> list[tuple[Tensor, Tensor]]:
    """[(blk_ptr, blk_col), (key_ptr, key_qblock), (bar_ptr, bar_col)] by the Triton kernels of ``triton_index``:
    one launch finds the slashes' block hits, one counts every list's rows, then their offsets, one host read of
    the lists' sizes (the only one), and one launch writes them with their int32 offsets. No int64
    ``[b, Hq, nb, Vmax]`` temporaries, no sort."""
    from . import triton_index  # Triton is imported only where its kernels run

    hit = triton_index.slash_block_hits(s_idx, seq_len // BLOCK_SIZE, BLOCK_SIZE)  # [b, Hq, NB]
    tables = _kernel_block_tables(layout, rank, seq_len, v_idx.device)
    candidates = triton_index.list_candidates(tables, hit, v_idx, BLOCK_SIZE)
    shape = (layout.world_size, *v_idx.shape[:2], tables.query_blocks.numel())
    row_starts = torch.empty((triton_index.NUM_LISTS, math.prod(shape) + 1), dtype=torch.int64, device=v_idx.device)
    triton_index.count_rows(candidates, row_starts)
    row_starts.cumsum_(1)
    totals = row_starts[:, -1].tolist()
    for total in totals:
        _check_list_total(total)  # before any list is written: the lists' offsets are int32
    pointers, cols = triton_index.write_rows(candidates, row_starts, totals)
    return list(zip(pointers.view(triton_index.NUM_LISTS, *shape[:-1], shape[-1] + 1).unbind(0), cols))


def convert_index(
    v_idx: Tensor,
    s_idx: Tensor,
    layout: Layout,
    rank: int,
    seq_len: int,
    implementation: str = "auto",
    *,
    check_contents: bool = True,
) -> BlockBarIndex:
    """Vectorised conversion of ``(v_idx, s_idx)`` ``[b, Hq, ·]`` into ``rank``'s :class:`BlockBarIndex`.

    Runs on ``v_idx``'s device with no loop over blocks, columns or ranks. ``implementation``: "auto"
    (Triton on CUDA), "torch" or "triton", the same lists either way. Transient memory: with the Triton
    kernels int32 candidates and row counts only; with PyTorch ops a bool block mask ``[W, b, Hq, nb, nb]``
    and int64 ``[b, Hq, nb, Vmax]`` bar distances (the bar list itself can be that large). With the Triton
    kernels it reads the host twice: the content checks (values in [0, N], ascending), then both lists' sizes.
    ``check_contents=False`` skips the content checks and their host read, for an index valid by construction
    (the estimators', the full pattern); types, shapes and devices are still checked, but an index with bad
    values then gives wrong lists instead of a ``ValueError``.
    """
    _check_inputs(v_idx, s_idx, layout, rank, seq_len)
    if check_contents:
        _check_contents(v_idx, s_idx, seq_len)
    if uses_triton(implementation, v_idx):  # the Triton list kernels are triton_index.py's
        (blk_ptr, blk_col), (key_ptr, key_qblock), (bar_ptr, bar_col) = _triton_lists(
            v_idx, s_idx, layout, rank, seq_len
        )
    else:
        hit = slash_block_hits(s_idx, seq_len // BLOCK_SIZE, BLOCK_SIZE)  # [b, Hq, NB]
        query_blocks, source_blocks = block_tables(layout, rank, seq_len, v_idx.device)
        blk_ptr, blk_col = _block_lists(hit, query_blocks, source_blocks)
        key_ptr, key_qblock = block_lists_by_key(blk_ptr, blk_col, 0, blk_col.numel())
        bar_ptr, bar_col = _bar_lists(v_idx, hit, query_blocks, layout, seq_len)
    lists = (blk_ptr, blk_col, bar_ptr, bar_col, key_ptr, key_qblock)
    return BlockBarIndex(*lists, seq_len, layout.world_size, rank, layout, v_idx.shape[-1])


def convert_index_slow(v_idx: Tensor, s_idx: Tensor, layout: Layout, rank: int, seq_len: int) -> BlockBarIndex:
    """The same conversion as :func:`convert_index`, written as plain loops over the definitions.

    For tests only: O(W·b·Hq·nb²·|s_idx|) Python steps.
    """
    _check_inputs(v_idx, s_idx, layout, rank, seq_len)
    _check_contents(v_idx, s_idx, seq_len)
    batch, heads = v_idx.shape[:2]
    world = layout.world_size
    nb = seq_len // world // BLOCK_SIZE
    query_blocks, source_blocks, owner_local = block_and_position_tables(layout, rank, seq_len)

    blk_rows, bar_rows = [], []  # one list of columns per row (w, b, h, i)
    for w in range(world):
        for b in range(batch):
            for h in range(heads):
                slashes = [s for s in s_idx[b, h].tolist() if s < seq_len]
                verticals = [v for v in v_idx[b, h].tolist() if v < seq_len]

                def active(qb: int, kb: int) -> bool:
                    delta = qb - kb
                    if delta == 0:
                        return True
                    return delta > 0 and any((delta - 1) * BLOCK_SIZE < s < (delta + 1) * BLOCK_SIZE for s in slashes)

                for qb in query_blocks:
                    tiles = []
                    for j, kb in enumerate(source_blocks[w]):
                        if active(qb, kb):
                            tiles += [2 * j, 2 * j + 1]
                    blk_rows.append(tiles)
                    bars = []
                    for v in verticals:
                        owner, local = owner_local[v]
                        kb = v // BLOCK_SIZE
                        if owner == w and kb < qb and not active(qb, kb):
                            bars.append(local)
                    bar_rows.append(sorted(bars))

    shape = (world, batch, heads, nb)
    blk_ptr, blk_col = lists_of_rows(blk_rows, shape, v_idx.device)
    bar_ptr, bar_col = lists_of_rows(bar_rows, shape, v_idx.device)
    key_ptr, key_qblock = lists_of_rows(transposed_rows(blk_rows, shape), shape, v_idx.device)
    return BlockBarIndex(
        blk_ptr, blk_col, bar_ptr, bar_col, key_ptr, key_qblock, seq_len, world, rank, layout, v_idx.shape[-1]
    )


def block_and_position_tables(
    layout: Layout, rank: int, seq_len: int
) -> tuple[list[int], list[list[int]], dict[int, tuple[int, int]]]:
    """For the loop conversions: ``rank``'s global query blocks, every source's global key blocks, and
    global position → (source rank, local position)."""
    world = layout.world_size
    query_blocks = layout.global_blocks(seq_len, rank).tolist()
    source_blocks = [layout.global_blocks(seq_len, w).tolist() for w in range(world)]
    owner_local = {}
    for w in range(world):
        for local, position in enumerate(layout.global_positions(seq_len, w).tolist()):
            owner_local[position] = (w, local)
    return query_blocks, source_blocks, owner_local


def transposed_rows(blk_rows: list[list[int]], shape: tuple[int, int, int, int]) -> list[list[int]]:
    """The block lists by key from the block lists (one list of sub-tiles per row (w, b, h, i)): per row
    (w, b, h, j) the query blocks i whose row holds block j (sub-tiles 2j, 2j+1), ascending."""
    nb = shape[-1]
    by_key: list[list[int]] = []
    for group in range(len(blk_rows) // nb):
        rows = blk_rows[group * nb : (group + 1) * nb]
        by_key += [[i for i in range(nb) if 2 * j in rows[i]] for j in range(nb)]
    return by_key


def lists_of_rows(row_lists: list[list[int]], shape: tuple[int, int, int, int], device) -> tuple[Tensor, Tensor]:
    """CSR (ptr int32 ``[W, b, Hq, nb+1]``, col int32) from one Python list of columns per row (w, b, h, i)."""
    world, batch, heads, nb = shape
    ptr = [[[[0] * (nb + 1) for _ in range(heads)] for _ in range(batch)] for _ in range(world)]
    cols: list[int] = []
    row = 0
    for w in range(world):
        for b in range(batch):
            for h in range(heads):
                for i in range(nb):
                    ptr[w][b][h][i] = len(cols)
                    cols += row_lists[row]
                    row += 1
                ptr[w][b][h][nb] = len(cols)
    return (
        torch.tensor(ptr, dtype=torch.int32, device=device),
        torch.tensor(cols, dtype=torch.int32, device=device),
    )


def count_work(index: BlockBarIndex) -> tuple[Tensor, Tensor]:
    """Active 128-key blocks and bars per (source rank, b, Hq): two int64 ``[W, b, Hq]`` tensors."""
    nb = index.num_local_blocks
    blocks = (index.blk_ptr[..., nb] - index.blk_ptr[..., 0]).long() // 2
    bars = (index.bar_ptr[..., nb] - index.bar_ptr[..., 0]).long()
    return blocks, bars
