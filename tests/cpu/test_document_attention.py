"""Packed documents on the torch_blocksparse backend (DESIGN.md §2.7) against the fp64 reference on the oracle's
packed mask: single device and the per-step launchers of a ring simulated on one process (the Triton kernels'
packed documents: tests/cpu/test_triton_interpret.py)."""

import pytest
import torch
from document_cases import packed_documents, random_document_index, random_lengths

from mtraining_kernels.budget import StaticBudget
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import estimate_document_index
from mtraining_kernels.documents import Documents
from mtraining_kernels.index import convert_index
from mtraining_kernels.interface import sparse_attention
from mtraining_kernels.layout import Layout
from mtraining_kernels.reference import packed_vertical_slash_mask, reference_sparse_attention
from mtraining_kernels.torch_backend import block_bar_backward, block_bar_forward

Q_HEADS, KV_HEADS, DIM = 4, 2, 16
SINGLE = Layout("contiguous", 1)
TOLERANCE = 1e-10  # fp64 on both sides


def random_qkv(generator: torch.Generator, batch: int, seq_len: int, dtype=torch.float64):
    q = torch.randn(batch, seq_len, Q_HEADS, DIM, generator=generator, dtype=dtype)
    k = torch.randn(batch, seq_len, KV_HEADS, DIM, generator=generator, dtype=dtype)
    v = torch.randn(batch, seq_len, KV_HEADS, DIM, generator=generator, dtype=dtype)
    return q, k, v


def reference_with_grads(q, k, v, mask, dout):
    """fp64 reference out, lse and (dq, dk, dv) by autograd."""
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = reference_sparse_attention(*inputs, mask)
    return out.detach(), lse.detach(), torch.autograd.grad(out, inputs, dout)


def assert_close(name: str, ours: torch.Tensor, ref: torch.Tensor, message: str) -> None:
    error = (ours - ref).abs().max().item()
    assert error <= TOLERANCE, f"{message} {name}: max error {error:.3e}"


def check_single_device(index, q, k, v, dout, message: str) -> None:
    converted = convert_document_index(index, SINGLE, 0)
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = sparse_attention(*inputs, converted, backend="torch_blocksparse", return_lse=True)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, packed_vertical_slash_mask(index), dout)
    assert_close("out", out, ref_out, message)
    assert_close("lse", lse, ref_lse, message)
    for name, ours, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, ours, ref, message)


def test_single_device_equals_the_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len = 768
    documents = packed_documents([random_lengths(generator, seq_len) for _ in range(2)], seq_len)
    index = random_document_index(generator, documents, heads=Q_HEADS)
    q, k, v = random_qkv(generator, 2, seq_len)
    check_single_device(index, q, k, v, torch.randn(q.shape, generator=generator, dtype=q.dtype), f"seed={seed}")


def test_estimated_document_index_equals_the_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len = 768
    # one-token documents, shorter than 64 and 128, exactly min_sparse_length, straddling blocks
    documents = packed_documents([[1, 40, 100, 127, 1, 300, 199], [250, 63, 455]], seq_len)
    q, k, v = random_qkv(generator, 2, seq_len)
    index, _ = estimate_document_index(
        q.float(), k.float(), documents, StaticBudget(v_size=64, s_size=128), min_sparse_length=100
    )
    assert int(index.sparse.sum()) == 6, "the documents of 100, 127, 300, 199, 250 and 455 tokens are sparse"
    check_single_device(index, q, k, v, torch.randn(q.shape, generator=generator, dtype=q.dtype), f"seed={seed}")


def ring_on_one_process(layout: Layout, index, q, k, v, dout):
    """Every rank's W steps through the launchers (step t reads source (r − t) mod W, the diagonal mask at
    t = 0), dk/dv sent back to their source; returns out, lse, dq, dk, dv in global order."""
    world, seq_len = layout.world_size, q.shape[1]
    converted = [convert_document_index(index, layout, rank) for rank in range(world)]
    shards = [[layout.shard(x, rank) for rank in range(world)] for x in (q, k, v, dout)]
    q_parts, k_parts, v_parts, dout_parts = shards
    scale = DIM**-0.5
    outs, lses = [], []
    for rank, lists in enumerate(converted):
        out = torch.zeros(q_parts[rank].shape, dtype=torch.float64)
        lse = torch.full((q.shape[0], Q_HEADS, seq_len // world), float("-inf"), dtype=torch.float64)
        for step in range(world):
            source = lists.source_for_step(step)
            block_bar_forward(
                q_parts[rank],
                k_parts[source],
                v_parts[source],
                lists.blk_ptr[source],
                lists.blk_col,
                lists.bar_ptr[source],
                lists.bar_col,
                out,
                lse,
                causal_diag=step == 0,
                softmax_scale=scale,
                **lists.step_doc_ids(source),
            )
        outs.append(out)
        lses.append(lse)
    dq_parts = [torch.zeros_like(part) for part in q_parts]
    dk_parts = [torch.zeros_like(part) for part in k_parts]
    dv_parts = [torch.zeros_like(part) for part in v_parts]
    for rank, lists in enumerate(converted):
        delta = (outs[rank] * dout_parts[rank]).sum(-1).transpose(1, 2).contiguous()
        for step in range(world):
            source = lists.source_for_step(step)
            block_bar_backward(
                q_parts[rank],
                k_parts[source],
                v_parts[source],
                dout_parts[rank],
                lses[rank],
                delta,
                lists.blk_ptr[source],
                lists.blk_col,
                lists.bar_ptr[source],
                lists.bar_col,
                dq_parts[rank],
                dk_parts[source],
                dv_parts[source],
                causal_diag=step == 0,
                softmax_scale=scale,
                **lists.step_doc_ids(source),
            )
    return (
        layout.unshard(outs),
        layout.unshard(lses, dim=2),
        *(layout.unshard(parts) for parts in (dq_parts, dk_parts, dv_parts)),
    )


@pytest.mark.parametrize(
    "layout",
    [Layout("striped", 2), Layout("contiguous", 2), Layout("zigzag", 3), Layout("striped", 3)],
    ids=lambda layout: f"{layout.kind}-W{layout.world_size}",
)
def test_ring_steps_on_one_process_equal_the_reference(layout, seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len = 768
    documents = packed_documents([random_lengths(generator, seq_len)], seq_len)
    index = random_document_index(generator, documents, heads=Q_HEADS)
    q, k, v = random_qkv(generator, 1, seq_len)
    dout = torch.randn(q.shape, generator=generator, dtype=q.dtype)
    ours = ring_on_one_process(layout, index, q, k, v, dout)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, packed_vertical_slash_mask(index), dout)
    message = f"seed={seed} layout={layout}"
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), ours, (ref_out, ref_lse, *ref_grads)):
        assert_close(name, got, ref, message)


def test_one_document_is_bitwise_the_unpacked_path(seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len = 512
    index = random_document_index(generator, Documents.single(2, seq_len), heads=Q_HEADS, v_width=40, s_width=30)
    q, k, v = random_qkv(generator, 2, seq_len, dtype=torch.float32)
    dout = torch.randn(q.shape, generator=generator)
    results = []
    for lists in (
        convert_document_index(index, SINGLE, 0),
        convert_index(index.v_idx[:, 0], index.s_idx[:, 0], SINGLE, 0, seq_len),
    ):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = sparse_attention(*inputs, lists, return_lse=True)
        results.append((out, lse, *torch.autograd.grad(out, inputs, dout)))
    for name, packed, unpacked in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(packed, unpacked), f"seed={seed} {name}"


def packed_index(seq_len: int = 512):
    documents = packed_documents([[200, 1, 311]], seq_len)
    generator = torch.Generator().manual_seed(0)
    return convert_document_index(random_document_index(generator, documents, heads=Q_HEADS), SINGLE, 0)


@pytest.mark.parametrize(
    "documents, message",
    [
        (dict(key_doc_ids=None), "go together"),
        (dict(query_doc_ids=torch.zeros(1, 512, dtype=torch.int64)), "query_doc_ids must be an int32 tensor"),
        (dict(key_doc_ids=torch.zeros(1, 256, dtype=torch.int32)), "key_doc_ids must be an int32 tensor"),
    ],
)
def test_bad_document_ids_raise_value_error(documents, message):
    index = packed_index()
    q, k, v = random_qkv(torch.Generator().manual_seed(0), 1, 512)
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((1, Q_HEADS, 512), float("-inf"), dtype=torch.float64)
    keywords = {**index.step_doc_ids(0), **documents}
    with pytest.raises(ValueError, match=message):
        block_bar_forward(
            q,
            k,
            v,
            index.blk_ptr[0],
            index.blk_col,
            index.bar_ptr[0],
            index.bar_col,
            out,
            lse,
            causal_diag=True,
            softmax_scale=0.25,
            **keywords,
        )
