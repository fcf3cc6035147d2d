"""Index conversion of packed documents (DESIGN.md §2.7): a :class:`DocumentIndex` → per-source-step lists.

Per sample b and query head h, on the global 128-token blocks: Dq(qb) and Dk(kb) are the documents with rows
in query block qb and with columns in key block kb. Document d is *on* at (qb, kb) if it is dense, or
qb == kb, or its own hit_d[qb − kb] (§2.1). The tile (qb, kb), kb ≤ qb, is listed iff some d in
Dq(qb) ∩ Dk(kb) is on there; every vertical v of a document d in Dq(qb) with kb(v) < qb and d not on at
(qb, kb(v)) is a bar of qb. The result is a :class:`BlockBarIndex` whose ``doc_ids`` carry the documents.

Why document ids are all the kernels need: documents are intervals, so for kb < qb a document common to
both blocks holds the last position of kb and the first of qb, and at most one can: doc(qb·B), when it
starts before (kb + 1)·B. An off-diagonal tile is listed only for that document, which is on there, so the
§2.7 token mask doc(i) == doc(j) ∧ (on_doc(j) ∨ j ∈ V) ∧ j ≤ i reduces to doc(i) == doc(j); on the diagonal
every document is on, which leaves doc(i) == doc(j) ∧ j ≤ i. A bar v of d is not in a listed tile (d, the
only common document, is off there) and is attended by the rows of d, i.e. doc(i) == doc(v). So the kernels
mask every listed score by doc(i) == doc(j), which changes something only where the query block or the key
block straddles a document boundary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .document_index import DocumentIndex
from .documents import Documents
from .index import (
    BlockBarIndex,
    block_and_position_tables,
    block_tables,
    convert_index,
    lists_of_active_blocks,
    lists_of_bar_entries,
    lists_of_rows,
)
from .layout import BLOCK_SIZE, Layout
from .vertical_slash import slash_block_hits


def _check_inputs(index: DocumentIndex, layout: Layout, rank: int) -> None:
    """Raise ``ValueError`` for any input the conversion cannot handle, before any work."""
    if not isinstance(index, DocumentIndex):
        raise ValueError(f"index must be a mtraining_kernels.DocumentIndex, got {type(index).__name__}")
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a mtraining_kernels.Layout, got {type(layout).__name__}")
    layout.validate(index.documents.seq_len, BLOCK_SIZE)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank!r} is outside [0, {layout.world_size}) for world_size={layout.world_size}")


def local_document_ids(documents: Documents, layout: Layout) -> Tensor | None:
    """The document of every position of each rank's chunk, local order: int32 ``[W, b, N_loc]``; None when
    every sample is one document (the index is then the unpacked one)."""
    if bool(((documents.host_spans[..., 1] > 0).sum(1) == 1).all()):  # the CPU copy: no device sync
        return None
    device = documents.doc_id.device
    positions = [layout.global_positions(documents.seq_len, w, device=device) for w in range(layout.world_size)]
    return torch.stack([documents.doc_id[:, p] for p in positions]).contiguous()


def _document_hits(index: DocumentIndex, num_blocks: int) -> Tensor:
    """Whether document d is on at block distance δ: bool ``[b, m_max, Hq, NB]`` (all true for dense documents)."""
    hit = slash_block_hits(index.s_idx, num_blocks, BLOCK_SIZE)
    return hit | ~index.sparse[:, :, None, None]


def _block_lists(
    documents: Documents, hit: Tensor, query_blocks: Tensor, source_blocks: Tensor
) -> tuple[Tensor, Tensor]:
    """CSR block lists: (qb, kb) is listed iff kb ≤ qb, the document of qb's first row has columns in kb, and
    it is on there. Transient: bool ``[b, Hq, nb, NB]`` hits of the query blocks' documents and
    ``[W, b, Hq, nb, nb]`` listed tiles."""
    batch, _, heads, num_blocks = hit.shape
    world, nb = source_blocks.shape
    first_document = documents.doc_id[:, query_blocks * BLOCK_SIZE].long()  # [b, nb]
    first_start = documents.starts.gather(1, first_document)  # [b, nb]
    samples = torch.arange(batch, device=hit.device)[:, None]
    query_hits = hit[samples, first_document].transpose(1, 2)  # [b, Hq, nb, NB]
    distance = query_blocks[None, :, None] - source_blocks[:, None, :]  # [W, nb, nb]
    by_distance = distance.clamp(min=0).permute(1, 0, 2).reshape(1, 1, nb, world * nb)
    on = query_hits.gather(-1, by_distance.expand(batch, heads, nb, world * nb)).view(batch, heads, nb, world, nb)
    shared = first_start[:, None, :, None] < (source_blocks[None, :, None, :] + 1) * BLOCK_SIZE  # [b, W, nb, nb]
    listed = on.permute(3, 0, 1, 2, 4) & (shared & (distance >= 0)).transpose(0, 1)[:, :, None]
    return lists_of_active_blocks(listed)


def _bar_lists(index: DocumentIndex, hit: Tensor, query_blocks: Tensor, layout: Layout) -> tuple[Tensor, Tensor]:
    """CSR bar lists: vertical v of document d is a bar of qb iff kb(v) < qb, d has rows in qb and d is off at
    (qb, kb(v)). Only the query blocks after kb(v) inside d are candidates: transient int64 ``[T, J]`` over the
    T valid verticals of all documents and heads, J ≤ nb the most such blocks of any vertical on this rank (one
    host sync), so short documents cost their own length, not the sequence's."""
    documents = index.documents
    seq_len = documents.seq_len
    batch, slots, heads, _ = index.v_idx.shape
    world, nb, num_blocks = layout.world_size, query_blocks.numel(), hit.shape[-1]
    sample, document, head, slot = torch.nonzero(index.v_idx < seq_len, as_tuple=True)
    column = index.v_idx[sample, document, head, slot].long()  # [T]
    owner, local = layout.to_local(column, seq_len)
    key_block = column // BLOCK_SIZE
    last_block = ((documents.starts + documents.lengths)[sample, document] - 1) // BLOCK_SIZE
    ascending, local_of_sorted = torch.sort(query_blocks)
    first = torch.searchsorted(ascending, key_block, right=True)  # candidates: ascending[first : stop]
    stop = torch.searchsorted(ascending, last_block, right=True)
    width = int((stop - first).max()) if column.numel() else 0
    position = first[:, None] + torch.arange(width, device=column.device)  # [T, J]
    inside = position < stop[:, None]
    position.clamp_(max=nb - 1)
    hit_row = ((sample * slots + document) * heads + head) * num_blocks - key_block  # hit at distance qb − kb
    on = hit.view(-1)[ascending[position].add_(hit_row[:, None]).clamp_(min=0)]  # right where inside
    vertical, candidate = torch.nonzero(inside.logical_and_(~on), as_tuple=True)
    block = local_of_sorted[position[vertical, candidate]]
    row = ((owner[vertical] * batch + sample[vertical]) * heads + head[vertical]) * nb + block  # over (w, b, h, i)
    return lists_of_bar_entries(row, local[vertical], (world, batch, heads, nb), seq_len // world)


def convert_document_index(index: DocumentIndex, layout: Layout, rank: int) -> BlockBarIndex:
    """Vectorised conversion of a packed ``index`` into ``rank``'s :class:`BlockBarIndex`, on the index's device.

    With one sparse document per sample the lists are those of :func:`mtraining_kernels.index.convert_index`
    on that document's index, which converts them (the Triton list kernels on CUDA), and ``doc_ids`` is None.
    Otherwise transient memory as in the two list builders (PyTorch ops only).
    """
    _check_inputs(index, layout, rank)
    documents, seq_len = index.documents, index.documents.seq_len
    doc_ids = local_document_ids(documents, layout)
    if doc_ids is None and index.every_document_sparse:  # the unpacked index, checked by DocumentIndex
        return convert_index(index.v_idx[:, 0], index.s_idx[:, 0], layout, rank, seq_len, check_contents=False)
    hit = _document_hits(index, seq_len // BLOCK_SIZE)
    query_blocks, source_blocks = block_tables(layout, rank, seq_len, index.v_idx.device)
    blk_ptr, blk_col = _block_lists(documents, hit, query_blocks, source_blocks)
    bar_ptr, bar_col = _bar_lists(index, hit, query_blocks, layout)
    width = index.v_idx.shape[1] * index.v_idx.shape[3]
    return BlockBarIndex(blk_ptr, blk_col, bar_ptr, bar_col, seq_len, layout.world_size, rank, layout, width, doc_ids)


def convert_document_index_slow(index: DocumentIndex, layout: Layout, rank: int) -> BlockBarIndex:
    """The §2.7 rule as plain loops over its sets Dq, Dk and the per-document on test; for tests only."""
    _check_inputs(index, layout, rank)
    documents, seq_len = index.documents, index.documents.seq_len
    batch, _, heads, _ = index.v_idx.shape
    world = layout.world_size
    nb = seq_len // world // BLOCK_SIZE
    query_blocks, source_blocks, owner_local = block_and_position_tables(layout, rank, seq_len)

    def documents_in(b: int, block: int) -> set[int]:
        return set(documents.doc_id[b, block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE].tolist())

    blk_rows, bar_rows = [], []  # one list of columns per row (w, b, h, i)
    for w in range(world):
        for b in range(batch):
            for h in range(heads):

                def is_on(d: int, qb: int, kb: int) -> bool:
                    if not index.sparse[b, d] or qb == kb:
                        return True
                    slashes = [s for s in index.s_idx[b, d, h].tolist() if s < seq_len]
                    return any((qb - kb - 1) * BLOCK_SIZE < s < (qb - kb + 1) * BLOCK_SIZE for s in slashes)

                for qb in query_blocks:
                    rows_of = documents_in(b, qb)
                    tiles = []
                    for j, kb in enumerate(source_blocks[w]):
                        if kb <= qb and any(is_on(d, qb, kb) for d in rows_of & documents_in(b, kb)):
                            tiles += [2 * j, 2 * j + 1]
                    blk_rows.append(tiles)
                    bars = []
                    for d in sorted(rows_of):
                        for v in index.v_idx[b, d, h].tolist():
                            if v < seq_len and owner_local[v][0] == w and v // BLOCK_SIZE < qb:
                                if not is_on(d, qb, v // BLOCK_SIZE):
                                    bars.append(owner_local[v][1])
                    bar_rows.append(sorted(bars))

    shape = (world, batch, heads, nb)
    device = index.v_idx.device
    blk_ptr, blk_col = lists_of_rows(blk_rows, shape, device)
    bar_ptr, bar_col = lists_of_rows(bar_rows, shape, device)
    doc_ids = local_document_ids(documents, layout)
    width = index.v_idx.shape[1] * index.v_idx.shape[3]
    return BlockBarIndex(blk_ptr, blk_col, bar_ptr, bar_col, seq_len, world, rank, layout, width, doc_ids)
