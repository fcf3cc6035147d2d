"""Dense causal ring attention on torch's SDPA kernels for the zigzag layout (the dense baseline).

``Layout("zigzag", W)`` cuts the sequence into 2W chunks of c = N/(2W) tokens; CP rank r holds chunks r
and 2W−1−r, in that order: q ``[b, 2c, Hq, d]``, k/v ``[b, 2c, Hkv, d]``. At flat-ring step t rank r
holds the K/V of source s = (r − t) mod W, and only step 0 needs a mask:

* s = r (step 0): causal over the local pair (local order is global order);
* s < r: every local query sees the source's first chunk (global s < r) and none of its second
  (global 2W−1−s > 2W−1−r);
* s > r: only the local second-chunk queries see the source, both chunks (r < s < 2W−1−s < 2W−1−r);
  the local first chunk sees neither.

Every step after the first is one c×2c or 2c×c rectangle, step 0 a causal 2c square: every rank does
the same work at every step. The schedule is ``ring/driver.py``'s, as for the sparse ring: K/V packed as
``[2, b, 2c, Hkv, d]`` circulate with the next transfer posted before the step's compute, and dK/dV
partials ride a second ring home; a step here is the SDPA call on its :func:`zigzag_step` rows. The
running out/lse stay local in fp32 (fp64 for fp64 inputs); in backward each step is recomputed by the
SDPA backward with the final out and lse. Flat ring only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtraining_kernels.interface import replay_output_error
from mtraining_kernels.layout import Layout
from mtraining_kernels.sdpa_backend import attention_backward, attention_forward, check_step_inputs
from mtraining_kernels.torch_backend import accumulator_dtype

from .comm import WIRE_DTYPES
from .consensus import agree_on_inputs
from .driver import run_backward_ring, run_forward_ring
from .groups import RingGroups


@dataclass(frozen=True)
class ZigzagStep:
    """One ring step: the local query rows ``queries`` attend the source's K/V rows ``keys``."""

    queries: slice
    keys: slice
    causal: bool


def zigzag_step(rank: int, source: int, local_len: int) -> ZigzagStep:
    """The rows rank ``rank`` computes against the K/V of ``source`` (both hold ``local_len`` = 2c tokens)."""
    chunk, everything = local_len // 2, slice(0, local_len)
    if source == rank:
        return ZigzagStep(everything, everything, causal=True)
    if source < rank:
        return ZigzagStep(everything, slice(0, chunk), causal=False)
    return ZigzagStep(slice(chunk, local_len), everything, causal=False)


def merge_step(out: torch.Tensor, lse: torch.Tensor, step_out: torch.Tensor, step_lse: torch.Tensor) -> None:
    """Merge one step's ``step_out [b, n, H, d]`` / ``step_lse [b, H, n]`` into the running out/lse, in place.

    Every lse of a dense causal ring is finite (each step gives each of its rows ≥ 1 key), so the
    weights σ(lse − step_lse) and σ(step_lse − lse) (DESIGN.md §2.4) need none of
    ``merge.merge_attention``'s −inf handling. They come from the difference of the two lse, not from
    the rounded merged lse, whose fp32 ulp at large |lse| would scale even the dominant side.
    """
    gap = lse - step_lse
    out.mul_(torch.sigmoid(gap).transpose(1, 2).unsqueeze(-1))
    out.addcmul_(step_out, torch.sigmoid(-gap).transpose(1, 2).unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, step_lse))


def _signature_error(
    q, k, v, layout: Layout, groups: RingGroups, impl: str, softmax_scale, grad_wire_dtype: str
) -> str:
    """Why this rank's inputs are unusable, or '' (local checks only; never raises)."""
    if grad_wire_dtype not in WIRE_DTYPES:
        return f"grad_wire_dtype={grad_wire_dtype!r} is not one of {sorted(WIRE_DTYPES)}"
    if groups.outer is not None:
        return (
            "the SDPA dense ring is flat only, got RingGroups with an outer ring (a hierarchical ring); "
            "pass flat RingGroups (outer=None)"
        )
    if not isinstance(layout, Layout) or layout.kind != "zigzag":
        return f"the SDPA dense ring needs the zigzag layout, got {layout!r}; use Layout('zigzag', world_size)"
    if layout.world_size != groups.world_size:
        return (
            f"layout is for world_size={layout.world_size} but the CP group has {groups.world_size} ranks; "
            f"use Layout('zigzag', {groups.world_size})"
        )
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            return f"{name} must be a 4-D tensor [b, N_loc, heads, d], got {getattr(tensor, 'shape', type(tensor))}"
    if k.shape[1] != q.shape[1]:
        return f"k has {k.shape[1]} tokens but q has {q.shape[1]}; every rank holds the same tokens of q, k and v"
    if q.shape[1] % 2:
        return (
            f"N_loc={q.shape[1]} is odd, but a zigzag rank holds two equal chunks; use a sequence length "
            f"that is a multiple of 2 x {groups.world_size}"
        )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    try:
        check_step_inputs(q, k, v, causal=True, softmax_scale=scale, impl=impl)
    except ValueError as error:
        return str(error)
    return ""


# every setting that changes what the dense ring sends or computes; the ranks agree on them exactly
_RING_SETTINGS = (
    "b",
    "N_loc",
    "Hq",
    "d",
    "k b",
    "k N_loc",
    "Hkv",
    "k d",
    "dtype",
    "layout",
    "impl",
    "softmax_scale",
    "grad_wire_dtype",
    "replay",
)


def check_dense_ring_inputs(
    q,
    k,
    v,
    layout: Layout,
    groups: RingGroups,
    impl: str,
    softmax_scale=None,
    grad_wire_dtype: str = "fp32",
    replay_output=None,
) -> None:
    """Raise a ``ValueError`` on every CP rank if any rank's inputs are bad, or if the ranks differ in any of
    :data:`_RING_SETTINGS` (shapes, dtype, layout, SDPA impl, resolved softmax scale, dK/dV wire dtype, or
    in replaying); one small all-gather over the CP group, as :func:`.sparse_ring.check_ring_inputs`."""
    error = _signature_error(q, k, v, layout, groups, impl, softmax_scale, grad_wire_dtype) or replay_output_error(
        q, replay_output
    )
    values = None
    if not error:
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        values = [
            *q.shape,
            *k.shape,
            q.dtype,
            repr(layout),
            impl,
            float(scale),
            grad_wire_dtype,
            int(replay_output is not None),
        ]
    agree_on_inputs(
        "dense ring attention",
        _RING_SETTINGS,
        values,
        ValueError(f"dense ring attention input on CP rank {groups.cp_rank}: {error}") if error else None,
        groups.cp,
    )


def dense_ring_forward(q, kv, groups: RingGroups, impl: str, scale: float):
    """The running (out ``[b, 2c, Hq, d]``, lse ``[b, Hq, 2c]``) in the accumulator dtype after all W steps;
    ``kv`` is this rank's ``[2, b, 2c, Hkv, d]``."""
    rank, local_len = groups.cp_rank, q.shape[1]
    acc = accumulator_dtype(q.dtype)
    out = lse = None

    def step(held, source, _t):
        nonlocal out, lse
        plan = zigzag_step(rank, source, local_len)
        step_out, step_lse = attention_forward(
            q[:, plan.queries],
            held[0][:, plan.keys],
            held[1][:, plan.keys],
            causal=plan.causal,
            softmax_scale=scale,
            impl=impl,
        )
        if out is None:  # step 0 covers every local query
            out, lse = step_out.to(acc).contiguous(), step_lse.to(acc)
        else:
            merge_step(out[:, plan.queries], lse[:, :, plan.queries], step_out, step_lse)

    run_forward_ring(kv, groups, step)
    return out, lse


def dense_ring_backward(q, kv, dout, out, lse, groups: RingGroups, impl: str, scale: float, wire: torch.dtype):
    """Returns (dq, dkv ``[2, b, 2c, Hkv, d]`` for this rank's own chunk pair), in lse's dtype."""
    rank, local_len = groups.cp_rank, q.shape[1]
    acc = lse.dtype
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)

    def step(held, source, _t):
        plan = zigzag_step(rank, source, local_len)
        rows, keys = plan.queries, plan.keys
        dq_step, dk_step, dv_step = attention_backward(
            dout[:, rows],
            q[:, rows],
            held[0][:, keys],
            held[1][:, keys],
            out[:, rows],
            lse[:, :, rows],
            causal=plan.causal,
            softmax_scale=scale,
            impl=impl,
        )
        dq[:, rows] += dq_step
        contribution = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        contribution[0, :, keys] = dk_step
        contribution[1, :, keys] = dv_step
        return contribution

    dkv = run_backward_ring(kv, groups, step, wire)
    return dq, dkv


class DenseRingAttention(torch.autograd.Function):
    """Autograd function of the zigzag dense ring; see :func:`dense_ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, groups, impl, scale, grad_wire, replay_output):
        kv = torch.stack([k, v])
        if replay_output is None:
            out, lse = dense_ring_forward(q, kv, groups, impl, scale)
            out_cast = out.to(q.dtype)
        else:
            out_cast, lse = replay_output
        ctx.save_for_backward(q, kv, out_cast, lse)
        ctx.setup = (groups, impl, scale, grad_wire)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient stays None: no zeros are made for it
        return out_cast, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = dense_ring_backward(q, kv, dout.contiguous(), out, lse, *ctx.setup)
        return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None, None, None


def dense_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    groups: RingGroups,
    *,
    impl: str = "cudnn",
    softmax_scale: float | None = None,
    grad_wire_dtype: str = "fp32",
    return_lse: bool = False,
    replay_output=None,
):
    """Dense causal attention of this rank's queries against the whole CP group, on SDPA ``impl`` kernels.

    q ``[b, N_loc, Hq, d]``, k/v ``[b, N_loc, Hkv, d]`` in ``layout`` = ``Layout("zigzag", W)`` over the
    flat ring ``groups``; ``impl`` is ``"cudnn"`` or ``"flash"`` (see ``mtraining_kernels.sdpa_backend``).
    Returns out ``[b, N_loc, Hq, d]`` in q's dtype (and lse ``[b, Hq, N_loc]``, fp32). ``replay_output``
    and the agreement on the inputs before the first send as in :func:`.sparse_ring.ring_attention`.
    """
    check_dense_ring_inputs(q, k, v, layout, groups, impl, softmax_scale, grad_wire_dtype, replay_output)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = DenseRingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), groups, impl, scale, WIRE_DTYPES[grad_wire_dtype], replay_output
    )
    return (out, lse) if return_lse else out
