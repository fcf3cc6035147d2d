"""Dense attention steps on torch's own SDPA kernels, returning the log-sum-exp (the dense baseline).

A *step* is one attention call whose (out, lse) a caller merges with other steps (the dense ring in
``megatron_mtraining.ring.dense_ring``) or uses as is (single device, ``interface.dense_attention``). The
backward step recomputes with a given (final) out and lse, as a ring backward needs.

Implementations (``impl``), through torch's private ops that return the lse:

* ``"cudnn"`` — ``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``), CUDA only;
* ``"flash"`` — ``aten._scaled_dot_product_flash_attention`` (+ ``_backward``) on CUDA, and
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``) on CPU, which makes the ring
  logic testable without a GPU.

Nothing falls back to another kernel: an input this module does not accept raises ``ValueError``
naming the value and the fix; a kernel that refuses a shape raises its own error.

Shapes: q ``[b, Nq, Hq, d]``; k, v ``[b, Nk, Hkv, d]`` (GQA: query head h reads KV head h // (Hq/Hkv);
K/V are expanded to Hq heads for the call and dK/dV summed back over each group); out ``[b, Nq, Hq, d]``
in q's dtype; lse ``[b, Hq, Nq]`` contiguous, fp32 (fp64 for fp64 inputs on CPU). ``causal`` needs
Nq == Nk and lets query i see keys 0 … i.
"""

from __future__ import annotations

import math

import torch

IMPLS = ("cudnn", "flash")
CUDA_DTYPES = (torch.bfloat16, torch.float16)
CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = {"cudnn": 128, "flash": 256}  # CUDA kernels; head dims must also be multiples of 8
_aten = torch.ops.aten


def check_step_inputs(q, k, v, *, causal: bool, softmax_scale: float, impl: str) -> None:
    """Raise ``ValueError`` (naming the value and the fix) unless a step of ``impl`` can take these inputs."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is unknown; use one of {IMPLS}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor [b, N, heads, d], got {getattr(tensor, 'shape', type(tensor))}"
            )
    b, nq, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)} on [b, ·, ·, d]")
    if min(b, nq, hq, d, k.shape[1], k.shape[2]) == 0:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} have an empty dimension; pass non-empty tensors")
    if hq % k.shape[2]:
        raise ValueError(f"query heads {hq} are not divisible by KV heads {k.shape[2]}; use Hq a multiple of Hkv")
    if causal and nq != k.shape[1]:
        raise ValueError(
            f"causal=True needs as many queries as keys, got Nq={nq}, Nk={k.shape[1]}; split the "
            "step into a causal square and a full rectangle"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )
    if (
        not isinstance(softmax_scale, (int, float))
        or isinstance(softmax_scale, bool)
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite positive number (usually d ** -0.5)")
    device = q.device.type
    if device == "cpu":
        if impl == "cudnn":
            raise ValueError(
                "impl='cudnn' needs CUDA tensors, got CPU tensors; move them to a GPU or use "
                "impl='flash' (torch's CPU flash kernel)"
            )
        if q.dtype not in CPU_DTYPES:
            raise ValueError(f"q has dtype {q.dtype}; on CPU use one of {CPU_DTYPES}")
        return
    if device != "cuda":
        raise ValueError(f"tensors on device {q.device} are unsupported; use CUDA tensors (or CPU with impl='flash')")
    if q.dtype not in CUDA_DTYPES:
        raise ValueError(f"q has dtype {q.dtype}; the CUDA {impl} kernel takes one of {CUDA_DTYPES}, cast the inputs")
    if d % 8 or d > MAX_HEAD_DIM[impl]:
        raise ValueError(
            f"head dim {d} is unsupported by the {impl} kernel; use a multiple of 8 up to "
            f"{MAX_HEAD_DIM[impl]}" + (" or impl='flash'" if impl == "cudnn" and d <= 256 else "")
        )


def _check_backward_inputs(dout, q, out, lse) -> None:
    b, nq, hq, _ = q.shape
    for name, tensor in (("dout", dout), ("out", out)):
        if not isinstance(tensor, torch.Tensor) or tensor.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(getattr(tensor, 'shape', ()))}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (b, hq, nq):
        raise ValueError(f"lse must have shape {(b, hq, nq)} [b, Hq, Nq], got {tuple(getattr(lse, 'shape', ()))}")
    expected = torch.float64 if q.dtype == torch.float64 else torch.float32
    if lse.dtype != expected:
        raise ValueError(f"lse has dtype {lse.dtype}; the kernels take {expected} (as the forward step returns it)")


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[b, N, Hkv, d]`` → ``[b, N, Hkv·group, d]``: KV head j serves query heads j·group … (j+1)·group − 1."""
    if group == 1:
        return x
    b, n, hkv, d = x.shape
    return x[:, :, :, None].expand(b, n, hkv, group, d).reshape(b, n, hkv * group, d)


def _sum_groups(grad: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of :func:`_expand_kv` for gradients: sum each group of query heads (in fp32 or fp64)."""
    if group == 1:
        return grad
    b, n, hq, d = grad.shape
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    return grad.view(b, n, hq // group, group, d).sum(3, dtype=acc).to(grad.dtype)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[b, N, H, d]`` → the ``[b, H, N, d]`` view the SDPA ops take (no copy)."""
    return x.transpose(1, 2)


def attention_forward(q, k, v, *, causal: bool, softmax_scale: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One dense step: out ``[b, Nq, Hq, d]`` (q's dtype) and lse ``[b, Hq, Nq]`` (fp32; fp64 on CPU fp64)."""
    check_step_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, impl=impl)
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = _heads_first(q), _heads_first(_expand_kv(k, group)), _heads_first(_expand_kv(v, group))
    scale = float(softmax_scale)
    if impl == "cudnn":
        out, lse = _aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, causal, False, scale=scale)[
            :2
        ]
    elif q.device.type == "cuda":
        out, lse = _aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, causal, scale=scale)
    b, nq, hq, _ = q.shape
    return out.transpose(1, 2), lse.reshape(b, hq, nq).contiguous()  # cuDNN's lse is [b, Hq, Nq, 1]


def attention_backward(
    dout, q, k, v, out, lse, *, causal: bool, softmax_scale: float, impl: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one step: dq ``[b, Nq, Hq, d]``, dk/dv ``[b, Nk, Hkv, d]`` in the input dtype.

    ``out`` and ``lse`` are the FINAL output and lse of the rows (after merging every step), so that
    P = exp(scale·q·kᵀ − lse) and rowsum(dout ⊙ out) are the whole attention's, not this step's.
    """
    check_step_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale, impl=impl)
    _check_backward_inputs(dout, q, out, lse)
    group = q.shape[2] // k.shape[2]
    if dout.stride() != out.stride():  # the cuDNN backward wants dout laid out like out
        dout, out = dout.contiguous(), out.contiguous()
    qh, kh, vh = _heads_first(q), _heads_first(_expand_kv(k, group)), _heads_first(_expand_kv(v, group))
    douth, outh, lse = _heads_first(dout), _heads_first(out), lse.contiguous()
    scale = float(softmax_scale)
    if impl == "cudnn":
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed/offset: read only with dropout
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            douth,
            qh,
            kh,
            vh,
            outh,
            lse.unsqueeze(-1),
            no_rng,
            no_rng,
            None,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            causal,
            scale=scale,
        )
    elif q.device.type == "cuda":
        no_rng = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            douth, qh, kh, vh, outh, lse, None, None, q.shape[1], k.shape[1], 0.0, causal, no_rng, no_rng, scale=scale
        )
    else:
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            douth, qh, kh, vh, outh, lse, 0.0, causal, scale=scale
        )
    dq, dk, dv = (x.transpose(1, 2) for x in (dq, dk, dv))
    return dq, _sum_groups(dk, group), _sum_groups(dv, group)
