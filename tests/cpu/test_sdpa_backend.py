"""The SDPA dense steps (mtraining_kernels.sdpa_backend) and ``interface.dense_attention`` on CPU.

On CPU impl "flash" runs torch's CPU flash kernel. Forward (out, lse) and dq/dk/dv are compared with
the masked reference: fp64 inputs against the fp64 reference to rounding, bf16 inputs by the DESIGN.md
§6 FA rule (``triton_cases.assert_close_fa``) against the fp32 reference, with the bf16 reference as the
low-precision baseline. Causal squares and full rectangles (the ring's off-diagonal steps), GQA 1:1 and
4:1. The backward step is also checked with a *final* out/lse of a larger key set, as the ring uses it.
"""

from __future__ import annotations

import pytest
import torch
from triton_cases import assert_close_fa

from mtraining_kernels import sdpa_backend
from mtraining_kernels.interface import dense_attention
from mtraining_kernels.reference import reference_sparse_attention

NAMES = ("out", "lse", "dq", "dk", "dv")


def _inputs(seed, b, nq, nk, hq, hkv, d, dtype):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, nq, hq, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, nk, hkv, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


def _mask(nq: int, nk: int, causal: bool) -> torch.Tensor:
    full = torch.ones(nq, nk, dtype=torch.bool)
    return full.tril() if causal else full


def _reference(q, k, v, dout, mask, compute_dtype, scale):
    """Masked reference out, lse, dq, dk, dv computed in ``compute_dtype`` (autograd)."""
    leaves = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
    out, lse = reference_sparse_attention(*leaves, mask, softmax_scale=scale, compute_dtype=compute_dtype)
    grads = torch.autograd.grad(out, leaves, dout.to(compute_dtype))
    return (out.detach(), lse.detach(), *grads)


def _steps(q, k, v, dout, causal, scale):
    out, lse = sdpa_backend.attention_forward(q, k, v, causal=causal, softmax_scale=scale, impl="flash")
    grads = sdpa_backend.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, impl="flash")
    return (out, lse, *grads)


SHAPES = [  # (b, Nq, Nk, Hq, Hkv, d, causal)
    (2, 96, 96, 4, 4, 32, True),  # causal, MHA
    (1, 160, 160, 8, 2, 64, True),  # causal, GQA 4:1
    (2, 48, 96, 4, 4, 16, False),  # full rectangle (a ring step's second-chunk queries), MHA
    (1, 96, 48, 8, 2, 64, False),  # full rectangle (all queries against one chunk), GQA 4:1
]
IDS = [f"{'causal' if s[-1] else 'full'}-{s[1]}x{s[2]}-gqa{s[3] // s[4]}-d{s[5]}" for s in SHAPES]


@pytest.mark.parametrize("b, nq, nk, hq, hkv, d, causal", SHAPES, ids=IDS)
def test_fp64_steps_match_the_fp64_reference(seed, b, nq, nk, hq, hkv, d, causal):
    q, k, v, dout = _inputs(seed, b, nq, nk, hq, hkv, d, torch.float64)
    scale = 0.7 * d**-0.5
    ours = _steps(q, k, v, dout, causal, scale)
    ref = _reference(q, k, v, dout, _mask(nq, nk, causal), torch.float64, scale)
    assert ours[1].dtype == torch.float64 and ours[1].shape == (b, hq, nq) and ours[1].is_contiguous()
    for name, a, r in zip(NAMES, ours, ref):
        assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != {tuple(r.shape)}"
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11, msg=lambda m: f"seed={seed} {name}: {m}")


@pytest.mark.parametrize("b, nq, nk, hq, hkv, d, causal", SHAPES, ids=IDS)
def test_bf16_steps_pass_the_fa_rule(seed, b, nq, nk, hq, hkv, d, causal):
    q, k, v, dout = _inputs(seed, b, nq, nk, hq, hkv, d, torch.bfloat16)
    scale = d**-0.5
    ours = _steps(q, k, v, dout, causal, scale)
    assert ours[1].dtype == torch.float32, "lse must be fp32 for low-precision inputs"
    assert all(x.dtype == torch.bfloat16 for i, x in enumerate(ours) if i != 1)
    mask = _mask(nq, nk, causal)
    ref = _reference(q, k, v, dout, mask, torch.float32, scale)
    low = _reference(q, k, v, dout, mask, torch.bfloat16, scale)
    for name, a, r, lo in zip(NAMES, ours, ref, low):
        assert_close_fa(name, a, r, lo, torch.bfloat16, f"seed={seed} {nq}x{nk} Hq={hq} Hkv={hkv} causal={causal}")


def test_backward_step_with_the_final_out_and_lse_gives_the_partial_gradients(seed):
    """Keys split in two steps (causal square + the rest, as a ring's steps): forward steps merged, each
    backward step run with the merged out/lse; the gradient sums equal the whole attention's."""
    b, n, hq, hkv, d = 1, 64, 8, 2, 16
    q, k_all, v_all, dout = _inputs(seed, b, n, 2 * n, hq, hkv, d, torch.float64)
    scale = d**-0.5
    # queries are the second half of a causal 2n sequence: keys [0, n) full, keys [n, 2n) causal
    past, present = slice(0, n), slice(n, 2 * n)
    out_p, lse_p = sdpa_backend.attention_forward(
        q, k_all[:, past], v_all[:, past], causal=False, softmax_scale=scale, impl="flash"
    )
    out_c, lse_c = sdpa_backend.attention_forward(
        q, k_all[:, present], v_all[:, present], causal=True, softmax_scale=scale, impl="flash"
    )
    lse = torch.logaddexp(lse_p, lse_c)
    out = (
        out_p * (lse_p - lse).exp().transpose(1, 2)[..., None] + out_c * (lse_c - lse).exp().transpose(1, 2)[..., None]
    )
    dq_p, dk_p, dv_p = sdpa_backend.attention_backward(
        dout, q, k_all[:, past], v_all[:, past], out, lse, causal=False, softmax_scale=scale, impl="flash"
    )
    dq_c, dk_c, dv_c = sdpa_backend.attention_backward(
        dout, q, k_all[:, present], v_all[:, present], out, lse, causal=True, softmax_scale=scale, impl="flash"
    )
    mask = torch.cat([torch.ones(n, n, dtype=torch.bool), _mask(n, n, True)], dim=1)
    ref = _reference(q, k_all, v_all, dout, mask, torch.float64, scale)
    ours = (out, lse, dq_p + dq_c, torch.cat([dk_p, dk_c], 1), torch.cat([dv_p, dv_c], 1))
    for name, a, r in zip(NAMES, ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11, msg=lambda m: f"seed={seed} {name}: {m}")


@pytest.mark.parametrize("hkv", [4, 1])
def test_dense_attention_autograd_matches_the_reference(seed, hkv):
    b, n, hq, d = 2, 128, 4, 32
    q, k, v, dout = _inputs(seed, b, n, n, hq, hkv, d, torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = dense_attention(*leaves, impl="flash", return_lse=True)
    out.backward(dout)
    ref = _reference(q, k, v, dout, _mask(n, n, True), torch.float64, d**-0.5)
    ours = (out.detach(), lse, *(x.grad for x in leaves))
    assert not lse.requires_grad
    for name, a, r in zip(NAMES, ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11, msg=lambda m: f"seed={seed} {name}: {m}")


# ------------------------------------------------------------------------------------------ refusals
def _qkv(dtype=torch.float32, heads=4, kv_heads=2, nq=32, nk=32, d=16):
    return (
        torch.zeros(1, nq, heads, d, dtype=dtype),
        torch.zeros(1, nk, kv_heads, d, dtype=dtype),
        torch.zeros(1, nk, kv_heads, d, dtype=dtype),
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(impl="math"), r"impl='math' is unknown; use one of \('cudnn', 'flash'\)"),
        (dict(impl="cudnn"), r"impl='cudnn' needs CUDA tensors, got CPU tensors; .*use impl='flash'"),
        (dict(qkv=_qkv(dtype=torch.int32)), r"q has dtype torch\.int32; on CPU use one of \(torch\.float32"),
        (dict(qkv=_qkv(heads=3)), r"query heads 3 are not divisible by KV heads 2; use Hq a multiple of Hkv"),
        (dict(qkv=_qkv(nq=16)), r"causal=True needs as many queries as keys, got Nq=16, Nk=32"),
        (
            dict(qkv=(*_qkv()[:2], torch.zeros(1, 32, 2, 16, dtype=torch.float64))),
            r"q, k, v must share dtype and device, got torch\.float32/torch\.float32/torch\.float64",
        ),
        (dict(scale=0.0), r"softmax_scale=0\.0 must be a finite positive number"),
        (dict(qkv=tuple(t.to("meta") for t in _qkv())), r"tensors on device meta are unsupported; use CUDA tensors"),
    ],
)
def test_unsupported_inputs_are_refused(change, message):
    q, k, v = change.get("qkv", _qkv())
    with pytest.raises(ValueError, match=message):
        sdpa_backend.attention_forward(
            q, k, v, causal=True, softmax_scale=change.get("scale", 0.25), impl=change.get("impl", "flash")
        )


def test_backward_refuses_an_lse_of_another_shape():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 4, 32\) \[b, Hq, Nq\], got \(1, 32, 4\)"):
        sdpa_backend.attention_backward(
            q, q, k, v, q, torch.zeros(1, 32, 4), causal=True, softmax_scale=0.25, impl="flash"
        )
