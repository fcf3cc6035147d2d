"""The SDPA dense steps on CUDA (cuDNN and flash) and the zigzag dense ring over NCCL on 2 GPUs.

Against the fp32 reference by the DESIGN.md §6 FA rule (``triton_cases.assert_close_fa``; the bf16
reference is the low-precision baseline): out, lse, dq, dk, dv; bf16, head dims 64 and 128, GQA 1:1
and 4:1, N up to 16K; causal squares and the full rectangles of the ring's off-diagonal steps. Also
the CUDA-only refusals (fp32 inputs, head dims the kernel does not take).
"""

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from triton_cases import assert_close_fa, make_qkv_dout, reference_attention

from mtraining_kernels import sdpa_backend
from mtraining_kernels.interface import dense_attention
from mtraining_kernels.layout import Layout
from mtraining_kernels.reference import reference_sparse_attention
from mtraining_kernels.vertical_slash import full_index

pytestmark = pytest.mark.gpu
NAMES = ("out", "lse", "dq", "dk", "dv")
DEVICE = "cuda"
DTYPE = torch.bfloat16


def _causal_references(q, k, v, dout):
    """fp32 and bf16 causal references (one head at a time): two (out, lse, dq, dk, dv) tuples."""
    v_idx, s_idx = full_index(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    return tuple(reference_attention(q, k, v, dout, v_idx, s_idx, dtype) for dtype in (torch.float32, DTYPE))


@pytest.mark.parametrize("impl", sdpa_backend.IMPLS)
@pytest.mark.parametrize(
    "b, n, hq, hkv, d",
    [
        (2, 2048, 4, 4, 64),  # MHA
        (1, 4096, 8, 2, 128),  # GQA 4:1
        (1, 16384, 8, 2, 128),  # GQA 4:1, 16K
        (1, 8192, 4, 1, 64),  # GQA 4:1, d 64
    ],
)
def test_causal_step_and_autograd_match_reference(seed, impl, b, n, hq, hkv, d):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = make_qkv_dout(b, n, hq, hkv, d, DTYPE, DEVICE, gen)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = dense_attention(*leaves, impl=impl, return_lse=True)
    out.backward(dout)
    ours = (out.detach(), lse, *(x.grad for x in leaves))
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, n)
    ref, low = _causal_references(q, k, v, dout)
    context = f"seed={seed} {impl} b={b} N={n} Hq={hq} Hkv={hkv} d={d}"
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, DTYPE, context)


@pytest.mark.parametrize("impl", sdpa_backend.IMPLS)
@pytest.mark.parametrize("nq, nk", [(1024, 2048), (2048, 1024)])
def test_full_rectangle_step_matches_reference(seed, impl, nq, nk):
    """The ring's off-diagonal steps: no mask, Nq != Nk, GQA 4:1."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = 8, 2, 128
    q, _, _, dout = make_qkv_dout(1, nq, hq, hkv, d, DTYPE, DEVICE, gen)
    _, k, v, _ = make_qkv_dout(1, nk, hq, hkv, d, DTYPE, DEVICE, gen)
    scale = d**-0.5
    out, lse = sdpa_backend.attention_forward(q, k, v, causal=False, softmax_scale=scale, impl=impl)
    grads = sdpa_backend.attention_backward(dout, q, k, v, out, lse, causal=False, softmax_scale=scale, impl=impl)
    mask = torch.ones(nq, nk, dtype=torch.bool, device=DEVICE)
    results = []
    for dtype in (torch.float32, DTYPE):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        ref_out, ref_lse = reference_sparse_attention(*leaves, mask, softmax_scale=scale, compute_dtype=dtype)
        results.append((ref_out.detach(), ref_lse.detach(), *torch.autograd.grad(ref_out, leaves, dout.to(dtype))))
    context = f"seed={seed} {impl} full {nq}x{nk}"
    for name, a, r, lo in zip(NAMES, (out, lse, *grads), *results):
        assert_close_fa(name, a, r, lo, DTYPE, context)


@pytest.mark.parametrize(
    "impl, dtype, dim, message",
    [
        ("cudnn", torch.float32, 128, r"q has dtype torch\.float32; the CUDA cudnn kernel takes one of"),
        ("flash", torch.float32, 128, r"q has dtype torch\.float32; the CUDA flash kernel takes one of"),
        (
            "cudnn",
            DTYPE,
            192,
            r"head dim 192 is unsupported by the cudnn kernel; use a multiple of 8 up to 128 or "
            r"impl='flash'",
        ),
        ("flash", DTYPE, 60, r"head dim 60 is unsupported by the flash kernel; use a multiple of 8 up to 256"),
    ],
)
def test_cuda_refusals(impl, dtype, dim, message):
    q = torch.zeros(1, 128, 2, dim, dtype=dtype, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        sdpa_backend.attention_forward(q, q, q, causal=True, softmax_scale=dim**-0.5, impl=impl)


# ------------------------------------------------------------------------------------------ ring on 2 GPUs
def _inputs(seed, shape, device):
    b, n, hq, hkv, d = shape
    return make_qkv_dout(b, n, hq, hkv, d, DTYPE, device, torch.Generator().manual_seed(seed))


def _dense_ring_on_gpus(rank, world_size, seed, impl, shape, wire):
    from megatron_mtraining.ring.dense_ring import dense_ring_attention
    from megatron_mtraining.ring.groups import RingGroups

    layout = Layout("zigzag", world_size)
    q, k, v, dout = _inputs(seed, shape, torch.device("cuda", rank))
    local = [layout.shard(t, rank).contiguous().requires_grad_(t is not dout) for t in (q, k, v, dout)]
    out, lse = dense_ring_attention(
        local[0],
        local[1],
        local[2],
        layout,
        RingGroups.flat(dist.group.WORLD),
        impl=impl,
        grad_wire_dtype=wire,
        return_lse=True,
    )
    out.backward(local[3])
    return [t.detach().cpu() for t in (out, lse.transpose(1, 2), local[0].grad, local[1].grad, local[2].grad)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("impl", sdpa_backend.IMPLS)
@pytest.mark.parametrize(
    "shape, wire",
    [
        ((1, 8192, 8, 2, 128), "fp32"),
        ((1, 4096, 4, 1, 64), "fp32"),
        ((1, 16384, 8, 2, 128), "bf16"),
    ],
)
def test_zigzag_dense_ring_on_two_gpus_matches_reference(seed, impl, shape, wire):
    results = run_on_ranks(_dense_ring_on_gpus, 2, seed, impl, shape, wire, backend="nccl")
    layout = Layout("zigzag", 2)
    ours = [layout.unshard([r[i] for r in results]).to(DEVICE) for i in range(5)]
    ours[1] = ours[1].transpose(1, 2)
    ref, low = _causal_references(*_inputs(seed, shape, torch.device(DEVICE)))
    context = f"seed={seed} {impl} zigzag W=2 {shape} wire={wire}"
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, DTYPE, context)
