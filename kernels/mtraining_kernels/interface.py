"""Single-device vertical-slash sparse attention with autograd (DESIGN.md §2.6).

A thin ``torch.autograd.Function`` over a backend's step launchers (``block_bar_forward`` /
``block_bar_backward``), run once with the world-size-1 index: source 0, diagonal causal mask on.
The running output and lse are kept in fp32 (fp64 for fp64 inputs) and the output is cast to the
input dtype once at the end. Distributed use goes through the ring in ``megatron_mtraining.ring.sparse_ring``.
:func:`dense_attention` is the dense baseline on torch's SDPA kernels (``sdpa_backend``).

Shapes: q ``[b, N, Hq, d]``; k, v ``[b, N, Hkv, d]`` (GQA: query head h reads KV head
h // (Hq/Hkv)); lse ``[b, Hq, N]``; N a multiple of 128.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from . import sdpa_backend
from .index import BlockBarIndex, convert_index
from .layout import Layout
from .torch_backend import accumulator_dtype

BACKEND_MODULES = {
    "torch_blocksparse": "mtraining_kernels.torch_backend",
    "triton": "mtraining_kernels.triton_backend",
}


def get_backend(name: str) -> ModuleType:
    """The module providing ``block_bar_forward``/``block_bar_backward`` for backend ``name``."""
    if name not in BACKEND_MODULES:
        raise ValueError(f"backend={name!r} is unknown; use one of {sorted(BACKEND_MODULES)}")
    try:
        return importlib.import_module(BACKEND_MODULES[name])
    except ImportError as err:
        raise ImportError(
            f"backend {name!r} is unavailable ({err}); install its requirements or use backend='torch_blocksparse'"
        ) from err


def replay_output_error(q: torch.Tensor, replay_output) -> str:
    """Why ``replay_output`` cannot stand in for this call's forward, or '' (None, or (out, lse) of an
    earlier forward: out like ``q`` ``[b, N, Hq, d]``, lse float ``[b, Hq, N]``, on q's device)."""
    if replay_output is None:
        return ""
    if not isinstance(replay_output, tuple) or len(replay_output) != 2:
        return f"replay_output must be the (out, lse) pair of an earlier forward, got {type(replay_output).__name__}"
    out, lse = replay_output
    batch, seq_len, heads, _ = q.shape
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        return (
            f"replay_output out {tuple(out.shape)} {out.dtype} on {out.device} must match q {tuple(q.shape)} "
            f"{q.dtype} on {q.device}; pass the out of the same call's first forward"
        )
    if lse.shape != (batch, heads, seq_len) or not lse.is_floating_point() or lse.device != q.device:
        return (
            f"replay_output lse {tuple(lse.shape)} {lse.dtype} must be a float [b, Hq, N] = "
            f"{(batch, heads, seq_len)} on {q.device}; pass the lse of the same call's first forward"
        )
    return ""


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        index: BlockBarIndex,
        softmax_scale: float,
        backend: ModuleType,
        deterministic: bool,
        replay_output,
    ):
        if replay_output is None:
            batch, seq_len, heads, _ = q.shape
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            lse = torch.empty(batch, heads, seq_len, dtype=accumulator_dtype(q.dtype), device=q.device)
            backend.block_bar_forward(
                q,
                k,
                v,
                *index.step_lists(0),
                out,
                lse,
                causal_diag=True,
                softmax_scale=softmax_scale,
                fresh=True,
                **index.step_doc_ids(0),
            )
        else:
            out, lse = replay_output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.index, ctx.softmax_scale, ctx.backend, ctx.deterministic = index, softmax_scale, backend, deterministic
        ctx.forward_checked = replay_output is None  # the backend's forward checked q, k, v, the lists, out and lse
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient stays None: no zeros are made for it
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        ctx.backend.block_bar_backward(
            q,
            k,
            v,
            dout,
            lse,
            None,  # delta = rowsum(out ⊙ dout), computed by the backend from out
            *ctx.index.step_lists(0),
            dq,
            dk,
            dv,
            causal_diag=True,
            softmax_scale=ctx.softmax_scale,
            deterministic=ctx.deterministic,
            key_lists=ctx.index.key_lists(0),
            bar_chunks=ctx.index.bar_chunks(0, k.shape[2]) if ctx.deterministic else None,
            bar_width=ctx.index.vertical_width,
            fresh_dq=True,
            fresh_dkv=True,
            out=out,
            validated=ctx.forward_checked,  # autograd matched dout to out; dq, dk, dv are made here
            **ctx.index.step_doc_ids(0),
        )
        return dq, dk, dv, None, None, None, None, None


def _check_single_device(q: torch.Tensor, index: BlockBarIndex) -> None:
    if not isinstance(index, BlockBarIndex):
        raise ValueError(f"index must be a BlockBarIndex from convert_index, got {type(index).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor [b, N, Hq, d], got {getattr(q, 'shape', type(q))}")
    if index.world_size != 1:
        raise ValueError(
            f"index was built for world_size={index.world_size}; sparse_attention is single-device, "
            f"build it with Layout(kind, 1) and rank 0 (or use the ring for context parallelism)"
        )
    if index.seq_len != q.shape[1]:
        raise ValueError(f"index was built for seq_len={index.seq_len} but q has length {q.shape[1]}")


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index: BlockBarIndex,
    *,
    softmax_scale: float | None = None,
    backend: str = "torch_blocksparse",
    return_lse: bool = False,
    deterministic: bool = False,
    replay_output=None,
):
    """Causal vertical-slash sparse attention on one device, differentiable in q, k, v.

    ``index`` is ``convert_index(v_idx, s_idx, Layout(kind, 1), 0, N)``, or for packed documents
    ``convert_document_index(document_index, Layout(kind, 1), 0)``. Returns out
    ``[b, N, Hq, d]`` in q's dtype and, with ``return_lse``, lse ``[b, Hq, N]`` (fp32; fp64 for fp64
    inputs; not differentiable). ``deterministic`` makes the backward bitwise repeatable.
    ``replay_output``: (out, lse) of an earlier forward of the same q, k, v and index (activation
    recomputation); the forward is skipped and they are returned, with this call's backward.
    """
    _check_single_device(q, index)
    if error := replay_output_error(q, replay_output):
        raise ValueError(error)
    launcher = get_backend(backend)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = _SparseAttention.apply(q, k, v, index, scale, launcher, deterministic, replay_output)
    return (out, lse) if return_lse else out


def torch_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_idx: torch.Tensor,
    s_idx: torch.Tensor,
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """:func:`sparse_attention` on the ``torch_blocksparse`` backend, straight from (v_idx, s_idx).

    v_idx/s_idx int32 ``[b, Hq, Vmax/Smax]``, ascending, sentinel N for unused slots (DESIGN.md §2.1).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor [b, N, Hq, d], got {getattr(q, 'shape', type(q))}")
    index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, q.shape[1])
    return sparse_attention(
        q, k, v, index, softmax_scale=softmax_scale, backend="torch_blocksparse", return_lse=return_lse
    )


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float, impl: str, replay_output):
        if replay_output is None:
            out, lse = sdpa_backend.attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, impl=impl)
        else:
            out, lse = replay_output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = (causal, softmax_scale, impl)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # lse's gradient stays None: no zeros are made for it
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, softmax_scale, impl = ctx.setup
        dq, dk, dv = sdpa_backend.attention_backward(
            dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, impl=impl
        )
        return dq, dk, dv, None, None, None, None


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    impl: str = "cudnn",
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    replay_output=None,
):
    """Dense attention on one device on torch's SDPA kernels (``sdpa_backend``), differentiable in q, k, v.

    q ``[b, N, Hq, d]``, k/v ``[b, N, Hkv, d]``; ``impl`` is ``"cudnn"`` (CUDA) or ``"flash"`` (CUDA, or
    torch's CPU flash kernel). Returns out ``[b, N, Hq, d]`` in q's dtype and, with ``return_lse``, lse
    ``[b, Hq, N]`` (fp32; not differentiable). ``replay_output`` as in :func:`sparse_attention`.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor [b, N, Hq, d], got {getattr(q, 'shape', type(q))}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    sdpa_backend.check_step_inputs(q, k, v, causal=causal, softmax_scale=scale, impl=impl)  # before autograd
    if error := replay_output_error(q, replay_output):
        raise ValueError(error)
    out, lse = _DenseAttention.apply(q, k, v, causal, scale, impl, replay_output)
    return (out, lse) if return_lse else out
