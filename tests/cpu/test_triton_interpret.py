"""The Triton backend's kernels run by Triton's CPU interpreter (TRITON_INTERPRET=1), tiny shapes.

On a machine with CUDA this module is skipped: the interpreter flag would also turn the GPU test
module's kernels into interpreted ones, and tests/gpu/test_triton_gpu.py covers the same cases.
Inputs are fp16 here: the interpreter's ``tl.dot`` on bf16 operands returns garbage (seen with
Triton 3.8: a 16×16 bf16 product off by 1e10), so bf16 is covered by the GPU tests only.
"""

import importlib
import itertools
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter tests run only on machines without CUDA"
)
pytest.importorskip("triton")

from document_cases import (
    packed_documents,
    packed_index_with_cross_document_bars,
    random_document_index,
    random_lengths,
)
from triton_cases import (
    LIST_ROUTES,
    assert_close_fa,
    force_list_route,
    make_index,
    make_qkv_dout,
    off_alignment,
    packed_reference_attention,
    packed_ring_attention,
    reference_attention,
    ring_attention,
    single_device_attention,
)

from mtraining_kernels import torch_backend, triton_backend, triton_bwd, triton_fwd
from mtraining_kernels.bar_words import BAR_WORD_COLUMNS
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.documents import Documents
from mtraining_kernels.index import convert_index
from mtraining_kernels.interface import sparse_attention
from mtraining_kernels.layout import BLOCK_SIZE as BLOCK
from mtraining_kernels.layout import Layout

_interpreted = type(triton_fwd.block_bar_forward_kernel).__name__ == "InterpretedFunction"
if os.environ.get("TRITON_INTERPRET") == "1" and not _interpreted:
    # imported earlier in this process without the interpreter flag: rebuild the kernels
    for module in (triton_fwd, triton_bwd, triton_backend):
        importlib.reload(module)

NAMES = ("out", "lse", "dq", "dk", "dv")

CASES = [
    # (layout kind, W, N, Hq, Hkv, d, dtype, pattern)
    ("contiguous", 1, 256, 2, 1, 64, torch.float16, "mixed"),
    ("striped", 2, 512, 2, 2, 64, torch.float16, "bars"),
    ("zigzag", 2, 512, 4, 1, 64, torch.float16, "verticals"),
    ("contiguous", 2, 512, 2, 1, 128, torch.float16, "slashes"),
    ("contiguous", 1, 384, 2, 2, 64, torch.float16, "full"),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("kind, world, seq_len, heads, kv_heads, dim, dtype, pattern", CASES)
def test_ring_steps_match_reference(seed, kind, world, seq_len, heads, kv_heads, dim, dtype, pattern, deterministic):
    gen = torch.Generator().manual_seed(seed)
    v_idx, s_idx = make_index(1, heads, seq_len, pattern, gen)
    q, k, v, dout = make_qkv_dout(1, seq_len, heads, kv_heads, dim, dtype, "cpu", gen)
    ours = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, Layout(kind, world), deterministic=deterministic)
    ref = reference_attention(q, k, v, dout, v_idx, s_idx, torch.float64)
    low = reference_attention(q, k, v, dout, v_idx, s_idx, dtype)
    context = f"seed={seed} {kind} W={world} N={seq_len} Hq={heads} Hkv={kv_heads} d={dim} {dtype} {pattern}"
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, dtype, context)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_query_blocks_with_hundreds_of_bars_match_reference(seed, deterministic):
    """300 verticals per head (no slashes but the diagonal block): the last query blocks list about 280 bars, so
    every bar loop runs several full tiles and a partial one (the pattern cases above draw at most 64)."""
    seq_len, heads = 2048, 2
    gen = torch.Generator().manual_seed(seed)
    columns = [torch.randperm(seq_len, generator=gen)[:300].sort().values for _ in range(heads)]
    v_idx = torch.stack(columns).to(torch.int32).view(1, heads, -1)
    s_idx = torch.zeros(1, heads, 1, dtype=torch.int32)
    q, k, v, dout = make_qkv_dout(1, seq_len, heads, 1, 64, torch.float16, "cpu", gen)
    ours = ring_attention(
        triton_backend, q, k, v, dout, v_idx, s_idx, Layout("contiguous", 1), deterministic=deterministic
    )
    ref = reference_attention(q, k, v, dout, v_idx, s_idx, torch.float64)
    low = reference_attention(q, k, v, dout, v_idx, s_idx, torch.float16)
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, torch.float16, f"seed={seed} N={seq_len} 300 verticals per head")


PACKED_LAYOUTS = [Layout("contiguous", 1), Layout("striped", 2), Layout("zigzag", 2)]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("layout", PACKED_LAYOUTS, ids=lambda layout: f"{layout.kind}-W{layout.world_size}")
def test_packed_documents_ring_steps_match_reference(seed, layout, deterministic):
    """Random packed documents (sparse and dense ones, straddling blocks), every ring step's launchers against
    the fp64 reference on the packed mask, forward and all gradients."""
    generator = torch.Generator().manual_seed(seed)
    seq_len, heads, kv_heads, dim, dtype = 512, 2, 1, 64, torch.float16
    index = packed_index_with_cross_document_bars(generator, seq_len, heads)
    documents = index.documents
    q, k, v, dout = make_qkv_dout(2, seq_len, heads, kv_heads, dim, dtype, "cpu", generator)
    ours = packed_ring_attention(triton_backend, q, k, v, dout, index, layout, deterministic=deterministic)
    ref = packed_reference_attention(q, k, v, dout, index, torch.float64)
    low = packed_reference_attention(q, k, v, dout, index, dtype)
    context = f"seed={seed} {layout} deterministic={deterministic} documents={documents.lengths.tolist()}"
    for name, o, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, o, r, lo, dtype, context)


def test_packed_documents_through_sparse_attention_match_the_torch_backend(seed):
    """The single-device entry point (the index's cached by-key lists) on a packed index: Triton and the
    torch_blocksparse backend agree within the input precision."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = 512
    documents = packed_documents([[200, 1, 311], random_lengths(generator, seq_len)], seq_len)
    index = convert_document_index(random_document_index(generator, documents, heads=2), Layout("contiguous", 1), 0)
    q, k, v, dout = make_qkv_dout(2, seq_len, 2, 1, 64, torch.float16, "cpu", generator)
    results = {}
    for backend in ("triton", "torch_blocksparse"):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = sparse_attention(*inputs, index, backend=backend)
        results[backend] = (out, *torch.autograd.grad(out, inputs, dout))
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), results["triton"], results["torch_blocksparse"]):
        error = (ours.double() - theirs.double()).norm() / theirs.double().norm()
        assert error < 5e-3, f"seed={seed} {name}: relative RMSE {error:.2e} against torch_blocksparse"


def test_one_packed_document_is_bitwise_the_unpacked_path(seed):
    """One document per sample: the Triton kernels with document ids equal the unpacked path bitwise."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = 512
    index = random_document_index(generator, Documents.single(2, seq_len), heads=2)
    q, k, v, dout = make_qkv_dout(2, seq_len, 2, 1, 64, torch.float16, "cpu", generator)
    results = []
    for lists in (
        convert_document_index(index, Layout("contiguous", 1), 0),
        convert_index(index.v_idx[:, 0], index.s_idx[:, 0], Layout("contiguous", 1), 0, seq_len),
    ):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = sparse_attention(*inputs, lists, backend="triton", return_lse=True)
        results.append((out, lse, *torch.autograd.grad(out, inputs, dout)))
    for name, packed, unpacked in zip(NAMES, *results):
        assert torch.equal(packed, unpacked), f"seed={seed} {name}"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_unaligned_inputs_equal_aligned_ones(seed, deterministic):
    """Inputs at an address that is not a 16-byte multiple are read by pointer gathers, aligned ones by
    tensor-memory copies (emulated here), also through Megatron's ``[s, b, H, d]`` memory seen as ``[b, s, H, d]``
    (strides not in dimension order): outputs and gradients are bitwise the same."""
    gen = torch.Generator().manual_seed(seed)
    v_idx, s_idx = make_index(2, 4, 512, "mixed", gen)
    q, k, v, dout = make_qkv_dout(2, 512, 4, 2, 64, torch.float16, "cpu", gen)
    index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, 512)
    unaligned = [off_alignment(x) for x in (q, k, v, dout)]
    sequence_major = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v)]
    assert triton_backend._copies_tiles(q, k, v, dout) and not triton_backend._copies_tiles(*unaligned)
    assert triton_backend._copies_tiles(*sequence_major) and not sequence_major[0].is_contiguous()
    aligned_results = single_device_attention(q, k, v, dout, index, deterministic=deterministic)
    for inputs in (unaligned, [*sequence_major, dout]):
        results = single_device_attention(*inputs, index, deterministic=deterministic)
        for name, a, b in zip(("out", "dq", "dk", "dv"), aligned_results, results):
            assert torch.equal(a, b), f"seed={seed} {name} differs between the tile paths"


def test_matches_torch_backend_per_step(seed):
    """Every forward and backward step of a W=2 striped ring against the torch_blocksparse backend."""
    gen = torch.Generator().manual_seed(seed)
    layout = Layout("striped", 2)
    v_idx, s_idx = make_index(2, 4, 512, "mixed", gen)
    q, k, v, dout = make_qkv_dout(2, 512, 4, 2, 64, torch.float16, "cpu", gen)
    ours = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, layout)
    theirs = ring_attention(torch_backend, q, k, v, dout, v_idx, s_idx, layout)
    for name, a, b in zip(NAMES, ours, theirs):
        # ours rounds P and dS to fp16 for the matmuls, as flash attention does; torch_blocksparse does not
        rmse = ((a - b).norm() / b.norm()).item()
        assert rmse < 2e-3, f"{name}: relative RMSE {rmse:.2e} against torch_blocksparse (seed={seed})"


def test_rows_without_work_are_untouched_and_empty_state_is_ignored(seed):
    """An off-diagonal step writes only the rows it has work for; lse = −inf makes NaN outputs irrelevant.

    Rank 1 of a contiguous W=2 split reads source 0: head 0 has a slash reaching it (and a vertical
    inside an active block), head 1 has nothing, so its rows must stay bit-identical.
    """
    gen = torch.Generator().manual_seed(seed)
    layout, seq_len = Layout("contiguous", 2), 512
    v_idx = torch.tensor([[[10], [seq_len]]], dtype=torch.int32)
    s_idx = torch.tensor([[[300], [seq_len]]], dtype=torch.int32)
    index = convert_index(v_idx, s_idx, layout, 1, seq_len)
    q, k, v, dout = make_qkv_dout(1, seq_len // 2, 2, 1, 64, torch.float16, "cpu", gen)
    idle = torch.zeros(1, 2, seq_len // 2, dtype=torch.bool)
    idle[:, 1] = True
    idle_out = idle.transpose(1, 2)
    out = torch.randn(q.shape, generator=gen)
    lse = torch.randn(1, 2, seq_len // 2, generator=gen)
    empty = (torch.rand(lse.shape, generator=gen) < 0.5) & ~idle  # "nothing yet" rows
    lse[empty] = float("-inf")
    out[empty.transpose(1, 2)] = float("nan")
    out0, lse0 = out.clone(), lse.clone()
    triton_backend.block_bar_forward(
        q,
        k,
        v,
        index.blk_ptr[0],
        index.blk_col,
        index.bar_ptr[0],
        index.bar_col,
        out,
        lse,
        causal_diag=False,
        softmax_scale=0.125,
    )
    expected_out, expected_lse = out0.clone(), lse0.clone()
    torch_backend.block_bar_forward(
        q.float(),
        k.float(),
        v.float(),
        index.blk_ptr[0],
        index.blk_col,
        index.bar_ptr[0],
        index.bar_col,
        expected_out,
        expected_lse,
        causal_diag=False,
        softmax_scale=0.125,
    )
    assert torch.equal(lse[idle], lse0[idle]), f"seed={seed}: lse of idle rows changed"
    assert torch.equal(out[idle_out], out0[idle_out]), f"seed={seed}: out of idle rows changed"
    assert torch.isfinite(out[~idle_out]).all(), f"seed={seed}: NaN leaked from an empty running state"
    torch.testing.assert_close(out, expected_out, rtol=2e-3, atol=2e-3, equal_nan=True)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-4, atol=1e-4)

    dq = torch.randn(q.shape, generator=gen)
    dk, dv = torch.randn(k.shape, generator=gen), torch.randn(v.shape, generator=gen)
    dq0 = dq.clone()
    delta = torch.randn(lse.shape, generator=gen)
    for deterministic in (False, True):
        triton_backend.block_bar_backward(
            q,
            k,
            v,
            dout,
            lse,
            delta,
            index.blk_ptr[0],
            index.blk_col,
            index.bar_ptr[0],
            index.bar_col,
            dq,
            dk,
            dv,
            causal_diag=False,
            softmax_scale=0.125,
            deterministic=deterministic,
        )
        assert torch.equal(dq[idle_out], dq0[idle_out]), f"seed={seed}: dq of idle rows changed"
        assert not torch.equal(dq, dq0), f"seed={seed}: the busy rows got no gradient"


@pytest.mark.parametrize("backend", [triton_backend, torch_backend], ids=["triton", "torch"])
def test_a_fresh_step_writes_what_merging_into_an_empty_state_gives(seed, backend):
    """``fresh`` / ``fresh_dq`` (the single-step path): uninitialised (NaN) buffers, out and dq in q's dtype or
    fp32, give bitwise what zeros and −inf merged with the step and then cast give, idle rows included."""
    gen = torch.Generator().manual_seed(seed)
    layout, seq_len = Layout("contiguous", 2), 512
    v_idx = torch.tensor([[[10], [seq_len]]], dtype=torch.int32)  # head 1 idle on this step: rows without work
    s_idx = torch.tensor([[[300], [seq_len]]], dtype=torch.int32)
    index = convert_index(v_idx, s_idx, layout, 1, seq_len)
    lists = (index.blk_ptr[0], index.blk_col, index.bar_ptr[0], index.bar_col)
    q, k, v, dout = make_qkv_dout(1, seq_len // 2, 2, 1, 64, torch.float16, "cpu", gen)
    settings = dict(causal_diag=False, softmax_scale=0.125)
    expected_out = torch.zeros(q.shape)
    expected_lse = torch.full((1, 2, seq_len // 2), float("-inf"))
    backend.block_bar_forward(q, k, v, *lists, expected_out, expected_lse, **settings)
    for dtype in (q.dtype, torch.float32):
        out = torch.full(q.shape, float("nan"), dtype=dtype)
        lse = torch.full(expected_lse.shape, float("nan"))
        backend.block_bar_forward(q, k, v, *lists, out, lse, fresh=True, **settings)
        assert torch.equal(out, expected_out.to(dtype)), f"seed={seed} out {dtype}"
        assert torch.equal(lse, expected_lse), f"seed={seed} lse"

    delta = backend.output_delta(expected_out.to(q.dtype), dout)
    grads = [torch.zeros(t.shape) for t in (q, k, v)]
    backend.block_bar_backward(q, k, v, dout, expected_lse, delta, *lists, *grads, deterministic=True, **settings)
    for dtype in (q.dtype, torch.float32):
        dq = torch.full(q.shape, float("nan"), dtype=dtype)
        dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
        backend.block_bar_backward(
            q, k, v, dout, expected_lse, delta, *lists, dq, dk, dv, deterministic=True, fresh_dq=True, **settings
        )
        assert torch.equal(dq, grads[0].to(dtype)), f"seed={seed} dq {dtype}"
        assert torch.equal(dk, grads[1]) and torch.equal(dv, grads[2]), f"seed={seed} dk/dv"
    assert grads[0][:, :, 1].eq(0).all() and grads[0][:, :, 0].ne(0).any(), f"seed={seed}: the idle head's dq"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("out_layout", ["like_dout", "strided"])
@pytest.mark.parametrize("backend", [triton_backend, torch_backend], ids=["triton", "torch"])
def test_a_backward_given_out_computes_delta_as_given(seed, monkeypatch, backend, out_layout, deterministic):
    """delta None with the forward's out: the backward computes delta itself and gives bitwise the gradients of
    the given ``output_delta``. The Triton query-major pass writes it (no delta launch) where out is strided as
    dout; otherwise ``output_delta`` runs first. Without out it is refused before any work."""
    gen = torch.Generator().manual_seed(seed)
    index = convert_index(*make_index(1, 2, 256, "mixed", gen), Layout("contiguous", 1), 0, 256)
    lists = (index.blk_ptr[0], index.blk_col, index.bar_ptr[0], index.bar_col)
    q, k, v, dout = make_qkv_dout(1, 256, 2, 1, 64, torch.float16, "cpu", gen)
    out = torch.randn(q.shape, generator=gen).to(q.dtype)
    if out_layout == "strided":  # the same values, heads outermost in memory
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
    settings = dict(causal_diag=True, softmax_scale=0.125, deterministic=deterministic, fresh_dq=True, fresh_dkv=True)
    lse = torch.randn(1, 2, 256, generator=gen).abs() + 3.0
    expected = [torch.empty(t.shape) for t in (q, k, v)]
    backend.block_bar_backward(q, k, v, dout, lse, backend.output_delta(out, dout), *lists, *expected, **settings)
    delta_launches = []
    output_delta = backend.output_delta
    monkeypatch.setattr(backend, "output_delta", lambda *args: delta_launches.append(1) or output_delta(*args))
    got = [torch.empty(t.shape) for t in (q, k, v)]
    backend.block_bar_backward(q, k, v, dout, lse, None, *lists, *got, out=out, **settings)
    for name, a, b in zip(("dq", "dk", "dv"), got, expected):
        assert torch.equal(a, b), f"seed={seed} {name}: {(a - b).abs().max():.2e} from the given delta's"
    fused = backend is triton_backend and out_layout == "like_dout"
    assert len(delta_launches) == (0 if fused else 1), f"seed={seed}: delta computed {len(delta_launches)} times"
    with pytest.raises(ValueError, match="delta is None, so out must be the forward's output"):
        backend.block_bar_backward(q, k, v, dout, lse, None, *lists, *got, **settings)


def test_the_interface_backward_skips_the_checks_its_forward_made(seed, monkeypatch):
    """sparse_attention's backward passes ``validated`` to the Triton backend: no argument is checked again
    and the gradients are bitwise those of the checked backward. With ``replay_output`` (no forward of ours ran)
    the backward checks everything, so an input the backend refuses is still refused before any work."""
    gen = torch.Generator().manual_seed(seed)
    index = convert_index(*make_index(1, 2, 256, "mixed", gen), Layout("contiguous", 1), 0, 256)
    q, k, v, dout = make_qkv_dout(1, 256, 2, 1, 64, torch.float16, "cpu", gen)
    calls = []
    check_backward = triton_backend._check_backward
    monkeypatch.setattr(triton_backend, "_check_backward", lambda *a, **kw: calls.append(1) or check_backward(*a, **kw))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = sparse_attention(*leaves, index, backend="triton", return_lse=True)
    got = torch.autograd.grad(out, leaves, dout)
    assert not calls, f"seed={seed}: the interface's backward checked its arguments again"
    expected = [torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v)]
    settings = dict(causal_diag=True, softmax_scale=64**-0.5, fresh_dq=True, fresh_dkv=True, out=out.detach())
    triton_backend.block_bar_backward(
        q, k, v, dout, lse, None, *index.step_lists(0), *expected, key_lists=index.key_lists(0), **settings
    )
    assert calls, "the public backward skipped its checks"
    for name, a, b in zip(("dq", "dk", "dv"), got, expected):
        assert torch.equal(a, b), f"seed={seed} {name}: {(a - b).abs().max():.2e} from the checked backward's"
    wide = [t.float().requires_grad_() for t in (q, k, v)]  # fp32: the Triton backend refuses it
    replayed = sparse_attention(*wide, index, backend="triton", replay_output=(out.detach().float(), lse))
    with pytest.raises(ValueError, match="the triton backend takes"):
        torch.autograd.grad(replayed, wide, dout.float())


def test_output_delta_is_the_row_sum_of_out_times_dout(seed):
    """The Triton delta kernel against the torch backend's, which is the fp32 product summed over d."""
    gen = torch.Generator().manual_seed(seed)
    out, dout = (torch.randn(2, 256, 3, 64, generator=gen).to(torch.float16) for _ in range(2))
    expected = (out.float() * dout.float()).sum(-1).transpose(1, 2)
    assert torch.equal(torch_backend.output_delta(out, dout), expected), f"seed={seed}"
    got = triton_backend.output_delta(out, dout)
    assert got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"seed={seed}")
    with pytest.raises(ValueError, match="multiple of 128"):
        triton_backend.output_delta(out[:, :200], dout[:, :200])


def test_merging_a_step_into_its_own_result_keeps_out_bitwise_at_large_logits(seed):
    """The epilogue's weights come from the lse difference (DESIGN.md §2.4's σ form): merging a step's
    (out, lse) into a copy of itself gives weights of exactly 1/2, so out keeps every bit and lse gains
    ln 2, even with |lse| ~ 1e3 where the merged lse's fp32 ulp (6e-5) would shift weights taken against it.
    """
    gen = torch.Generator().manual_seed(seed)
    layout, seq_len = Layout("contiguous", 1), 256
    v_idx, s_idx = make_index(1, 2, seq_len, "mixed", gen)
    index = convert_index(v_idx, s_idx, layout, 0, seq_len)
    q, k, v, _ = make_qkv_dout(1, seq_len, 2, 1, 64, torch.float16, "cpu", gen)
    out = torch.zeros(q.shape)
    lse = torch.full((1, 2, seq_len), float("-inf"))
    step = dict(causal_diag=True, softmax_scale=50.0)  # logits of several hundred
    triton_backend.block_bar_forward(
        q, k, v, index.blk_ptr[0], index.blk_col, index.bar_ptr[0], index.bar_col, out, lse, **step
    )
    assert lse.max().item() > 500, f"seed={seed}: the test needs large lse, got {lse.max().item():.0f}"
    once_out, once_lse = out.clone(), lse.clone()
    triton_backend.block_bar_forward(
        q, k, v, index.blk_ptr[0], index.blk_col, index.bar_ptr[0], index.bar_col, out, lse, **step
    )
    changed = (out != once_out).sum().item()
    assert changed == 0, f"seed={seed}: {changed} out entries changed by merging a step with itself"
    torch.testing.assert_close(
        lse,
        once_lse + math.log(2.0),
        rtol=0,
        atol=2 * torch.finfo(torch.float32).eps * lse.abs().max().item(),
        msg=lambda m: f"seed={seed}: {m}",
    )


def test_deterministic_backward_is_bitwise_repeatable(seed):
    gen = torch.Generator().manual_seed(seed)
    v_idx, s_idx = make_index(1, 4, 512, "mixed", gen)
    q, k, v, dout = make_qkv_dout(1, 512, 4, 1, 64, torch.float16, "cpu", gen)
    first = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, Layout("zigzag", 2), deterministic=True)
    second = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, Layout("zigzag", 2), deterministic=True)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs (seed={seed})"


def _valid_call(dtype=torch.float16, dim=64):
    seq_len = 256
    v_idx, s_idx = make_index(1, 2, seq_len, "mixed", torch.Generator().manual_seed(0))
    index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
    q = torch.randn(1, seq_len, 2, dim).to(dtype)
    k = torch.randn(1, seq_len, 1, dim).to(dtype)
    args = dict(
        q=q,
        k=k,
        v=k.clone(),
        blk_ptr=index.blk_ptr[0],
        blk_col=index.blk_col,
        bar_ptr=index.bar_ptr[0],
        bar_col=index.bar_col,
        out=torch.zeros(q.shape),
        lse=torch.full((1, 2, seq_len), float("-inf")),
    )
    return args


@pytest.mark.parametrize(
    "change, word",
    [
        (lambda a: a.update(q=a["q"].float(), k=a["k"].float(), v=a["v"].float()), "dtype"),
        (
            lambda a: a.update(
                q=torch.randn(1, 256, 2, 96).half(),
                k=torch.randn(1, 256, 1, 96).half(),
                v=torch.randn(1, 256, 1, 96).half(),
                out=torch.zeros(1, 256, 2, 96),
            ),
            "head dim",
        ),
        (lambda a: a.update(k=a["k"].bfloat16()), "dtypes differ"),
        (lambda a: a.update(blk_ptr=a["blk_ptr"].long()), "blk_ptr"),
        (lambda a: a.update(bar_ptr=a["bar_ptr"][:, :, :-1]), "bar_ptr"),
        (lambda a: a.update(bar_col=a["bar_col"].view(1, -1)), "bar_col"),
        (lambda a: a.update(out=torch.zeros(1, 2, 256, 64).transpose(1, 2)), "out must be contiguous"),
        (lambda a: a.update(lse=a["lse"].double()), "lse"),
        (lambda a: a.update(k=torch.randn(1, 128, 1, 64).half(), v=torch.randn(1, 128, 1, 64).half()), "length"),
    ],
)
def test_bad_input_raises_value_error_naming_it(change, word):
    args = _valid_call()
    change(args)
    with pytest.raises(ValueError, match=word):
        triton_backend.block_bar_forward(**args, causal_diag=True, softmax_scale=0.125)


def test_non_contiguous_inputs_are_accepted():
    """q/k/v given as strided views (heads-major storage) give the same result as contiguous tensors."""
    args = _valid_call()
    strided = {name: args[name].transpose(1, 2).contiguous().transpose(1, 2) for name in ("q", "k", "v")}
    assert not strided["q"].is_contiguous()
    out, lse = args["out"].clone(), args["lse"].clone()
    triton_backend.block_bar_forward(**args, causal_diag=True, softmax_scale=0.125)
    triton_backend.block_bar_forward(
        **{**args, **strided, "out": out, "lse": lse}, causal_diag=True, softmax_scale=0.125
    )
    assert torch.equal(out, args["out"]) and torch.equal(lse, args["lse"])


def _one_pass_stand_in(calls: list):
    """``gluon_bwd.one_pass_backward`` in PyTorch (fp32), for machines without Hopper: the block tiles of the
    key-major lists, dq added only when given one (the deterministic mode passes None), P zeroed across
    documents, dk and dv added to when fp32 and written when in k's dtype; then the bars by column from
    ``bar_words`` (its bounds, membership words and columns, as the Gluon launch reads them). Each call's mode
    and ``list_steps`` are appended to ``calls``."""

    def one_pass(
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dq,
        dk,
        dv,
        key_ptr,
        key_qblock,
        *,
        causal_diag,
        softmax_scale,
        documents=None,
        bar_words=None,
        list_steps=1,
    ):
        written = dk.dtype != torch.float32
        with_bars = bar_words is not None
        calls.append(
            {
                "dq": dq is not None,
                "documents": documents is not None,
                "written": written,
                "bars": with_bars,
                "list_steps": list_steps,
            }
        )
        assert not (written and bar_words is not None), "the bars add into dk/dv: they must be fp32"
        if dq is not None:  # the Gluon pass reduces into dq through a tensor descriptor
            assert dq.dtype == torch.float32 and dq.is_contiguous() and dq.data_ptr() % 16 == 0, "dq: fp32, aligned"
        dk_sum, dv_sum = (torch.zeros(t.shape) for t in (dk, dv)) if written else (dk, dv)
        batch, _, heads, _ = q.shape
        group = heads // k.shape[2]
        local = torch.arange(BLOCK)
        for b, h in itertools.product(range(batch), range(heads)):
            for j in range(key_ptr.shape[2] - 1):
                keys = slice(j * BLOCK, (j + 1) * BLOCK)
                k_j, v_j = k[b, keys, h // group].float(), v[b, keys, h // group].float()
                for i in key_qblock[key_ptr[b, h, j] : key_ptr[b, h, j + 1]].tolist():
                    rows = slice(i * BLOCK, (i + 1) * BLOCK)
                    q_i, do_i = q[b, rows, h].float(), dout[b, rows, h].float()
                    keep = (local[None, :] <= local[:, None]) | (not causal_diag or i != j)
                    if documents is not None:
                        keep = keep & (documents[0][b, rows, None] == documents[1][b, None, keys])
                    keep = keep & (lse[b, h, rows, None] > float("-inf"))
                    probs = torch.where(keep, torch.exp(softmax_scale * q_i @ k_j.T - lse[b, h, rows, None]), 0.0)
                    dscores = probs * (do_i @ v_j.T - delta[b, h, rows, None])
                    if dq is not None:
                        dq[b, rows, h] += softmax_scale * dscores @ k_j
                    dk_sum[b, keys, h // group] += softmax_scale * dscores.T @ q_i
                    dv_sum[b, keys, h // group] += probs.T @ do_i
        if written:
            dk.copy_(dk_sum)
            dv.copy_(dv_sum)
        if bar_words is not None:
            _bars_by_column(q, k, v, dout, lse, delta, dq, dk, dv, bar_words, softmax_scale)

    return one_pass


def _bars_by_column(q, k, v, dout, lse, delta, dq, dk, dv, bar_words, softmax_scale):
    """The Gluon bars launch in PyTorch: program (row, segment, chunk) takes the chunk's columns and, for each
    query block of its bounds within the segment, the slots its two membership words mark."""
    heads = q.shape[2]
    group = heads // k.shape[2]
    slot_bits = torch.arange(BAR_WORD_COLUMNS) % 64
    rows, num_chunks, num_blocks = bar_words.words.shape[:3]
    walk = bar_words.walk
    for row, segment, chunk in itertools.product(range(rows), range(-(-num_blocks // walk)), range(num_chunks)):
        first_from_end, end = bar_words.bounds[row, chunk].tolist()
        first = max(num_blocks - first_from_end, segment * walk)
        end = min(end, (segment + 1) * walk)
        b, h = divmod(row, heads)
        slots = slice(chunk * BAR_WORD_COLUMNS, (chunk + 1) * BAR_WORD_COLUMNS)
        cols = bar_words.column[row, slots].long()
        k_c, v_c = k[b, cols, h // group].float(), v[b, cols, h // group].float()
        for i in range(first, end):
            words = bar_words.words[row, chunk, i]
            word_per_slot = torch.where(torch.arange(BAR_WORD_COLUMNS) < 64, words[0], words[1])
            is_bar = ((word_per_slot >> slot_bits) & 1) != 0
            if not is_bar.any():
                continue
            rows = slice(i * BLOCK, (i + 1) * BLOCK)
            q_i, do_i = q[b, rows, h].float(), dout[b, rows, h].float()
            keep = is_bar[None, :] & (lse[b, h, rows, None] > float("-inf"))
            probs = torch.where(keep, torch.exp(softmax_scale * q_i @ k_c.T - lse[b, h, rows, None]), 0.0)
            dscores = probs * (do_i @ v_c.T - delta[b, h, rows, None])
            dq[b, rows, h] += softmax_scale * dscores @ k_c
            dk[b, :, h // group].index_add_(0, cols, softmax_scale * dscores.T @ q_i)
            dv[b, :, h // group].index_add_(0, cols, probs.T @ do_i)


@pytest.mark.parametrize("route", list(LIST_ROUTES))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_the_backward_composes_the_one_pass_by_mode(seed, monkeypatch, packed, deterministic, route):
    """Where the Hopper one pass applies (DESIGN.md §2.6), the backward hands it the block tiles with dq (default
    mode, long lists), without dq (deterministic, or short lists: the query-major pass keeps the blocks' dq), or
    not at all (default mode with documents), and the passes around it complete the gradients: a PyTorch
    stand-in for the one pass, the other passes interpreted, against the fp64 reference on a two-rank striped
    ring."""
    calls = []
    monkeypatch.setattr(triton_backend, "_one_pass_backward", lambda *tensors: _one_pass_stand_in(calls))
    force_list_route(monkeypatch, route)
    with_dq = not deterministic and route == "long_lists"
    generator = torch.Generator().manual_seed(seed)
    seq_len, heads, kv_heads, dim, dtype, layout = 512, 2, 1, 64, torch.float16, Layout("striped", 2)
    if packed:
        index = packed_index_with_cross_document_bars(generator, seq_len, heads)
        q, k, v, dout = make_qkv_dout(2, seq_len, heads, kv_heads, dim, dtype, "cpu", generator)
        ours = packed_ring_attention(triton_backend, q, k, v, dout, index, layout, deterministic=deterministic)
        ref, low = (packed_reference_attention(q, k, v, dout, index, t) for t in (torch.float64, dtype))
    else:
        v_idx, s_idx = make_index(1, heads, seq_len, "bars", generator)
        # slashes within one block of the diagonal only (ascending, N pads): the verticals of the blocks two or more
        # away stay bars whatever the draw (three random slashes can hit every block diagonal of 4 blocks)
        s_idx = torch.where(s_idx < BLOCK, s_idx, seq_len)
        q, k, v, dout = make_qkv_dout(1, seq_len, heads, kv_heads, dim, dtype, "cpu", generator)
        ours = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, layout, deterministic=deterministic)
        ref, low = (reference_attention(q, k, v, dout, v_idx, s_idx, t) for t in (torch.float64, dtype))
    expected = [] if packed and not deterministic else [{"dq": with_dq, "documents": packed, "written": False}] * 4
    modes = [{key: call[key] for key in ("dq", "documents", "written")} for call in calls]
    assert modes == expected, f"one-pass calls {calls}, expected {expected} (W = 2: four backward steps)"
    with_bars = [call["bars"] for call in calls]
    assert any(with_bars) == (with_dq and not packed), f"bars by column in the one pass: {with_bars}"
    assert all(call["list_steps"] == 2 for call in calls), f"the lists span the ring's two steps: {calls}"
    context = f"seed={seed} packed={packed} deterministic={deterministic} {route}"
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, dtype, context)


def test_a_dq_accumulator_off_the_reduces_alignment_is_summed_apart(seed, monkeypatch):
    """The one pass adds dq by tensor-memory reduces, whose descriptor needs a 16-byte-aligned start: for an fp32
    dq accumulator that starts elsewhere the backend hands it a zeroed sum and adds that into the accumulator,
    which then holds what an aligned one would (the one pass a PyTorch stand-in, the other passes interpreted)."""
    calls = []
    monkeypatch.setattr(triton_backend, "_one_pass_backward", lambda *tensors: _one_pass_stand_in(calls))
    force_list_route(monkeypatch, "long_lists")
    generator = torch.Generator().manual_seed(seed)
    seq_len, heads, kv_heads, dim, dtype = 512, 2, 1, 64, torch.float16
    v_idx, s_idx = make_index(1, heads, seq_len, "bars", generator)
    q, k, v, dout = make_qkv_dout(1, seq_len, heads, kv_heads, dim, dtype, "cpu", generator)
    index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
    lists = (index.blk_ptr[0], index.blk_col, index.bar_ptr[0], index.bar_col)
    scale = dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=torch.float32)
    lse = torch.full((1, heads, seq_len), float("-inf"))
    triton_backend.block_bar_forward(q, k, v, *lists, out, lse, causal_diag=True, softmax_scale=scale)
    delta = (out * dout.float()).sum(-1).transpose(1, 2).contiguous()
    earlier = torch.randn(q.shape, generator=generator)  # what earlier steps added
    aligned = earlier.clone()
    misaligned = torch.zeros(earlier.numel() + 1)[1:].view(earlier.shape)  # starts 4 bytes into its storage
    misaligned.copy_(earlier)
    assert misaligned.is_contiguous() and misaligned.data_ptr() % 16 != 0
    for dq in (aligned, misaligned):
        dk, dv = (torch.zeros(t.shape) for t in (k, v))
        triton_backend.block_bar_backward(
            q, k, v, dout, lse, delta, *lists, dq, dk, dv, causal_diag=True, softmax_scale=scale
        )
    assert [call["dq"] for call in calls] == [True, True], calls
    assert not torch.allclose(aligned, earlier), "the step added nothing into dq"
    torch.testing.assert_close(misaligned, aligned, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "group, entries_per_key_block, steps, expected",
    [
        (8, 64, 1, 2),  # one step listing 64 query blocks per (sample, head, key block) on average: two heads
        (8, 63, 1, 4),  # fewer: four heads
        (8, 16, 1, 4),
        (8, 15, 1, 8),  # fewer still: the whole group
        (8, 64, 2, 4),  # the same entries over a ring's two steps: 32 per step
        (8, 30, 2, 8),  # 15 per step
        (8, 128, 2, 2),
        (4, 64, 1, 2),
        (4, 63, 1, 4),  # four heads are the whole group
        (6, 16, 1, 6),  # a group that four heads do not divide
        (3, 64, 1, 3),  # nor two
        (1, 64, 1, 1),
    ],
)
def test_one_pass_programs_take_fewer_heads_only_where_a_steps_lists_are_long(
    group, entries_per_key_block, steps, expected
):
    """The Hopper one pass's walks for long lists (DESIGN.md §2.6) are chosen from shapes: the entries of the key
    lists per step, so a ring's lists of W steps count W times fewer."""
    from mtraining_kernels import gluon_bwd  # imported only: its kernels compile on Hopper alone

    batch, heads, num_blocks = 2, 16, 32
    listed = entries_per_key_block * batch * heads * num_blocks
    assert gluon_bwd.SHARED_WALKS == ((2, 64), (4, 16))
    assert gluon_bwd.heads_per_program(group, batch, heads, num_blocks, listed, steps) == expected


@pytest.mark.parametrize("route", list(LIST_ROUTES))
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("bars", [False, True], ids=["no_bars", "bars"])
def test_one_device_dk_dv_are_written_by_the_one_pass_alone(seed, monkeypatch, bars, deterministic, route):
    """On one device dk and dv have a single step: where the one pass is their only contributor (no bars) it
    writes them in k's dtype; with bars they are summed in fp32 and copied. dq comes from the one pass only in
    the default mode on long lists. A PyTorch stand-in for the one pass, the other passes interpreted, against
    the fp64 reference."""
    calls = []
    monkeypatch.setattr(triton_backend, "_one_pass_backward", lambda *tensors: _one_pass_stand_in(calls))
    force_list_route(monkeypatch, route)
    with_dq = not deterministic and route == "long_lists"
    generator = torch.Generator().manual_seed(seed)
    seq_len, heads, kv_heads, dim, dtype = 512, 2, 1, 64, torch.float16
    s_idx = torch.tensor([[[0, 200], [0, 130]]], dtype=torch.int32)  # both heads: block distances 0-2, not 3
    v_idx = torch.tensor([[[5, 300], [7, seq_len]]] if bars else [[[seq_len], [seq_len]]], dtype=torch.int32)
    q, k, v, dout = make_qkv_dout(1, seq_len, heads, kv_heads, dim, dtype, "cpu", generator)
    index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len)
    assert (index.bar_col.numel() > 0) == bars  # column 5 or 7 is a bar of query block 3
    out, dq, dk, dv = single_device_attention(q, k, v, dout, index, deterministic=deterministic)
    expected = {"dq": with_dq, "documents": False, "written": not bars, "bars": bars and with_dq, "list_steps": 1}
    assert calls == [expected], calls
    assert dk.dtype == dv.dtype == dtype
    ref, low = (reference_attention(q, k, v, dout, v_idx, s_idx, t) for t in (torch.float64, dtype))
    context = f"seed={seed} bars={bars} deterministic={deterministic} {route}"
    for name, a, r, lo in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref[:1] + ref[2:], low[:1] + low[2:]):
        assert_close_fa(name, a, r, lo, dtype, context)
