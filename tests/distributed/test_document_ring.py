"""Packed documents through the sparse ring on gloo ranks (DESIGN.md §2.7), flat and hierarchical: the
torch_blocksparse backend (fp32) against the fp64 reference on the oracle's packed mask, and the refusals every rank
raises before the first send."""

import re

import pytest
import torch
import torch.distributed as dist

from megatron_mtraining.turn_plan import plan_turns
from mtraining_kernels.budget import StaticBudget
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import estimate_document_index
from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import Layout
from mtraining_kernels.reference import packed_vertical_slash_mask, reference_sparse_attention

Q_HEADS, KV_HEADS, DIM = 4, 2, 16
BUDGET = StaticBudget(48, 160)
MIN_SPARSE_LENGTH = 128
RELATIVE_TOLERANCE = 2e-5  # fp32 ring (fp32 inputs and accumulators) against the fp64 reference
# starts per sample: documents straddling blocks and ranks, one-token documents, dense (short) and sparse ones
STARTS = {
    512: [[0, 130, 131, 300], [0, 64, 200, 512]],
    1024: [[0, 1, 257, 383, 700], [0, 600, 1024, 1024, 1024]],
    768: [[0, 1, 257, 383, 384], [0, 600, 768, 768, 768]],
}


def _inputs(seed: int, seq_len: int):
    """fp32 q, k, v, dout ``[2, N, H, d]``, the documents and their estimated DocumentIndex."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(2, seq_len, heads, DIM, generator=generator) for heads in (Q_HEADS, KV_HEADS, KV_HEADS, Q_HEADS)
    )
    documents = Documents(torch.tensor(STARTS[seq_len]), seq_len)
    index, _ = estimate_document_index(q, k, documents, BUDGET, min_sparse_length=MIN_SPARSE_LENGTH)
    return q, k, v, dout, index


def _layout(kind: str, world_size: int, seq_len: int) -> Layout:
    """``Layout(kind, W)``; ``skewed-planned``: the skewed layout with turns planned for the documents of
    ``STARTS[seq_len]`` (at 768 tokens and W = 3: turns (0, 2), neither striped's nor skewed's)."""
    if kind != "skewed-planned":
        return Layout(kind, world_size)
    documents = Documents(torch.tensor(STARTS[seq_len]), seq_len)
    counts = torch.full(documents.starts.shape, 8)
    turns = plan_turns(
        documents, world_size, far_verticals=counts, far_slashes=counts, min_sparse_length=MIN_SPARSE_LENGTH
    )
    return Layout("skewed", world_size, turns=turns)


def _ring_rank(rank, world_size, kind, seq_len, seed, inner_size=None):
    from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups
    from megatron_mtraining.ring.sparse_ring import ring_attention

    q, k, v, dout, doc_index = _inputs(seed, seq_len)
    layout = _layout(kind, world_size, seq_len)
    local = [layout.shard(t, rank, dim=1).clone().requires_grad_(t is not dout) for t in (q, k, v, dout)]
    index = convert_document_index(doc_index, layout, rank)
    assert index.doc_ids is not None, "the documents must reach the ring"
    groups = RingGroups.flat(dist.group.WORLD) if inner_size is None else build_hierarchical_groups(inner_size)
    out, lse = ring_attention(*local[:3], index, groups, backend="torch_blocksparse", return_lse=True)
    out.backward(local[3])
    return [t.detach() for t in (out, lse, local[0].grad, local[1].grad, local[2].grad)]


@pytest.mark.parametrize(
    "world, kind, seq_len, inner_size",
    [
        (2, "striped", 512, None),
        (2, "zigzag", 512, None),
        (3, "striped", 768, None),
        (3, "skewed", 768, None),
        (3, "skewed-planned", 768, None),
        (4, "striped", 1024, 2),
    ],
    ids=["striped-W2", "zigzag-W2", "striped-W3", "skewed-W3", "skewed-planned-W3", "striped-hierarchical-2x2"],
)
def test_packed_ring_equals_the_reference(distributed, seed, world, kind, seq_len, inner_size):
    parts = distributed(_ring_rank, world, kind, seq_len, seed, inner_size)
    layout = _layout(kind, world, seq_len)
    if kind == "skewed-planned":
        assert layout.turns == (0, 2), f"the plan changed: {layout.turns}; pick documents whose turns are new"
    out, dq, dk, dv = (layout.unshard([p[i] for p in parts], dim=1) for i in (0, 2, 3, 4))
    lse = layout.unshard([p[1] for p in parts], dim=2)

    q, k, v, dout, doc_index = _inputs(seed, seq_len)
    inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_sparse_attention(*inputs, packed_vertical_slash_mask(doc_index))
    expected = (ref_out, ref_lse, *torch.autograd.grad(ref_out, inputs, dout.double()))
    for name, ours, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), expected):
        error = (ours.double() - ref).abs().max().item()
        bound = RELATIVE_TOLERANCE * max(1.0, ref.abs().max().item())
        assert error <= bound, f"seed={seed} {kind} W={world} {name}: max error {error:.3e} > {bound:.1e}"


def _bad_rank(rank, world_size, problem):
    from megatron_mtraining.ring.groups import RingGroups
    from megatron_mtraining.ring.sparse_ring import ring_attention

    seq_len, layout = 512, Layout("striped", world_size)
    q, k, v, _, doc_index = _inputs(0, seq_len)
    if problem == "other_documents" and rank == 1:
        moved = Documents(torch.tensor([[0, 131, 132, 300], [0, 64, 200, 512]]), seq_len)
        doc_index, _ = estimate_document_index(q, k, moved, BUDGET, min_sparse_length=MIN_SPARSE_LENGTH)
    backend = "torch_blocksparse"
    index = convert_document_index(doc_index, layout, rank)
    local = [layout.shard(t, rank, dim=1) for t in (q, k, v)]
    try:
        ring_attention(*local, index, RingGroups.flat(dist.group.WORLD), backend=backend)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "problem, message",
    [
        ("other_documents", r"ring attention: the ranks of the group disagree on \{'documents'"),
    ],
)
def test_bad_documents_raise_on_every_rank_without_hanging(distributed, problem, message):
    errors = distributed(_bad_rank, 2, problem, timeout=60, collective_timeout=20)
    for rank, error in enumerate(errors):
        assert error is not None and re.search(message, error), f"rank {rank}: {error!r}"
