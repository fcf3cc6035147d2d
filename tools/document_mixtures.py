"""Packed document mixtures and their per-document vertical-slash indices, benchmark inputs (PACKED.md).

Generators of :class:`mtraining_kernels.documents.Documents` for ``b`` samples of N tokens, and
:func:`realistic_document_index`, the §2.3 simulation pattern of ``realistic_pattern`` drawn per document, and
:func:`budget_document_index`, the attention benchmark's fixed-sparsity pattern drawn per document.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from bench_attention import budget_pattern
from realistic_pattern import realistic_pattern

from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import BLOCK_SIZE

PROLONG_REFERENCE_LENGTH = 128 * 1024
PROLONG_LONG_MIN = 64 * 1024
PROLONG_SHORT_RANGE = (1024, 32 * 1024)


def _documents_from_lengths(samples: list[list[int]], seq_len: int) -> Documents:
    """Documents of the per-sample document lengths (each list sums to ``seq_len``)."""
    slots = max(len(lengths) for lengths in samples)
    starts = torch.full((len(samples), slots), seq_len, dtype=torch.int64)
    for row, lengths in enumerate(samples):
        if sum(lengths) != seq_len or min(lengths) < 1:
            raise ValueError(f"document lengths {lengths} must be positive and sum to seq_len={seq_len}")
        starts[row, : len(lengths)] = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    return Documents(starts, seq_len)


def _log_uniform(generator: torch.Generator, low: int, high: int) -> int:
    """An integer drawn log-uniformly in [low, high]."""
    draw = math.exp(math.log(low) + torch.rand((), generator=generator).item() * (math.log(high) - math.log(low)))
    return min(high, max(low, round(draw)))


def prolong_like(seq_len: int, batch: int = 1, seed: int = 0) -> Documents:
    """ProLong-like mixture: half the tokens (⌊N/2⌋) from documents ≥ 64K, the rest from 1K–32K documents.

    Long lengths are drawn log-uniformly in [64K, remaining long tokens], a draw leaving fewer than 64K
    taking them all, so every long document is ≥ 64K. Short lengths are drawn log-uniformly in [1K, 32K]
    until the rest is filled, the last short document cut to fit (it may be shorter than 1K). The
    documents of a sample are then shuffled. Below N = 128K all thresholds scale by N / 128K (64K → N/2,
    1K–32K → N/128 … N/4, at least 1 token), so there is one long document of N/2 tokens. Seeded.
    """
    if seq_len < 2 or batch < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 2 and batch={batch} >= 1")
    scale = min(1.0, seq_len / PROLONG_REFERENCE_LENGTH)
    long_min = max(1, int(PROLONG_LONG_MIN * scale))
    short_low, short_high = (max(1, int(length * scale)) for length in PROLONG_SHORT_RANGE)
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(batch):
        lengths, remaining = [], seq_len // 2
        while remaining:
            length = _log_uniform(generator, long_min, remaining)
            length = remaining if remaining - length < long_min else length
            lengths.append(length)
            remaining -= length
        remaining = seq_len - seq_len // 2
        while remaining:
            length = min(remaining, _log_uniform(generator, short_low, short_high))
            lengths.append(length)
            remaining -= length
        order = torch.randperm(len(lengths), generator=generator).tolist()
        samples.append([lengths[i] for i in order])
    return _documents_from_lengths(samples, seq_len)


def uniform(seq_len: int, length: int, batch: int = 1) -> Documents:
    """Documents of ``length`` tokens each (the last cut to fit when ``length`` does not divide N)."""
    if length < 1 or batch < 1:
        raise ValueError(f"length={length} and batch={batch} must be >= 1")
    lengths = [length] * (seq_len // length) + ([seq_len % length] if seq_len % length else [])
    return _documents_from_lengths([lengths] * batch, seq_len)


def single(seq_len: int, batch: int = 1) -> Documents:
    """One document spanning each sample."""
    return Documents.single(batch, seq_len)


# the mixtures of PACKED.md by name: (N, seed) → Documents of one sample
MIXTURES = {
    "prolong": lambda seq_len, seed: prolong_like(seq_len, seed=seed),
    "uniform4k": lambda seq_len, seed: uniform(seq_len, 4096),
    "single": lambda seq_len, seed: single(seq_len),
}


def per_document_index(
    documents: Documents,
    heads: int,
    min_sparse_length: int,
    pattern: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
) -> DocumentIndex:
    """A :class:`DocumentIndex` with ``Hq = heads`` from one pattern per document of ≥ ``min_sparse_length`` tokens.

    ``pattern(length, ordinal)`` gives the k-th sparse document (sample-major, ``ordinal`` = k) its lists in
    document coordinates, ``v_idx [1, heads, V]`` and ``s_idx [1, heads, S]`` padded with ``length``; its
    verticals move by the document's start. Shorter documents are dense.
    """
    seq_len = documents.seq_len
    sparse = documents.lengths >= min_sparse_length
    patterns = {}  # (sample, document) → (v_idx [heads, V_d], s_idx [heads, S_d]) in global coordinates
    for ordinal, (sample, document) in enumerate(sparse.nonzero().tolist()):
        start, length = int(documents.starts[sample, document]), int(documents.lengths[sample, document])
        v_idx, s_idx = (x.cpu() for x in pattern(length, ordinal))
        patterns[sample, document] = (
            torch.where(v_idx[0] < length, v_idx[0] + start, seq_len),
            torch.where(s_idx[0] < length, s_idx[0], seq_len),
        )
    slots = (documents.batch_size, documents.max_documents, heads)
    v_width = max((v.shape[-1] for v, _ in patterns.values()), default=1)
    s_width = max((s.shape[-1] for _, s in patterns.values()), default=1)
    v_idx = torch.full((*slots, v_width), seq_len, dtype=torch.int32)
    s_idx = torch.full((*slots, s_width), seq_len, dtype=torch.int32)
    for (sample, document), (verticals, slashes) in patterns.items():
        v_idx[sample, document, :, : verticals.shape[-1]] = verticals
        s_idx[sample, document, :, : slashes.shape[-1]] = slashes
    return DocumentIndex(documents, sparse, v_idx, s_idx)


def realistic_document_index(
    documents: Documents,
    heads: int,
    *,
    min_sparse_length: int,
    sinks: int = 30,
    window: int = 100,
    far_slashes: int = 1000,
    far_verticals: int = 1000,
    seed: int = 0,
) -> DocumentIndex:
    """The realistic pattern per document: a :class:`DocumentIndex` with ``Hq = heads``.

    A document of L ≥ ``min_sparse_length`` tokens starting at o gets ``realistic_pattern(L, ...)``, its
    verticals shifted by o: sinks o … o + sinks − 1, window offsets 0 … window − 1, and
    round(far · L / N) random distant verticals inside the document and slashes below L, so every document
    has the density an unpacked sequence of N tokens has with ``far_slashes`` / ``far_verticals``. Shorter
    documents are dense. The k-th sparse document (sample-major) draws with seed ``seed + k``, so one
    document spanning the sequence is exactly ``realistic_pattern(N, heads, seed=seed)``.
    """
    if min_sparse_length < max(sinks, window, 1):
        raise ValueError(
            f"min_sparse_length={min_sparse_length} must be >= max(sinks={sinks}, window={window}, 1): a sparse "
            "document holds its sinks and its window offsets"
        )
    seq_len = documents.seq_len

    def pattern(length: int, ordinal: int) -> tuple[torch.Tensor, torch.Tensor]:
        return realistic_pattern(
            length,
            heads,
            sinks=sinks,
            window=window,
            far_slashes=min(round(far_slashes * length / seq_len), length - window),
            far_verticals=min(round(far_verticals * length / seq_len), length - sinks),
            seed=seed + ordinal,
        )

    return per_document_index(documents, heads, min_sparse_length, pattern)


def budget_document_index(
    documents: Documents, heads: int, *, sparsity: float, min_sparse_length: int, seed: int = 0, device="cpu"
) -> DocumentIndex:
    """``bench_attention.budget_pattern`` per document: a :class:`DocumentIndex` with ``Hq = heads``.

    A document of L ≥ ``min_sparse_length`` tokens gets the attention benchmark's pattern of L tokens
    (30 sinks, L/128 random verticals up to 4096, the 100-offset window and as many random slashes as keep
    its mask sparsity ≥ ``sparsity``; a short document's forced entries alone may be denser); shorter ones
    are dense. The k-th sparse document draws from seed ``seed + k``, so one document spanning the sequence
    is the attention benchmark's pattern of N tokens. ``device`` runs the calibration; the index is on the CPU.
    """

    def pattern(length: int, ordinal: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed + ordinal)
        whole_blocks = -(-length // BLOCK_SIZE) * BLOCK_SIZE  # the pattern's calibration needs whole blocks
        v_idx, s_idx, _ = budget_pattern(1, heads, whole_blocks, sparsity, device, generator)
        return v_idx, s_idx  # entries >= length are padding to per_document_index

    return per_document_index(documents, heads, min_sparse_length, pattern)


def reorder_documents(doc_index: DocumentIndex, sample: int, order: list[int]) -> DocumentIndex:
    """Sample ``sample`` of ``doc_index`` with its documents packed in ``order`` (document slots), as a one-sample
    index: each document keeps its own pattern, its verticals moved with its start (slashes are offsets and
    do not move). For the balance analysis of where documents land, patterns held fixed."""
    documents = doc_index.documents
    count = int(documents.num_documents[sample])
    if sorted(order) != list(range(count)):
        raise ValueError(f"order {order} must be a permutation of the sample's {count} document slots")
    seq_len = documents.seq_len
    slots = torch.tensor(order)
    lengths = documents.lengths[sample, slots]
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    shift = (starts - documents.starts[sample, slots]).to(torch.int32)[:, None, None]
    v_idx = doc_index.v_idx[sample, slots]
    moved = torch.where(v_idx < seq_len, v_idx + shift, seq_len).to(torch.int32)
    sparse, s_idx = doc_index.sparse[sample, slots], doc_index.s_idx[sample, slots]
    return DocumentIndex(Documents(starts[None], seq_len), sparse[None], moved[None], s_idx[None])
