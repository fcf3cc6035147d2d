"""Sparse ring attention over a context-parallel group (DESIGN.md §2.4, §2.5).

One autograd function serves the flat ring (outer size 1) and the hierarchical ring; the schedule
(K/V packed as ``[2, b, N_loc, Hkv, d]``, the next transfer posted before the current step's compute,
dK/dV partials on a second ring) is ``ring/driver.py``'s, and a step here is one block/bar kernel
launch on that step's source lists. Queries, the fp32 running output and lse stay local.

Inputs are already in the CP layout (the permutation happens once, in the data loader): q
``[b, N_loc, Hq, d]``, k/v ``[b, N_loc, Hkv, d]``; the block/bar lists come from
``mtraining_kernels.index.convert_index`` for this rank.
"""

from __future__ import annotations

import hashlib
import math

import torch

from mtraining_kernels.index import BlockBarIndex
from mtraining_kernels.interface import get_backend, replay_output_error
from mtraining_kernels.layout import Layout

from .comm import WIRE_DTYPES
from .consensus import agree_on_inputs
from .driver import run_backward_ring, run_forward_ring
from .groups import RingGroups


def _options_error(backend: str, softmax_scale, grad_wire_dtype: str) -> str:
    """Why the kernel ``backend``, ``softmax_scale`` or ``grad_wire_dtype`` is unusable, or '' (never raises)."""
    try:
        get_backend(backend)
    except (ValueError, ImportError) as error:
        return str(error)
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
    ):
        return f"softmax_scale={softmax_scale!r} must be a finite number, or None for 1/sqrt(d)"
    if grad_wire_dtype not in WIRE_DTYPES:
        return f"grad_wire_dtype={grad_wire_dtype!r} is not one of {sorted(WIRE_DTYPES)}"
    return ""


def _signature_error(q, k, v, index: BlockBarIndex, groups: RingGroups) -> str:
    """Why this rank's inputs are unusable, or '' (local checks only; never raises)."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            return f"{name} must be a 4-D tensor [b, N_loc, heads, d], got {getattr(tensor, 'shape', type(tensor))}"
    if not isinstance(index, BlockBarIndex):
        return f"index must be a BlockBarIndex from convert_index, got {type(index).__name__}"
    if not isinstance(index.layout, Layout) or index.layout.world_size != index.world_size:
        return (
            f"index carries layout {index.layout!r} for world_size={index.world_size}; build it with "
            "convert_index, which records the layout it was built for"
        )
    b, n_loc, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != n_loc or k.shape[3] != d:
        return f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}"
    if k.shape[2] == 0 or hq % k.shape[2]:
        return f"query heads {hq} are not divisible by KV heads {k.shape[2]}"
    if index.world_size != groups.world_size or index.rank != groups.cp_rank:
        return (
            f"index was built for world_size={index.world_size}, rank={index.rank} but this is CP rank "
            f"{groups.cp_rank} of {groups.world_size}; build it with this rank's layout"
        )
    if index.seq_len != n_loc * groups.world_size:
        return (
            f"index was built for seq_len={index.seq_len}, inputs have {n_loc} x {groups.world_size} tokens; "
            f"convert the index for N={n_loc * groups.world_size}"
        )
    if tuple(index.blk_ptr.shape[1:3]) != (b, hq):
        return (
            f"index covers [b, Hq]={tuple(index.blk_ptr.shape[1:3])}, q has {(b, hq)}; convert the index "
            "of this batch and these query heads"
        )
    if index.doc_ids is not None and tuple(index.doc_ids.shape) != (groups.world_size, b, n_loc):
        return (
            f"index carries document ids {tuple(index.doc_ids.shape)}, expected [W, b, N_loc]="
            f"{(groups.world_size, b, n_loc)}; convert the index with convert_document_index for these inputs"
        )
    return ""


def _documents_digest(index: BlockBarIndex) -> str | None:
    """SHA-256 of the index's document ids ``[W, b, N_loc]`` (one small host copy), None when unpacked: the
    documents as one agreed setting without sending them."""
    if index.doc_ids is None:
        return None
    return hashlib.sha256(index.doc_ids.contiguous().cpu().numpy().tobytes()).hexdigest()


# every setting that changes what the ring sends or computes; the ranks agree on them exactly
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
    "k dtype",
    "v dtype",
    "N",
    "index layout",
    "inner ring size",
    "outer ring size",
    "backend",
    "softmax_scale",
    "deterministic",
    "grad_wire_dtype",
    "replay",
    "documents",
)


def check_ring_inputs(
    q,
    k,
    v,
    index: BlockBarIndex,
    groups: RingGroups,
    *,
    backend: str,
    softmax_scale,
    deterministic: bool,
    grad_wire_dtype: str,
    replay_output=None,
) -> None:
    """Raise a ``ValueError`` on every CP rank if any rank's inputs are bad, or if the ranks differ in any
    of :data:`_RING_SETTINGS`: shapes, dtypes, the index's length and layout, the ring's shape, the kernel
    backend, the (resolved) softmax scale, determinism, the dK/dV wire dtype, in replaying an earlier
    forward's output, or in the packed documents (the index's ``doc_ids`` of every rank's chunk).

    Every call agrees over the CP group (one small all-gather, :func:`agree_on_inputs`): skipping it for
    inputs seen before would let a rank whose input changed enter the all-gather while its peers enter
    the ring.
    """
    error = (
        _options_error(backend, softmax_scale, grad_wire_dtype)
        or _signature_error(q, k, v, index, groups)
        or replay_output_error(q, replay_output)
    )
    values = None
    if not error:
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        values = [
            *q.shape,
            *k.shape,
            q.dtype,
            k.dtype,
            v.dtype,
            index.seq_len,
            repr(index.layout),
            groups.inner_size,
            groups.outer_size,
            backend,
            float(scale),
            bool(deterministic),
            grad_wire_dtype,
            int(replay_output is not None),
            _documents_digest(index),
        ]
    agree_on_inputs(
        "ring attention",
        _RING_SETTINGS,
        values,
        ValueError(f"ring attention input on CP rank {groups.cp_rank}: {error}") if error else None,
        groups.cp,
    )


def sparse_ring_forward(q, kv, index, groups, backend, scale):
    """The fp32 running (out ``[b, N_loc, Hq, d]``, lse ``[b, Hq, N_loc]``) after all W steps; ``kv`` is
    this rank's ``[2, b, N_loc, Hkv, d]``."""
    b, n_loc, hq, d = q.shape
    out = torch.zeros(b, n_loc, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, n_loc), float("-inf"), dtype=torch.float32, device=q.device)

    def step(held, source, t):
        backend.block_bar_forward(
            q,
            held[0],
            held[1],
            *index.step_lists(source),
            out,
            lse,
            causal_diag=t == 0,
            softmax_scale=scale,
            **index.step_doc_ids(source),
        )

    run_forward_ring(kv, groups, step)
    return out, lse


def sparse_ring_backward(q, kv, dout, out, lse, index, groups, backend, scale, deterministic, wire):
    """Returns (dq fp32, dkv fp32 ``[2, b, N_loc, Hkv, d]``) for this rank's own chunk; ``out`` is the
    forward's output in q's dtype, ``dout`` contiguous."""
    delta = backend.output_delta(out, dout)  # [b, Hq, N_loc]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def step(held, source, t):
        contribution = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        backend.block_bar_backward(
            q,
            held[0],
            held[1],
            dout,
            lse,
            delta,
            *index.step_lists(source),
            dq,
            contribution[0],
            contribution[1],
            causal_diag=t == 0,
            softmax_scale=scale,
            deterministic=deterministic,
            key_lists=index.key_lists(source),
            bar_chunks=index.bar_chunks(source, kv.shape[3]) if deterministic else None,
            bar_width=index.vertical_width,
            **index.step_doc_ids(source),
        )
        return contribution

    dkv = run_backward_ring(kv, groups, step, wire)
    return dq, dkv


class SparseRingAttention(torch.autograd.Function):
    """Autograd function for the flat and hierarchical sparse rings; see :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, index, groups, backend_name, scale, deterministic, grad_wire, replay_output):
        backend = get_backend(backend_name)
        kv = torch.stack([k, v])
        if replay_output is None:
            out, lse = sparse_ring_forward(q, kv, index, groups, backend, scale)
            out_cast = out.to(q.dtype)
        else:
            out_cast, lse = replay_output
        ctx.save_for_backward(q, kv, out_cast, lse)
        ctx.setup = (index, groups, backend, scale, deterministic, grad_wire)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient stays None: no zeros are made for it
        return out_cast, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, out, lse = ctx.saved_tensors
        index, groups, backend, scale, deterministic, grad_wire = ctx.setup
        dq, dkv = sparse_ring_backward(
            q, kv, dout.contiguous(), out, lse, index, groups, backend, scale, deterministic, grad_wire
        )
        return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: BlockBarIndex,
    groups: RingGroups,
    *,
    backend: str = "triton",
    softmax_scale: float | None = None,
    deterministic: bool = False,
    grad_wire_dtype: str = "fp32",
    return_lse: bool = False,
    replay_output=None,
):
    """Causal vertical-slash sparse attention of this rank's queries against the whole CP group.

    q ``[b, N_loc, Hq, d]``, k/v ``[b, N_loc, Hkv, d]`` in the layout ``index`` was built for.
    Returns out ``[b, N_loc, Hq, d]`` in q's dtype (and lse fp32 ``[b, Hq, N_loc]``). ``replay_output``:
    (out, lse) of an earlier forward of the same inputs (activation recomputation); the ring forward is
    skipped and they are returned, with this call's backward. Every CP rank must pass the same settings;
    bad or differing inputs raise a ``ValueError`` on every rank before the first send (:func:`check_ring_inputs`).
    """
    check_ring_inputs(
        q,
        k,
        v,
        index,
        groups,
        backend=backend,
        softmax_scale=softmax_scale,
        deterministic=deterministic,
        grad_wire_dtype=grad_wire_dtype,
        replay_output=replay_output,
    )
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = SparseRingAttention.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        index,
        groups,
        backend,
        scale,
        deterministic,
        WIRE_DTYPES[grad_wire_dtype],
        replay_output,
    )
    return (out, lse) if return_lse else out
