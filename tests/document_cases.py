"""Shared packed-document inputs of the tests (CPU and GPU): documents of given or random lengths and a
random valid per-document index (``DocumentIndex``)."""

from __future__ import annotations

import torch

from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import BLOCK_SIZE, Layout

MIN_SPARSE = 100  # documents shorter than this stay dense in random_document_index


def packed_documents(lengths: list[list[int]], seq_len: int) -> Documents:
    """Documents of the given lengths per sample (each row sums to ``seq_len``)."""
    width = max(len(row) for row in lengths)
    starts = [[sum(row[:d]) for d in range(len(row))] + [seq_len] * (width - len(row)) for row in lengths]
    return Documents(torch.tensor(starts), seq_len)


def random_lengths(generator: torch.Generator, seq_len: int) -> list[int]:
    """Document lengths summing to ``seq_len``: one-token documents, shorter than 64 and 128, exactly
    MIN_SPARSE, and long ones, in random order (so boundaries fall inside blocks and on rank boundaries)."""
    kinds = [lambda: 1, lambda: 2 + draw(61), lambda: 64 + draw(63), lambda: MIN_SPARSE, lambda: 129 + draw(400)]

    def draw(high: int) -> int:
        return int(torch.randint(0, high + 1, (1,), generator=generator))

    lengths: list[int] = []
    while sum(lengths) < seq_len:
        lengths.append(min(kinds[draw(len(kinds) - 1)](), seq_len - sum(lengths)))
    return lengths


def random_document_index(
    generator: torch.Generator, documents: Documents, heads: int, v_width: int = 24, s_width: int = 16
) -> DocumentIndex:
    """A valid random index per document of at least MIN_SPARSE tokens (the others dense). Per head a random
    number of verticals inside the document and of offsets below its length, with or without the forced
    sinks and window; slash candidates include exact multiples of 128 (one block only)."""
    seq_len = documents.seq_len
    sparse = documents.lengths >= MIN_SPARSE
    slots = (documents.batch_size, documents.max_documents, heads)
    v_idx = torch.full((*slots, v_width), seq_len, dtype=torch.int32)
    s_idx = torch.full((*slots, s_width), seq_len, dtype=torch.int32)

    def pick(pool: torch.Tensor, width: int) -> torch.Tensor:
        pool = pool.unique()
        count = int(torch.randint(0, min(width, pool.numel()) + 1, (1,), generator=generator))
        return pool[torch.randperm(pool.numel(), generator=generator)[:count]].sort().values

    for sample, document in sparse.nonzero().tolist():
        start, length = int(documents.starts[sample, document]), int(documents.lengths[sample, document])
        for head in range(heads):
            forced = bool(torch.randint(0, 2, (1,), generator=generator))
            verticals = torch.randint(0, length, (2 * v_width,), generator=generator)
            slashes = torch.cat(
                [
                    torch.randint(0, length, (s_width,), generator=generator),
                    torch.randint(0, (length - 1) // BLOCK_SIZE + 1, (1,), generator=generator) * BLOCK_SIZE,
                ]
            )
            if forced:
                verticals = torch.cat([torch.arange(min(30, length)), verticals])
                slashes = torch.cat([torch.arange(min(100, length)), slashes])
            chosen_v = pick(verticals, v_width) + start
            chosen_s = pick(slashes, s_width)
            v_idx[sample, document, head, : chosen_v.numel()] = chosen_v.to(torch.int32)
            s_idx[sample, document, head, : chosen_s.numel()] = chosen_s.to(torch.int32)
    return DocumentIndex(documents, sparse, v_idx, s_idx)


def packed_index_with_cross_document_bars(generator: torch.Generator, seq_len: int, heads: int):
    """A random packed index (sample 0: documents of 300 and 212 tokens, sample 1: random lengths) drawn until
    some bar is listed for a query block whose rows span two documents, so every kernel's document mask of
    bars matters (a random draw may have no verticals in the first document)."""
    for _ in range(50):
        documents = packed_documents([[300, seq_len - 300], random_lengths(generator, seq_len)], seq_len)
        index = random_document_index(generator, documents, heads=heads)
        lists = convert_document_index(index, Layout("contiguous", 1), 0)
        nb, doc_ids = lists.num_local_blocks, lists.doc_ids[0]  # doc_ids [b, N]
        per_row = (lists.bar_ptr[0, ..., 1:] - lists.bar_ptr[0, ..., :-1]).reshape(-1)  # rows (z, h, i)
        rows = torch.repeat_interleave(torch.arange(per_row.numel()), per_row.long())
        sample, qblock = rows // (heads * nb), rows % nb
        block_docs = doc_ids.view(doc_ids.shape[0], nb, -1)[sample, qblock]  # [bars, 128]
        column_docs = doc_ids[sample, lists.bar_col.long()]
        if (block_docs != column_docs[:, None]).any():
            return index
    raise AssertionError("no draw of 50 had a bar across documents")
