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
from .host_copies import to_device
from .index import (
    BlockBarIndex,
    block_and_position_tables,
    block_lists_by_key,
    block_tables,
    convert_index,
    csr_offsets,
    lists_of_bar_entries,
    lists_of_rows,
    transposed_rows,
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


def _candidate_ranges(documents: Documents, layout: Layout, rank: int) -> tuple[Tensor, Tensor]:
    """Host tables of the candidate key blocks: per (source w, sample b, local query block i), the position in
    w's blocks of the first key block of the document of i's first row (``low``) and how many of w's blocks
    lie from that block up to i's own (``counts``), int64 ``[W·b·nb]`` on the CPU, from ``host_spans``."""
    seq_len = documents.seq_len
    query_blocks, source_blocks = block_tables(layout, rank, seq_len, "cpu")
    world, nb = source_blocks.shape
    batch = documents.host_spans.shape[0]
    starts = documents.host_spans[..., 0].contiguous()  # [b, m_max], ascending; unused slots hold seq_len
    first_rows = (query_blocks * BLOCK_SIZE).expand(batch, nb).contiguous()
    document_start = starts.gather(1, torch.searchsorted(starts, first_rows, right=True) - 1)  # [b, nb]
    first_block = (document_start // BLOCK_SIZE).flatten().expand(world, batch * nb).contiguous()
    low = torch.searchsorted(source_blocks, first_block).view(world, batch, nb)
    high = torch.searchsorted(source_blocks, query_blocks.expand(world, nb).contiguous(), right=True)
    counts = (high.view(world, 1, nb) - low).clamp_(min=0)
    return low.flatten(), counts.flatten()


def _block_lists(documents: Documents, hit: Tensor, layout: Layout, rank: int) -> tuple[Tensor, Tensor]:
    """CSR block lists: (qb, kb) is listed iff kb ≤ qb, the document of qb's first row has columns in kb, and
    it is on there. Only the key blocks from that document's first to qb are candidates: a source's blocks
    ascend in local order in every layout, so they are one range of its local blocks per query block, sized on
    the host (no device sync). Transient: int64 ``[T]`` over the T candidates (w, b, i, j) and bool
    ``[T, Hq]``, T the sum over documents of about nb_d²/2, not the ``[W, b, Hq, nb, nb]`` of every block pair."""
    batch, _, heads, _ = hit.shape
    device = hit.device
    query_blocks, source_blocks = block_tables(layout, rank, documents.seq_len, device)
    world, nb = source_blocks.shape
    host_low, host_counts = _candidate_ranges(documents, layout, rank)
    total = int(host_counts.sum())
    low, counts = to_device(host_low, device), to_device(host_counts, device)
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=total)
    first_of_row = torch.cumsum(counts, 0) - counts
    block = low[row] + torch.arange(total, device=device) - first_of_row[row]  # position in the source's blocks
    source, sample, query = row // (batch * nb), row // nb % batch, row % nb
    first_document = documents.doc_id[:, query_blocks * BLOCK_SIZE].long()  # [b, nb]
    distance = query_blocks[query] - source_blocks[source, block]
    listed = hit[sample, first_document[sample, query], :, distance]  # [T, Hq]
    # entries in (h, w, b, i, j) order, then stably by (w, b): rows (w, b, h, i) with ascending j
    head, candidate = torch.nonzero(listed.T, as_tuple=True)
    group = row[candidate] // nb  # w·b + sample
    if world * batch > 1:
        order = torch.sort(group, stable=True).indices
        head, candidate, group = head[order], candidate[order], group[order]
    list_row = (group * heads + head) * nb + query[candidate]
    row_counts = torch.zeros(world * batch * heads * nb, dtype=torch.int64, device=device)
    row_counts.index_add_(0, list_row, torch.full_like(list_row, 2))
    col = torch.stack((2 * block[candidate], 2 * block[candidate] + 1), dim=1).view(-1).to(torch.int32)
    return csr_offsets(row_counts, (world, batch, heads, nb)), col


def _bar_lists(index: DocumentIndex, hit: Tensor, query_blocks: Tensor, layout: Layout) -> tuple[Tensor, Tensor]:
    """CSR bar lists: vertical v of document d is a bar of qb iff kb(v) < qb, d has rows in qb and d is off at
    (qb, kb(v)). Only the query blocks after kb(v) inside d are candidates, listed back to back: transient int64
    ``[C]`` over the C candidates of all valid verticals of all documents and heads (one host sync sizes it), so
    each vertical costs its own document's blocks after it, not the longest document's."""
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
    counts = (torch.searchsorted(ascending, last_block, right=True) - first).clamp_(min=0)
    total = int(counts.sum())
    of_vertical = torch.repeat_interleave(torch.arange(column.numel(), device=column.device), counts, output_size=total)
    position = torch.arange(total, device=column.device) + (first - torch.cumsum(counts, 0) + counts)[of_vertical]
    hit_row = ((sample * slots + document) * heads + head) * num_blocks - key_block  # hit at distance qb − kb
    candidate = torch.nonzero(~hit.view(-1)[ascending[position] + hit_row[of_vertical]]).squeeze(1)
    vertical = of_vertical[candidate]
    block = local_of_sorted[position[candidate]]
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
    blk_ptr, blk_col = _block_lists(documents, hit, layout, rank)
    query_blocks, _ = block_tables(layout, rank, seq_len, index.v_idx.device)
    bar_ptr, bar_col = _bar_lists(index, hit, query_blocks, layout)
    key_ptr, key_qblock = block_lists_by_key(blk_ptr, blk_col, 0, blk_col.numel())
    width = index.v_idx.shape[1] * index.v_idx.shape[3]
    lists = (blk_ptr, blk_col, bar_ptr, bar_col, key_ptr, key_qblock)
    return BlockBarIndex(*lists, seq_len, layout.world_size, rank, layout, width, doc_ids)


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
    key_ptr, key_qblock = lists_of_rows(transposed_rows(blk_rows, shape), shape, device)
    doc_ids = local_document_ids(documents, layout)
    width = index.v_idx.shape[1] * index.v_idx.shape[3]
    return BlockBarIndex(
        blk_ptr, blk_col, bar_ptr, bar_col, key_ptr, key_qblock, seq_len, world, rank, layout, width, doc_ids
    )
