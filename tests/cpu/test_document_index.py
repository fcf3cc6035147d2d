"""Per-document vertical-slash indices of packed sequences (mtraining_kernels.document_index) and their oracle mask."""

import pytest
import torch

from mtraining_kernels.budget import StaticBudget, StaticHeadBudgets, TopPBudget
from mtraining_kernels.document_index import DocumentIndex, estimate_document_index
from mtraining_kernels.documents import Documents
from mtraining_kernels.estimation import estimate_vertical_slash, list_widths, resolve_budget
from mtraining_kernels.reference import packed_vertical_slash_mask, reference_sparse_attention, vertical_slash_mask

SEQ_LEN, Q_HEADS, KV_HEADS, DIM = 512, 4, 2, 16
MIN_SPARSE = 100  # max(last_q 64, sink_tokens 30, local_window 100)
# sample 0: a long document, a short one, two that straddle blocks and are shorter than the static budget
# below, and one of exactly MIN_SPARSE; sample 1: one dense document of MIN_SPARSE − 1 and three sparse ones, two
# as long as sample 0's third (one batched estimation holds the documents of one length)
LENGTHS = [[200, 40, 150, 22, MIN_SPARSE], [MIN_SPARSE - 1, 150, 150, 113]]
BUDGETS = {
    "static": StaticBudget(v_size=160, s_size=180),
    "per-head static": StaticHeadBudgets(torch.tensor([64, 160, 300, 100]), torch.tensor([100, 200, 120, 400])),
    "top-p": TopPBudget(p=0.9, cap=256),
    "top-p block diagonals": TopPBudget(p=0.5, cap=128, block_slashes=True),
}


def packed_documents(lengths: list[list[int]], seq_len: int = SEQ_LEN) -> Documents:
    """Documents of the given lengths per sample (each row sums to ``seq_len``)."""
    width = max(len(row) for row in lengths)
    starts = [[sum(row[:d]) for d in range(len(row))] + [seq_len] * (width - len(row)) for row in lengths]
    return Documents(torch.tensor(starts), seq_len)


def random_qk(seed: int, batch: int = 2, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, Q_HEADS, DIM, generator=generator)
    k = torch.randn(batch, seq_len, KV_HEADS, DIM, generator=generator)
    return q, k


def clamped_to(budget, length: int):
    """The budget a document of ``length`` tokens gets, written out independently of the library."""
    if isinstance(budget, StaticBudget):
        return StaticBudget(min(budget.v_size, length), min(budget.s_size, length))
    if isinstance(budget, StaticHeadBudgets):
        return StaticHeadBudgets(budget.v_size.clamp(max=length), budget.s_size.clamp(max=length))
    return budget


@pytest.mark.parametrize("kind", sorted(BUDGETS))
def test_one_document_equals_unpacked_bitwise(kind, seed):
    q, k = random_qk(seed)
    unpacked = estimate_vertical_slash(q, k, BUDGETS[kind])
    index, clamped = estimate_document_index(q, k, Documents.single(2, SEQ_LEN), BUDGETS[kind], min_sparse_length=128)
    assert index.sparse.all() and clamped == 0, f"seed={seed}"
    assert torch.equal(index.v_idx[:, 0], unpacked.v_idx), f"seed={seed} {kind}"
    assert torch.equal(index.s_idx[:, 0], unpacked.s_idx), f"seed={seed} {kind}"


@pytest.mark.parametrize("kind", sorted(BUDGETS))
def test_each_document_equals_its_own_unpacked_estimate_shifted(kind, seed):
    q, k = random_qk(seed)
    documents = packed_documents(LENGTHS)
    index, _ = estimate_document_index(q, k, documents, BUDGETS[kind], min_sparse_length=MIN_SPARSE)
    for sample, row in enumerate(LENGTHS):
        for document, length in enumerate(row):
            if length < MIN_SPARSE:
                continue
            start = sum(row[:document])
            alone = estimate_vertical_slash(
                q[sample : sample + 1, start : start + length],
                k[sample : sample + 1, start : start + length],
                clamped_to(BUDGETS[kind], length),
            )
            message = f"seed={seed} {kind} sample={sample} document={document}"
            for got, own, shift, counts in (
                (index.v_idx, alone.v_idx, start, alone.v_cnt),
                (index.s_idx, alone.s_idx, 0, alone.s_cnt),
            ):
                for head in range(Q_HEADS):
                    count = int(counts[0, head])
                    expected = own[0, head, :count].tolist()
                    assert [x - shift for x in got[sample, document, head, :count].tolist()] == expected, message
                    assert got[sample, document, head, count:].eq(SEQ_LEN).all(), message
    widths = list_widths(resolve_budget(BUDGETS[kind], Q_HEADS, SEQ_LEN, 30, 100), SEQ_LEN)
    assert (index.v_idx.shape[-1], index.s_idx.shape[-1]) == widths, f"seed={seed} {kind}: the whole sequence's widths"


def test_short_documents_are_dense_and_static_clamping_is_counted(seed):
    q, k = random_qk(seed)
    index, clamped = estimate_document_index(
        q, k, packed_documents(LENGTHS), BUDGETS["static"], min_sparse_length=MIN_SPARSE
    )
    assert index.sparse.tolist() == [[True, False, True, False, True], [False, True, True, True, False]]
    assert clamped == 5, f"seed={seed}: the documents of 150 (three), 100 and 113 tokens are shorter than (160, 180)"
    dense = ~index.sparse
    assert index.v_idx[dense].eq(SEQ_LEN).all() and index.s_idx[dense].eq(SEQ_LEN).all(), f"seed={seed}"
    _, top_p_clamped = estimate_document_index(
        q, k, packed_documents(LENGTHS), BUDGETS["top-p"], min_sparse_length=MIN_SPARSE
    )
    assert top_p_clamped == 0, f"seed={seed}: a top-P cap is a ceiling, never clamped"


def test_no_sparse_document_keeps_the_budget_widths_all_padding(seed):
    q, k = random_qk(seed)
    index, clamped = estimate_document_index(
        q, k, packed_documents(LENGTHS), BUDGETS["static"], min_sparse_length=SEQ_LEN + 1
    )
    assert not index.sparse.any() and clamped == 0
    assert index.v_idx.shape == (2, 5, Q_HEADS, 192) and index.s_idx.shape == (2, 5, Q_HEADS, 192)
    assert index.v_idx.eq(SEQ_LEN).all() and index.s_idx.eq(SEQ_LEN).all()


def test_packed_mask_of_one_document_equals_unpacked_mask(seed):
    q, k = random_qk(seed)
    unpacked = estimate_vertical_slash(q, k, BUDGETS["top-p"])
    index, _ = estimate_document_index(
        q, k, Documents.single(2, SEQ_LEN), BUDGETS["top-p"], min_sparse_length=MIN_SPARSE
    )
    expected = vertical_slash_mask(unpacked.v_idx, unpacked.s_idx, SEQ_LEN)
    assert torch.equal(packed_vertical_slash_mask(index), expected), f"seed={seed}"


@pytest.mark.parametrize("kind", sorted(BUDGETS))
def test_packed_mask_stays_inside_documents_with_per_document_forced_entries(kind, seed):
    q, k = random_qk(seed)
    documents = packed_documents(LENGTHS)
    index, _ = estimate_document_index(q, k, documents, BUDGETS[kind], min_sparse_length=MIN_SPARSE)
    mask = packed_vertical_slash_mask(index)
    same_document = documents.doc_id[:, None, :, None] == documents.doc_id[:, None, None, :]
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
    assert not (mask & ~(same_document & causal)).any(), f"seed={seed} {kind}: a pair across documents or acausal"
    for sample, row in enumerate(LENGTHS):
        for document, length in enumerate(row):
            start = sum(row[:document])
            block = mask[sample, :, start : start + length, start : start + length]
            own_causal = causal[:length, :length]
            message = f"seed={seed} {kind} sample={sample} document={document}"
            if length < MIN_SPARSE:
                assert block.eq(own_causal).all(), message + ": a short document is dense-causal"
                continue
            sinks = min(30, length)
            assert block[:, :, :sinks].eq(own_causal[:, :sinks]).all(), message + ": the document's own sinks"
            offsets = torch.arange(length)[:, None] - torch.arange(length)[None, :]
            window = (offsets >= 0) & (offsets < 100)
            assert block[:, window].all(), message + ": the local window"


def test_packed_attention_on_each_document_equals_attending_it_alone(seed):
    q, k = random_qk(seed)
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    documents = packed_documents(LENGTHS)
    index, _ = estimate_document_index(q, k, documents, BUDGETS["static"], min_sparse_length=MIN_SPARSE)
    mask = packed_vertical_slash_mask(index)
    q, k = q.double(), k.double()
    out, lse = reference_sparse_attention(q, k, v, mask)
    for sample, row in enumerate(LENGTHS):
        for document, length in enumerate(row):
            rows = slice(sum(row[:document]), sum(row[: document + 1]))
            alone_out, alone_lse = reference_sparse_attention(
                q[sample : sample + 1, rows],
                k[sample : sample + 1, rows],
                v[sample : sample + 1, rows],
                mask[sample : sample + 1, :, rows, rows],
            )
            message = f"seed={seed} sample={sample} document={document}"
            torch.testing.assert_close(out[sample, rows], alone_out[0], rtol=1e-12, atol=1e-12, msg=message)
            torch.testing.assert_close(lse[sample, :, rows], alone_lse[0], rtol=1e-12, atol=1e-12, msg=message)


# ------------------------------------------------------------------------------------------------ validation
def valid_parts():
    """A small valid index: N = 16, documents of 8, 4 and 4 tokens, the first and last sparse, two heads."""
    documents = Documents(torch.tensor([[0, 8, 12]]), 16)
    sparse = torch.tensor([[True, False, True]])
    v_idx = torch.tensor([[[[0, 3], [1, 16]], [[16, 16], [16, 16]], [[12, 15], [16, 16]]]], dtype=torch.int32)
    s_idx = torch.tensor([[[[0, 1], [0, 7]], [[16, 16], [16, 16]], [[0, 3], [0, 16]]]], dtype=torch.int32)
    return documents, sparse, v_idx, s_idx


def with_entry(lists: torch.Tensor, where: tuple, value: int) -> torch.Tensor:
    changed = lists.clone()
    changed[where] = value
    return changed


def test_a_valid_index_is_accepted():
    documents, sparse, v_idx, s_idx = valid_parts()
    assert DocumentIndex(documents, sparse, v_idx, s_idx).num_heads == 2


@pytest.mark.parametrize(
    "part, change, match",
    [
        ("documents", lambda d: d.starts, "documents must be a Documents, got Tensor"),
        ("sparse", lambda s: s.int(), "sparse must be a bool tensor"),
        ("sparse", lambda s: s[:, :2], r"sparse has shape \(1, 2\) but the documents have \[b, m_max\]=\(1, 3\)"),
        ("sparse", lambda s: torch.ones_like(s), None),  # a sparse document with empty lists is fine
        ("v_idx", lambda v: v.long(), "v_idx must be an int32 tensor"),
        ("v_idx", lambda v: v[0], r"v_idx must be an int32 tensor \[b, m_max, Hq, width\]"),
        ("v_idx", lambda v: v[:, :2], r"v_idx has shape \(1, 2, 2, 2\)"),
        ("s_idx", lambda s: s[..., :0], r"s_idx has shape \(1, 3, 2, 0\).*non-empty list"),
        ("s_idx", lambda s: s[:, :, :1], "v_idx has Hq=2 heads but s_idx has 1"),
        ("v_idx", lambda v: with_entry(v, (0, 0, 1, 1), 8), r"v_idx\[0, 0, 1, 1\]=8 is not allowed.*\[0, 8\)"),
        ("v_idx", lambda v: with_entry(v, (0, 2, 0, 0), 11), r"v_idx\[0, 2, 0, 0\]=11 .*\[12, 16\)"),
        ("v_idx", lambda v: with_entry(v, (0, 1, 0, 0), 9), r"v_idx\[0, 1, 0, 0\]=9 .*document 1 of sample 0 is dense"),
        ("v_idx", lambda v: with_entry(v, (0, 0, 0, 1), 17), r"v_idx\[0, 0, 0, 1\]=17 is not allowed.*N=16"),
        ("v_idx", lambda v: with_entry(v, (0, 0, 0, 0), -1), r"v_idx\[0, 0, 0, 0\]=-1 is not allowed"),
        ("v_idx", lambda v: with_entry(v, (0, 0, 0, 0), 3), r"v_idx\[0, 0, 0\] = \[3, 3\] is not strictly ascending"),
        ("v_idx", lambda v: with_entry(v, (0, 0, 0, 0), 16), r"v_idx\[0, 0, 0\] = \[16, 3\] is not strictly ascending"),
        ("s_idx", lambda s: with_entry(s, (0, 2, 0, 1), 4), r"s_idx\[0, 2, 0, 1\]=4 is not allowed.*\[0, 4\)"),
        ("s_idx", lambda s: with_entry(s, (0, 0, 1, 1), 0), r"s_idx\[0, 0, 1\] = \[0, 0\] is not strictly ascending"),
    ],
)
def test_bad_index_parts_are_rejected(part, change, match):
    parts = dict(zip(("documents", "sparse", "v_idx", "s_idx"), valid_parts()))
    parts[part] = change(parts[part])
    if match is None:
        DocumentIndex(**parts)
        return
    with pytest.raises(ValueError, match=match):
        DocumentIndex(**parts)


def test_sparse_unused_slot_is_rejected():
    documents = Documents(torch.tensor([[0, 8, 12], [0, 16, 16]]), 16)
    lists = torch.full((2, 3, 1, 1), 16, dtype=torch.int32)
    sparse = torch.tensor([[False, False, False], [True, True, False]])
    with pytest.raises(ValueError, match=r"sparse\[1, 1\] is True but sample 1 has only 1 documents"):
        DocumentIndex(documents, sparse, lists, lists)


@pytest.mark.parametrize(
    "keywords, match",
    [
        (dict(min_sparse_length=99), r"min_sparse_length=99 must be an integer >= max\(last_q=64, sink_tokens=30, "),
        (dict(min_sparse_length=63, local_window=64, last_q=32), r"min_sparse_length=63 .*local_window=64, 1\) = 64"),
        (dict(min_sparse_length=63, local_window=10), r"min_sparse_length=63 .*last_q=64.*= 64"),
        (dict(min_sparse_length=100.0), r"min_sparse_length=100.0 must be an integer"),
        (dict(min_sparse_length=True), r"min_sparse_length=True must be an integer"),
        (dict(min_sparse_length=128, last_q=65), "last_q=65 must be an integer in"),
    ],
)
def test_bad_estimation_settings_are_rejected(keywords, match):
    q, k = random_qk(0, batch=1)
    with pytest.raises(ValueError, match=match):
        estimate_document_index(q, k, Documents.single(1, SEQ_LEN), BUDGETS["static"], **keywords)


def test_documents_of_another_batch_are_rejected():
    q, k = random_qk(0, batch=1)
    with pytest.raises(ValueError, match=r"q has \[b, N\]=\(1, 512\) but the documents describe \(2, 512\)"):
        estimate_document_index(q, k, Documents.single(2, SEQ_LEN), BUDGETS["static"], min_sparse_length=128)


def test_a_budget_must_fit_the_whole_sequence():
    q, k = random_qk(0, batch=1)
    with pytest.raises(ValueError, match="v_size=600 is larger than the sequence"):
        estimate_document_index(
            q, k, packed_documents([[256, 256]]), StaticBudget(600, 200), min_sparse_length=MIN_SPARSE
        )


def test_strided_q_and_k_give_the_index_of_contiguous_ones(seed):
    """Several documents of one length gather their rows from q/k that are permuted views (Megatron's
    sequence-first storage, as the attention layer hands them), with the index of contiguous copies."""
    q, k = random_qk(seed)
    q_view, k_view = q.transpose(0, 1).contiguous().transpose(0, 1), k.transpose(0, 1).contiguous().transpose(0, 1)
    assert not q_view.is_contiguous() and not k_view.is_contiguous()
    documents = packed_documents(LENGTHS)
    for kind, budget in BUDGETS.items():
        expected, _ = estimate_document_index(q, k, documents, budget, min_sparse_length=MIN_SPARSE)
        got, _ = estimate_document_index(q_view, k_view, documents, budget, min_sparse_length=MIN_SPARSE)
        assert torch.equal(got.v_idx, expected.v_idx) and torch.equal(got.s_idx, expected.s_idx), f"seed={seed} {kind}"
