"""Megatron indexed datasets of packed document mixtures (PACKED.md), the training data of ``bench_e2e --mixtures``.

:func:`write_mixture_dataset` writes ``prefix``.bin/.idx (``megatron.core.datasets.indexed_dataset``): ``sequences``
entries, each exactly one training sequence of N = sum(lengths) tokens holding the documents of ``lengths`` in
order, every document's last token the tokenizer's EOD and no other EOD. Megatron's ``GPTDataset`` shuffles
whole entries and cuts sample k at tokens [k·N, (k + 1)·N] of their concatenation (N tokens plus the next
entry's first as the last label), so with entries of N tokens every sample's tokens are exactly one entry and,
with ``--reset-attention-mask``, its documents are exactly ``lengths`` (an EOD ends the document it belongs to).
:func:`read_document_lengths` reads a dataset back the same way.
"""

from __future__ import annotations

from pathlib import Path

import numpy

# the mixtures bench_e2e and bench_ring learn: "none" (unpacked, one document without EOD) and PACKED.md's
UNPACKED = "none"


def mixture_names() -> tuple[str, ...]:
    """``none`` and the names of ``document_mixtures.MIXTURES``."""
    from document_mixtures import MIXTURES

    return (UNPACKED, *MIXTURES)


def mixture_lengths(name: str, seq_len: int, seed: int = 0) -> list[int]:
    """The document lengths of one sequence of ``seq_len`` tokens of mixture ``name`` (seeded)."""
    from document_mixtures import MIXTURES

    if name not in MIXTURES:
        raise ValueError(f"mixture {name!r} is unknown; use one of {', '.join(MIXTURES)}")
    documents = MIXTURES[name](seq_len, seed)
    return documents.lengths[0, : int(documents.num_documents[0])].tolist()


def mask_area(lengths: list[int]) -> float:
    """The document-causal area over the causal area of the whole sequence, sum(L_d²) / N² (1 for one document):
    the attention FLOPs of the mixture's dense baseline relative to an unpacked sequence's."""
    seq_len = sum(lengths)
    return sum(length * length for length in lengths) / (seq_len * seq_len)


def write_mixture_dataset(prefix: str | Path, lengths: list[int], sequences: int, eod: int, seed: int = 0) -> None:
    """``sequences`` entries of the documents ``lengths``: random token ids in [0, eod), each document ending
    with ``eod``. Token ids must fit int32; ``eod`` must be the largest id that may appear (NullTokenizer's)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    if sequences < 1 or not lengths or min(lengths) < 1:
        raise ValueError(f"sequences={sequences} must be >= 1 and lengths={lengths} positive")
    if not 0 < eod < 2**31:
        raise ValueError(f"eod={eod} must be in (0, 2^31): token ids are int32 and drawn below it")
    ends = numpy.cumsum(lengths) - 1
    rng = numpy.random.default_rng(seed)
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.int32)
    for _ in range(sequences):
        tokens = rng.integers(0, eod, size=sum(lengths), dtype=numpy.int32)
        tokens[ends] = eod
        builder.add_document(tokens, [tokens.size])
    builder.finalize(get_idx_path(prefix))


def read_document_lengths(prefix: str | Path, eod: int) -> list[list[int]]:
    """Each entry's document lengths as ``--reset-attention-mask`` draws them (a document ends at each EOD; tokens
    after the last EOD form one more document)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    result = []
    for entry in range(len(dataset)):
        tokens = numpy.asarray(dataset[entry])
        ends = [*(numpy.flatnonzero(tokens == eod) + 1).tolist()]
        if not ends or ends[-1] != tokens.size:
            ends.append(tokens.size)
        result.append(numpy.diff([0, *ends]).tolist())
    return result
