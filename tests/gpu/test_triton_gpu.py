"""The Triton backend on a CUDA device against the fp32 masked reference (DESIGN.md §6 FA rule).

Covers GQA 1:1 / 4:1 / 8:1, head dims 64 and 128, bf16 and fp16, single-device and
W=2 rings (diagonal and off-diagonal steps, every layout), patterns with only verticals, only
slashes, bars, forced entries and the full triangle, up to N = 32K; NaN-poisoned running outputs;
bitwise-repeatable deterministic backwards; agreement with the torch_blocksparse backend; packed
documents (DESIGN.md §2.7) on one device and in W = 2 rings.
"""

import pytest
import torch
import triton
from document_cases import packed_index_with_cross_document_bars
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

from mtraining_kernels import torch_backend, triton_backend
from mtraining_kernels.direct_launch import _direct_path, direct
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.documents import Documents
from mtraining_kernels.index import convert_index
from mtraining_kernels.interface import sparse_attention
from mtraining_kernels.layout import Layout
from mtraining_kernels.triton_bwd import output_delta_kernel

pytestmark = pytest.mark.gpu
NAMES = ("out", "lse", "dq", "dk", "dv")
DEVICE = "cuda"


def _check_against_reference(seed, layout, seq_len, heads, kv_heads, dim, dtype, pattern, deterministic, batch=1):
    gen = torch.Generator().manual_seed(seed)
    v_idx, s_idx = make_index(batch, heads, seq_len, pattern, gen)
    q, k, v, dout = make_qkv_dout(batch, seq_len, heads, kv_heads, dim, dtype, DEVICE, gen)
    ours = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, layout, deterministic=deterministic)
    torch.cuda.synchronize()
    ref = reference_attention(q, k, v, dout, v_idx, s_idx, torch.float32)
    low = reference_attention(q, k, v, dout, v_idx, s_idx, dtype)
    context = (
        f"seed={seed} {layout.kind} W={layout.world_size} b={batch} N={seq_len} Hq={heads} Hkv={kv_heads} "
        f"d={dim} {dtype} {pattern} deterministic={deterministic}"
    )
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, dtype, context)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_one_packed_document_is_bitwise_the_unpacked_path(seed, deterministic):
    """One document per sample: the kernels' document variant equals the unpacked path (bf16, GQA 8:1).

    Deterministic: all five tensors bitwise. Atomic: out and lse bitwise; dk and dv take the bars' fp32
    atomics in no fixed order (and on Hopper the unpacked path's dq the one-pass backward's), so two unpacked
    runs differ too: within bf16 rounding of each other."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = 8192
    v_idx, s_idx = make_index(2, 8, seq_len, "mixed", gen)
    documents = Documents.single(2, seq_len, device=DEVICE)
    index = DocumentIndex(
        documents, torch.ones(2, 1, dtype=torch.bool, device=DEVICE), *(x[:, None].to(DEVICE) for x in (v_idx, s_idx))
    )
    q, k, v, dout = make_qkv_dout(2, seq_len, 8, 1, 128, torch.bfloat16, DEVICE, gen)
    results = []
    for lists in (
        convert_document_index(index, Layout("contiguous", 1), 0),
        convert_index(v_idx.to(DEVICE), s_idx.to(DEVICE), Layout("contiguous", 1), 0, seq_len),
    ):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = sparse_attention(*inputs, lists, backend="triton", return_lse=True, deterministic=deterministic)
        results.append((out, lse, *torch.autograd.grad(out, inputs, dout)))
    for name, packed, unpacked in zip(NAMES, *results):
        if deterministic or name in ("out", "lse"):
            assert torch.equal(packed, unpacked), f"seed={seed} {name}"
        else:
            torch.testing.assert_close(packed, unpacked, rtol=1.6e-2, atol=1e-3, msg=f"seed={seed} {name}")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize(
    "layout, heads, kv_heads, dim, dtype",
    [
        (Layout("contiguous", 1), 8, 1, 128, torch.bfloat16),  # GQA 8:1
        (Layout("striped", 2), 4, 4, 64, torch.float16),  # MHA
        (Layout("zigzag", 2), 8, 2, 128, torch.bfloat16),  # GQA 4:1
    ],
    ids=lambda value: f"{value.kind}-W{value.world_size}" if isinstance(value, Layout) else None,
)
def test_packed_documents_match_reference(seed, layout, heads, kv_heads, dim, dtype, deterministic):
    gen = torch.Generator().manual_seed(seed)
    seq_len = 8192
    index = packed_index_with_cross_document_bars(gen, seq_len, heads)
    documents = Documents(index.documents.starts.to(DEVICE), seq_len)
    index = DocumentIndex(documents, *(x.to(DEVICE) for x in (index.sparse, index.v_idx, index.s_idx)))
    q, k, v, dout = make_qkv_dout(2, seq_len, heads, kv_heads, dim, dtype, DEVICE, gen)
    ours = packed_ring_attention(triton_backend, q, k, v, dout, index, layout, deterministic=deterministic)
    torch.cuda.synchronize()
    ref = packed_reference_attention(q, k, v, dout, index, torch.float32)
    low = packed_reference_attention(q, k, v, dout, index, dtype)
    context = f"seed={seed} {layout} Hq={heads} Hkv={kv_heads} d={dim} {dtype} deterministic={deterministic}"
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, dtype, context)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize(
    "seq_len, heads, kv_heads, dim, dtype, pattern",
    [
        (2048, 4, 4, 64, torch.bfloat16, "mixed"),  # MHA
        (2048, 8, 2, 128, torch.float16, "bars"),  # GQA 4:1
        (4096, 8, 1, 128, torch.bfloat16, "mixed"),  # GQA 8:1
        (1024, 4, 1, 64, torch.float16, "verticals"),
        (1024, 4, 2, 128, torch.bfloat16, "slashes"),
        (2048, 2, 1, 128, torch.bfloat16, "full"),
        (1024, 8, 1, 64, torch.bfloat16, "bars"),
    ],
)
def test_single_device_matches_reference(seed, seq_len, heads, kv_heads, dim, dtype, pattern, deterministic):
    _check_against_reference(
        seed,
        Layout("contiguous", 1),
        seq_len,
        heads,
        kv_heads,
        dim,
        dtype,
        pattern,
        deterministic,
        batch=2 if seq_len <= 1024 else 1,
    )


@pytest.mark.parametrize(
    "layout, heads, kv_heads, pattern, members",
    [
        (Layout("contiguous", 1), 8, 1, "mixed", 2),  # GQA 8:1: four programs share a key block
        (Layout("contiguous", 1), 8, 1, "mixed", 4),  # two programs
        (Layout("contiguous", 1), 8, 2, "full", 2),  # GQA 4:1, the dense mode
        (Layout("contiguous", 1), 4, 2, "bars", 2),  # GQA 2:1: one program per group, as without sharing
        (Layout("striped", 2), 8, 2, "slashes", 2),  # off-diagonal steps add into fp32 dk/dv
        (Layout("striped", 2), 8, 1, "slashes", 4),
    ],
    ids=lambda value: f"{value.kind}-W{value.world_size}" if isinstance(value, Layout) else None,
)
def test_programs_sharing_a_key_block_match_reference(seed, monkeypatch, layout, heads, kv_heads, pattern, members):
    """The one pass's walks for long lists, forced on short ones: each program takes ``members`` query heads of
    its group and adds its dk/dv with atomics (bf16, d = 128, N = 4096)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the one-pass backward runs on Hopper only")
    from mtraining_kernels import gluon_bwd

    monkeypatch.setattr(gluon_bwd, "SHARED_WALKS", ((members, 0),))
    _check_against_reference(seed, layout, 4096, heads, kv_heads, 128, torch.bfloat16, pattern, False)


@pytest.mark.parametrize("forced_programs", [None, 1, 5], ids=["per_multiprocessor", "1_program", "5_programs"])
@pytest.mark.parametrize(
    "pattern, batch, kv_heads", [("mixed", 2, 2), ("full", 1, 2), ("slashes", 1, 1), ("bars", 1, 2)]
)
def test_single_step_matches_reference(seed, monkeypatch, forced_programs, pattern, batch, kv_heads):
    """``sparse_attention``'s one fresh step (bf16, d = 128, N = 4096, 8 query heads) against the fp32 reference:
    on Hopper the persistent Gluon forward, and the one pass writing dk/dv in k's dtype where it alone adds to
    them. With fewer programs than the items, each takes many in turn (its query buffers and barriers' phases
    wrap many times; with b = 2 the items cross samples)."""
    hopper = torch.cuda.get_device_capability()[0] == 9
    if forced_programs is not None and not hopper:
        pytest.skip("the persistent Gluon forward runs on Hopper only")
    launched = []
    if hopper:  # with the Triton release of triton_backend.ONE_PASS_TRITON (another one fails here, as it should)
        from mtraining_kernels import gluon_fwd

        block_forward = gluon_fwd.block_forward

        def counted(*args, programs: int, **kwargs):
            launched.append(programs)
            block_forward(*args, programs=forced_programs or programs, **kwargs)

        monkeypatch.setattr(gluon_fwd, "block_forward", counted)
    _check_single_step(seed, pattern, batch, kv_heads, f"programs={forced_programs}")
    assert len(launched) == (1 if hopper else 0), f"seed={seed} {pattern}: Gluon forward launches {launched}"


@pytest.mark.parametrize("pattern", ["mixed", "bars"])
def test_persistent_forward_leaves_its_item_counter_at_zero(seed, monkeypatch, pattern):
    """The Gluon forward's kept item counter: three forwards in a row on one stream (1, 5 and one program per
    multiprocessor), and one on a second stream, each match the reference, and after each the counter of its
    stream is 0 again (the launch's last take resets it)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the persistent Gluon forward runs on Hopper only")
    from mtraining_kernels import gluon_fwd

    block_forward, programs_now = gluon_fwd.block_forward, [1]

    def forced(*args, programs: int, **kwargs):
        block_forward(*args, programs=programs_now[0] or programs, **kwargs)

    monkeypatch.setattr(gluon_fwd, "block_forward", forced)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    for programs, stream in ((1, main), (5, main), (0, main), (3, side)):
        programs_now[0] = programs
        with torch.cuda.stream(stream):
            _check_single_step(seed, pattern, 1, 2, f"programs={programs or 'per multiprocessor'}")
        torch.cuda.synchronize()
        counter = gluon_fwd._ITEM_COUNTERS[torch.cuda.current_device(), stream.cuda_stream]  # kept by the launch
        assert int(counter) == 0, f"seed={seed} {pattern} programs={programs}: the counter was left at {int(counter)}"


def _check_single_step(seed, pattern, batch, kv_heads, note):
    """``sparse_attention``'s fresh step (bf16, d = 128, N = 4096, 8 query heads) against the fp32 reference."""
    gen = torch.Generator().manual_seed(seed)
    seq_len, heads = 4096, 8
    v_idx, s_idx = make_index(batch, heads, seq_len, pattern, gen)
    q, k, v, dout = make_qkv_dout(batch, seq_len, heads, kv_heads, 128, torch.bfloat16, DEVICE, gen)
    index = convert_index(v_idx.to(DEVICE), s_idx.to(DEVICE), Layout("contiguous", 1), 0, seq_len)
    ours = single_device_attention(q, k, v, dout, index)
    ref = reference_attention(q, k, v, dout, v_idx, s_idx, torch.float32)
    low = reference_attention(q, k, v, dout, v_idx, s_idx, torch.bfloat16)
    context = f"seed={seed} b={batch} Hkv={kv_heads} {pattern} {note}"
    for name, a, r, lo in zip(("out", "dq", "dk", "dv"), ours, (ref[0], *ref[2:]), (low[0], *low[2:])):
        assert_close_fa(name, a, r, lo, torch.bfloat16, context)


@pytest.mark.parametrize("route", list(LIST_ROUTES))
@pytest.mark.parametrize(
    "layout, kv_heads, pattern",
    [
        (Layout("contiguous", 1), 2, "mixed"),
        (Layout("contiguous", 1), 1, "bars"),
        (Layout("contiguous", 1), 2, "full"),
        (Layout("striped", 2), 2, "slashes"),  # a ring's steps add into fp32 dq, dk, dv
        (Layout("striped", 2), 1, "bars"),
    ],
    ids=lambda value: f"{value.kind}-W{value.world_size}" if isinstance(value, Layout) else None,
)
def test_default_backward_routes_match_reference(seed, monkeypatch, route, layout, kv_heads, pattern):
    """The default mode's two routes on Hopper (DESIGN.md §2.6), each forced whatever the lists' length: dq, dk and
    dv from the one pass (long lists), or dq from the query-major pass and the block tiles' dk/dv from the one pass
    without dq (short lists); on one device through ``sparse_attention``'s fresh step, and in a W = 2 ring."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the one-pass backward runs on Hopper only")
    force_list_route(monkeypatch, route)
    if layout.world_size == 1:
        _check_single_step(seed, pattern, 1, kv_heads, route)
    else:
        _check_against_reference(seed, layout, 4096, 8, kv_heads, 128, torch.bfloat16, pattern, False)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize(
    "kind, heads, kv_heads, dim, dtype, pattern",
    [
        ("contiguous", 8, 2, 128, torch.bfloat16, "mixed"),
        ("zigzag", 4, 4, 64, torch.float16, "bars"),
        ("striped", 8, 1, 128, torch.bfloat16, "verticals"),
        ("striped", 4, 1, 64, torch.bfloat16, "slashes"),
    ],
)
def test_two_rank_ring_matches_reference(seed, kind, heads, kv_heads, dim, dtype, pattern, deterministic):
    """Both ranks' steps, including the off-diagonal ones (source w != rank, no causal mask)."""
    _check_against_reference(seed, Layout(kind, 2), 4096, heads, kv_heads, dim, dtype, pattern, deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_32k_matches_reference(seed, deterministic):
    _check_against_reference(seed, Layout("contiguous", 1), 32768, 2, 1, 128, torch.bfloat16, "mixed", deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_unaligned_inputs_take_pointer_gathers_and_match_reference(seed, deterministic):
    """Inputs at an address that is not a 16-byte multiple are read by pointer gathers instead of Hopper's
    tensor-memory copies: they match the reference, and the deterministic mode repeats itself bitwise there (the
    aligned inputs take the Gluon kernels on Hopper, which agree with these to rounding, not bitwise)."""
    gen = torch.Generator().manual_seed(seed)
    seq_len, heads, kv_heads, dim, dtype = 2048, 8, 2, 128, torch.bfloat16
    v_idx, s_idx = make_index(1, heads, seq_len, "mixed", gen)
    q, k, v, dout = make_qkv_dout(1, seq_len, heads, kv_heads, dim, dtype, DEVICE, gen)
    index = convert_index(v_idx.to(DEVICE), s_idx.to(DEVICE), Layout("contiguous", 1), 0, seq_len)
    unaligned = [off_alignment(x) for x in (q, k, v, dout)]
    assert not triton_backend._copies_tiles(*unaligned)
    ours = single_device_attention(*unaligned, index, deterministic=deterministic)
    ref = reference_attention(q, k, v, dout, v_idx, s_idx, torch.float32)
    low = reference_attention(q, k, v, dout, v_idx, s_idx, dtype)
    context = f"seed={seed} unaligned deterministic={deterministic}"
    for name, a, r, lo in zip(("out", "dq", "dk", "dv"), ours, (ref[0], *ref[2:]), (low[0], *low[2:])):
        assert_close_fa(name, a, r, lo, dtype, context)
    if deterministic:
        again = single_device_attention(*unaligned, index, deterministic=True)
        for name, a, b in zip(("out", "dq", "dk", "dv"), again, ours):
            assert torch.equal(a, b), f"{context}: {name} differs between two calls"


def test_deterministic_backward_is_bitwise_repeatable(seed):
    gen = torch.Generator().manual_seed(seed)
    layout, seq_len, heads = Layout("zigzag", 2), 8192, 8
    v_idx, s_idx = make_index(1, heads, seq_len, "mixed", gen)
    q, k, v, dout = make_qkv_dout(1, seq_len, heads, 1, 128, torch.bfloat16, DEVICE, gen)
    first = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, layout, deterministic=True)
    second = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, layout, deterministic=True)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs (seed={seed})"


def test_matches_torch_backend(seed):
    gen = torch.Generator().manual_seed(seed)
    layout = Layout("striped", 2)
    v_idx, s_idx = make_index(2, 4, 2048, "mixed", gen)
    q, k, v, dout = make_qkv_dout(2, 2048, 4, 2, 128, torch.bfloat16, DEVICE, gen)
    ours = ring_attention(triton_backend, q, k, v, dout, v_idx, s_idx, layout)
    theirs = ring_attention(torch_backend, q, k, v, dout, v_idx, s_idx, layout)
    for name, a, b in zip(NAMES, ours, theirs):
        rmse = ((a - b).norm() / b.norm()).item()
        assert rmse < 5e-3, f"{name}: relative RMSE {rmse:.2e} against torch_blocksparse (seed={seed})"


def test_rows_without_work_are_untouched(seed):
    """Head 1 has no work in rank 1's off-diagonal step: its out, lse and dq stay bit-identical."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = 1024
    v_idx = torch.tensor([[[10], [seq_len]]], dtype=torch.int32, device=DEVICE)
    s_idx = torch.tensor([[[700], [seq_len]]], dtype=torch.int32, device=DEVICE)
    index = convert_index(v_idx, s_idx, Layout("contiguous", 2), 1, seq_len)
    q, k, v, dout = make_qkv_dout(1, seq_len // 2, 2, 1, 128, torch.bfloat16, DEVICE, gen)
    lists = (index.blk_ptr[0], index.blk_col, index.bar_ptr[0], index.bar_col)
    out = torch.randn(q.shape, generator=gen).to(DEVICE)
    lse = torch.randn(1, 2, seq_len // 2, generator=gen).to(DEVICE)
    out0, lse0 = out.clone(), lse.clone()
    triton_backend.block_bar_forward(q, k, v, *lists, out, lse, causal_diag=False, softmax_scale=0.1)
    dq, dk, dv = (torch.randn(x.shape, device=DEVICE) for x in (q, k, v))
    dq0 = dq.clone()
    for deterministic in (False, True):
        triton_backend.block_bar_backward(
            q,
            k,
            v,
            dout,
            lse,
            torch.randn_like(lse),
            *lists,
            dq,
            dk,
            dv,
            causal_diag=False,
            softmax_scale=0.1,
            deterministic=deterministic,
        )
    assert torch.equal(out[:, :, 1], out0[:, :, 1]) and torch.equal(lse[:, 1], lse0[:, 1]), f"seed={seed}"
    assert torch.equal(dq[:, :, 1], dq0[:, :, 1]), f"dq of an idle head changed (seed={seed})"
    assert not torch.equal(out[:, :, 0], out0[:, :, 0]), f"the busy head was not updated (seed={seed})"


def test_cpu_tensors_are_rejected():
    q = torch.zeros(1, 128, 1, 64, dtype=torch.bfloat16)
    ptr = torch.zeros(1, 1, 2, dtype=torch.int32)
    col = torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):
        triton_backend.block_bar_forward(
            q,
            q,
            q,
            ptr,
            col,
            ptr,
            col,
            torch.zeros(q.shape),
            torch.zeros(1, 1, 128),
            causal_diag=True,
            softmax_scale=0.125,
        )


def test_a_repeat_launch_passes_cuda_tensors_by_address(seed, monkeypatch):
    """A repeat direct launch hands the launcher each CUDA tensor's address (no tensor: the launcher would ask the
    driver about each), and computes the same delta as the first, JIT-bound launch."""
    gen = torch.Generator().manual_seed(seed)
    out, dout = (torch.randn(1, 256, 2, 64, generator=gen).to("cuda", torch.float16) for _ in range(2))
    first = triton_backend.output_delta(out, dout)
    launch = direct(output_delta_kernel)
    if not _direct_path():
        pytest.skip(f"Triton {triton.__version__} launches through its JIT, not the direct path")
    handed = []
    for compiled in launch.compiled.values():  # run is a property over _run in the release of the direct path
        run = compiled.run
        monkeypatch.setattr(compiled, "_run", lambda *args, run=run: handed.append(args) or run(*args))
    delta = torch.full_like(first, float("nan"))
    triton_backend.output_delta(out, dout, delta)
    assert len(handed) == 1, f"{len(handed)} direct launches of the delta kernel, expected 1"
    assert not [a for a in handed[0] if isinstance(a, torch.Tensor)], "a tensor reached the launcher"
    assert {out.data_ptr(), dout.data_ptr(), delta.data_ptr()} <= set(handed[0]), "an address is missing"
    assert torch.equal(delta, first), f"seed={seed}: the repeat launch's delta differs from the first's"


def test_hopper_backward_takes_the_one_pass(seed):
    """On Hopper, with the Triton release the Gluon kernel is written for, the block tiles of every mode (default,
    deterministic, packed documents) take the one pass at head dim 128 (another release falls back to the two
    passes without a word: this test says so); head dim 64 keeps the two passes."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the one-pass backward is for Hopper")
    gen = torch.Generator().manual_seed(seed)
    for dim, expected in ((128, True), (64, False)):
        q, k, v, dout = make_qkv_dout(1, 1024, 4, 2, dim, torch.bfloat16, DEVICE, gen)
        dk = torch.zeros(k.shape, device=DEVICE)
        dv = torch.zeros_like(dk)
        assert (triton_backend._one_pass_backward(q, k, v, dout, dk, dv) is not None) == expected, f"d={dim}"
