"""Document boundaries of packed sequences (mtraining_kernels.documents) against Megatron's and brute force."""

import random

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from mtraining_kernels.documents import Documents

EOD = 0


def random_tokens(rng: random.Random, batch: int, seq_len: int) -> torch.Tensor:
    """Token ids [b, N] in 0 … 4 with EOD = 0 (runs of consecutive EODs are common); sample 0 has EODs at
    positions 0 and N − 1, sample 1 none."""
    tokens = torch.tensor([[rng.randrange(5) for _ in range(seq_len)] for _ in range(batch)])
    tokens[0, 0] = tokens[0, -1] = EOD
    if batch > 1:
        tokens[1] = tokens[1].clamp(min=1)
    return tokens


def brute_force_views(starts: list[int], seq_len: int) -> tuple[list[int], list[int], list[int]]:
    """(doc_id, position_ids, lengths) of one sample, token by token."""
    doc_id, position_ids = [], []
    for i in range(seq_len):
        document = max(d for d, start in enumerate(starts) if start <= i)
        doc_id.append(document)
        position_ids.append(i - starts[document])
    lengths = [end - start for start, end in zip(starts, starts[1:] + [seq_len])]
    return doc_id, position_ids, lengths


@pytest.mark.parametrize("seq_len", [1, 2, 17, 96])
def test_from_eod_matches_megatron_reset_attention_mask_and_position_ids(seq_len, seed):
    tokens = random_tokens(random.Random(seed), 4, seq_len)
    documents = Documents.from_eod(tokens, EOD)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    same_document = documents.doc_id[:, :, None] == documents.doc_id[:, None, :]
    for sample in range(tokens.shape[0]):
        masked, _, position_ids = _get_ltor_masks_and_position_ids(
            tokens[sample],
            EOD,
            reset_position_ids=True,
            reset_attention_mask=True,
            eod_mask_loss=False,
            create_attention_mask=True,
        )
        message = f"seed={seed} sample={sample} tokens={tokens[sample].tolist()}"
        assert torch.equal(documents.position_ids[sample], position_ids), message
        assert torch.equal(same_document[sample] & causal, ~masked[0]), message


def test_an_eod_ends_its_document_and_a_final_eod_starts_nothing():
    documents = Documents.from_eod(torch.tensor([[EOD, 5, EOD, EOD, 7, EOD]]), EOD)
    assert documents.starts.tolist() == [[0, 1, 3, 4]] and documents.lengths.tolist() == [[1, 2, 1, 2]]
    assert documents.position_ids.tolist() == [[0, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize("seq_len", [1, 5, 64])
def test_constructors_agree(seq_len, seed):
    tokens = random_tokens(random.Random(seed), 3, seq_len)
    from_eod = Documents.from_eod(tokens, EOD)
    megatron_positions = torch.stack(
        [_get_ltor_masks_and_position_ids(row, EOD, True, True, False, False)[2] for row in tokens]
    )
    from_positions = Documents.from_position_ids(megatron_positions)
    assert torch.equal(from_eod.starts, from_positions.starts), f"seed={seed}"
    for sample in range(tokens.shape[0]):
        count = int(from_eod.num_documents[sample])
        starts = from_eod.starts[sample, :count]
        cu_seqlens = torch.cat([starts, torch.tensor([seq_len])]).int()
        from_cu = Documents.from_cu_seqlens(cu_seqlens, seq_len)
        assert torch.equal(from_cu.starts[0], starts), f"seed={seed} sample={sample}"
        assert torch.equal(from_cu.position_ids[0], from_eod.position_ids[sample]), f"seed={seed} sample={sample}"
    # the dataloader's batched form: every row padded with N to one width
    width = int(from_eod.num_documents.max()) + 3
    padded = torch.full((tokens.shape[0], width), seq_len, dtype=torch.int32)
    for sample in range(tokens.shape[0]):
        count = int(from_eod.num_documents[sample])
        padded[sample, :count] = from_eod.starts[sample, :count]
    from_padded = Documents.from_padded_cu_seqlens(padded, seq_len)
    assert torch.equal(from_padded.starts, from_eod.starts), f"seed={seed}"


def test_derived_views_equal_brute_force(seed):
    rng, seq_len = random.Random(seed), 50
    documents = Documents.from_eod(random_tokens(rng, 4, seq_len), EOD)
    assert documents.doc_id.dtype == torch.int32
    assert documents.lengths.dtype == documents.num_documents.dtype == documents.position_ids.dtype == torch.int64
    for sample in range(documents.batch_size):
        count = int(documents.num_documents[sample])
        starts = documents.starts[sample, :count].tolist()
        doc_id, position_ids, lengths = brute_force_views(starts, seq_len)
        message = f"seed={seed} sample={sample} starts={starts}"
        assert documents.starts[sample, count:].eq(seq_len).all(), message
        assert documents.doc_id[sample].tolist() == doc_id, message
        assert documents.position_ids[sample].tolist() == position_ids, message
        assert documents.lengths[sample].tolist() == lengths + [0] * (documents.max_documents - count), message
        assert int(documents.lengths[sample].sum()) == seq_len, message
    assert documents.host_spans.device.type == "cpu"
    assert torch.equal(documents.host_spans, torch.stack([documents.starts, documents.lengths], dim=-1))


def test_single_is_one_document_per_sample():
    documents = Documents.single(3, 40)
    assert documents.starts.tolist() == [[0]] * 3
    assert documents.lengths.tolist() == [[40]] * 3 and documents.num_documents.tolist() == [1] * 3
    assert documents.doc_id.eq(0).all() and torch.equal(documents.position_ids, torch.arange(40).expand(3, 40))


def test_one_token_documents_and_explicit_padding():
    documents = Documents(torch.tensor([[0, 1, 2, 3], [0, 3, 4, 4]], dtype=torch.int32), 4)
    assert documents.starts.dtype == torch.int64
    assert documents.lengths.tolist() == [[1, 1, 1, 1], [3, 1, 0, 0]]
    assert documents.position_ids.tolist() == [[0, 0, 0, 0], [0, 1, 2, 0]]
    assert documents.doc_id.tolist() == [[0, 1, 2, 3], [0, 0, 0, 1]]


@pytest.mark.parametrize(
    "starts, seq_len, match",
    [
        (torch.tensor([[0.0, 2.0]]), 4, "integer dtype.*torch.float32"),
        (torch.tensor([[True, False]]), 4, "integer dtype.*torch.bool"),
        (torch.tensor([0, 2]), 4, r"2-D integer tensor \[b, m_max\].*shape \(2,\)"),
        (torch.zeros(1, 0, dtype=torch.long), 4, r"must not be empty.*\(1, 0\)"),
        (torch.tensor([[0, 2]]), 0, "seq_len=0 must be a positive integer"),
        (torch.tensor([[0, 2]]), 4.0, "seq_len=4.0 must be a positive integer"),
        (torch.tensor([[0, 2], [3, 4]]), 8, r"starts\[1, 0\]=3: every sample's first document must start at 0"),
        (torch.tensor([[0, 9]]), 8, r"starts\[0, 1\]=9 is outside \[0, seq_len=8\)"),
        (torch.tensor([[0, -1]]), 8, r"starts\[0, 1\]=-1 is outside"),
        (torch.tensor([[0, 5, 3]]), 8, r"starts\[0\] = \[0, 5, 3\] is not strictly ascending at slot 2 \(3 after 5\)"),
        (torch.tensor([[0, 4, 4]]), 8, r"not strictly ascending at slot 2 \(4 after 4\)"),
        (torch.tensor([[0, 8, 4]]), 8, r"not strictly ascending at slot 2 \(4 after 8\).*pad with seq_len=8"),
    ],
)
def test_bad_starts_are_rejected(starts, seq_len, match):
    with pytest.raises(ValueError, match=match):
        Documents(starts, seq_len)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Documents.single(0, 8), "batch=0 must be a positive integer"),
        (lambda: Documents.from_eod(torch.tensor([[1.0, 0.0]]), 0), "tokens must have an integer dtype"),
        (lambda: Documents.from_eod(torch.tensor([1, 0]), 0), r"tokens must be a 2-D integer tensor \[b, N\]"),
        (lambda: Documents.from_eod(torch.tensor([[1, 0]]), 0.0), "eod_token=0.0 must be an integer token id"),
        (lambda: Documents.from_cu_seqlens(torch.tensor([0, 3, 6]), 8), "cu_seqlens ends at 6 but seq_len=8"),
        (lambda: Documents.from_cu_seqlens(torch.tensor([1, 3, 8]), 8), r"cu_seqlens=\[1, 3, 8\] must start with 0"),
        (lambda: Documents.from_cu_seqlens(torch.tensor([0]), 8), r"cu_seqlens=\[0\] must start with 0 and hold"),
        (
            lambda: Documents.from_cu_seqlens(torch.tensor([0, 3, 3, 8]), 8),
            r"cu_seqlens=\[0, 3, 3, 8\] is not strictly increasing at entry 2 \(3 after 3\)",
        ),
        (lambda: Documents.from_cu_seqlens(torch.tensor([0, 8, 8]), 8), "not strictly increasing at entry 2"),
        (lambda: Documents.from_cu_seqlens(torch.tensor([[0, 8]]), 8), r"cu_seqlens must be a 1-D integer tensor"),
        (lambda: Documents.from_cu_seqlens(torch.tensor([0.0, 8.0]), 8), "cu_seqlens must have an integer dtype"),
        (lambda: Documents.from_cu_seqlens(torch.tensor([0, 8]), -8), "seq_len=-8 must be a positive integer"),
        (
            lambda: Documents.from_padded_cu_seqlens(torch.tensor([[0, 3, 8, 8], [0, 5, 4, 8]]), 8),
            r"cu_seqlens\[1\]=\[0, 5, 4, 8\] must be 0, strictly increasing document ends and then 8",
        ),
        (lambda: Documents.from_padded_cu_seqlens(torch.tensor([[0, 3, 3, 8]]), 8), "strictly increasing"),
        (lambda: Documents.from_padded_cu_seqlens(torch.tensor([[0, 3, 6]]), 8), "and then 8"),
        (lambda: Documents.from_padded_cu_seqlens(torch.tensor([[1, 3, 8]]), 8), "must be 0, strictly"),
        (lambda: Documents.from_padded_cu_seqlens(torch.tensor([[0, 9, 8]]), 8), "must be 0, strictly"),
        (lambda: Documents.from_padded_cu_seqlens(torch.tensor([0, 8]), 8), r"cu_seqlens must be a 2-D integer"),
        (
            lambda: Documents.from_position_ids(torch.tensor([[0, 1, 2], [1, 2, 3]])),
            r"position_ids\[1, 0\]=1 should be 0",
        ),
        (
            lambda: Documents.from_position_ids(torch.tensor([[0, 1, 3, 0, 1]])),
            r"position_ids\[0, 2\]=3 should be 2",
        ),
        (lambda: Documents.from_position_ids(torch.tensor([[0.0, 1.0]])), "position_ids must have an integer dtype"),
    ],
)
def test_bad_constructor_inputs_are_rejected(build, match):
    with pytest.raises(ValueError, match=match):
        build()
