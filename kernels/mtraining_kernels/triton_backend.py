"""Triton backend (``triton``, DESIGN.md §2.6): launchers for one ring step.

Same signatures and semantics as ``mtraining_kernels.torch_backend``:

* :func:`block_bar_forward` — fused block + bar flash attention of the local queries against one
  source chunk, merged in place into the running fp32 (out, lse);
* :func:`block_bar_backward` — that step's dq, dk, dv, accumulated in place into fp32 buffers: dq
  query-major, the block tiles' dk/dv key-block-major through a CSR-by-key copy of the block lists
  (registers, no atomics). The bars' dk/dv: by default fp32 atomics in the query-major pass;
  ``deterministic=True``: per chunk of distinct bar columns, reduced over the GQA group in a fixed
  order, so repeated backwards are bitwise equal (lists from ``mtraining_kernels.bar_chunks``).
  On Hopper (head dim 128) the block tiles' dk/dv come from one warp-specialised pass instead
  (``mtraining_kernels.gluon_bwd``, key-block-major). In the default mode without documents it also adds
  their dq by atomics, and a second launch of it takes the bars by column (``mtraining_kernels.bar_words``),
  so no query-major pass runs; in the deterministic mode (documents or not) the query-major pass keeps the
  blocks' dq and the bars. The default mode with documents keeps the two passes.
  A fresh forward step without documents takes ``mtraining_kernels.gluon_fwd`` (its bars gathered there).

Inputs: q ``[b, Nq, Hq, d]``, k/v ``[b, Nk, Hkv, d]`` (Nk == Nq, a multiple of 128), bf16/fp16,
head dim 64 or 128, any strides with a unit last stride (otherwise they are made contiguous);
one step's lists ``blk_ptr``/``bar_ptr`` int32 ``[b, Hq, nb+1]`` with absolute offsets into the
1-D int32 ``blk_col``/``bar_col`` (see ``mtraining_kernels.index.BlockBarIndex``: each listed block as
its sub-tile pair 2j, 2j+1, which the forward reads as one tile; values are not checked here, as that
would cost a device sync per step, the reference backend checks them); fp32, contiguous in-place buffers.
Packed documents: ``query_doc_ids``/``key_doc_ids`` as in ``mtraining_kernels.torch_backend``.
Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``. On Hopper and newer the contiguous tiles load by
tensor-memory copies (host descriptors); elsewhere, and for inputs not 16-byte aligned, by pointer gathers.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .bar_chunks import BAR_CHUNK_COLUMNS, bar_chunks_by_column
from .bar_words import bar_words_by_column
from .direct_launch import direct
from .index import KeyLists, block_lists_by_key
from .launch_checks import check_accumulator, check_doc_ids
from .layout import BLOCK_SIZE
from .triton_bwd import (
    bar_chunk_backward_kernel,
    bar_member_sum_kernel,
    key_major_backward_kernel,
    output_delta_kernel,
    query_major_backward_kernel,
)
from .triton_fwd import block_bar_forward_kernel

SUB_TILE = 64
HEAD_DIMS = (64, 128)
INPUT_DTYPES = (torch.bfloat16, torch.float16)
ACCUMULATOR_DTYPE = torch.float32  # the running out/lse, delta and the dq/dk/dv accumulators
LOG2E = 1.4426950408889634
ONE_PASS_TRITON = "3.6."  # the release gluon_bwd runs on (3.8 renamed gl.thread_barrier, for one)
# Below this many listed query blocks per (key block, query head) in a step, on average, the default mode without
# documents takes dq from the query-major pass (written, in q's dtype where fresh) and the block tiles' dk/dv from the
# one pass without dq, as the deterministic mode does, rather than all three from the one pass adding into a
# zero-filled fp32 dq that is then copied. With bars in the step the query-major pass also takes over the bars, whose
# pointer gathers lose to the one pass's launch by column, so the route pays on shorter lists only (DESIGN.md §2.6;
# docs/benchmarks.md, session 39).
SHORT_LISTS = 16
SHORT_LISTS_WITH_BARS = 7


# ---------------------------------------------------------------------------------------- checks
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take any strides but read rows as contiguous vectors."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_inputs(q, k, v, softmax_scale) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [b, N, H, d], got {getattr(t, 'shape', type(t))}")
    if q.dtype not in INPUT_DTYPES:
        raise ValueError(
            f"q has dtype {q.dtype}; the triton backend takes {INPUT_DTYPES} (cast q, k, v, "
            f"or use backend='torch_blocksparse' for fp32/fp64)"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"q is on {q.device}; the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for CPU)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v devices differ ({q.device}, {k.device}, {v.device})")
    batch, query_len, heads, dim = q.shape
    if dim not in HEAD_DIMS:
        raise ValueError(f"q head dim {dim} is unsupported by the triton backend; use one of {HEAD_DIMS}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"k/v {tuple(k.shape)} disagree with q {tuple(q.shape)} on batch or head dim")
    if query_len == 0 or query_len % BLOCK_SIZE:
        raise ValueError(f"q length {query_len} must be a positive multiple of the block size {BLOCK_SIZE}")
    if k.shape[1] != query_len:
        raise ValueError(f"k/v length {k.shape[1]} must equal q length {query_len} (one source chunk per step)")
    kv_heads = k.shape[2]
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a positive multiple of KV heads {kv_heads} (GQA)")
    if (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, (int, float))
        or not math.isfinite(softmax_scale)
        or softmax_scale <= 0
    ):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a finite positive number (usually head_dim ** -0.5)")


def _check_lists(blk_ptr, blk_col, bar_ptr, bar_col, batch: int, heads: int, num_blocks: int, device) -> None:
    """Shapes, dtypes and devices only: checking values would cost a device sync per step."""
    for name, ptr, col in (("blk", blk_ptr, blk_col), ("bar", bar_ptr, bar_col)):
        expected = (batch, heads, num_blocks + 1)
        if not isinstance(ptr, torch.Tensor) or ptr.dtype != torch.int32 or tuple(ptr.shape) != expected:
            raise ValueError(
                f"{name}_ptr must be an int32 tensor of shape {expected} ([b, Hq, nb+1], one step's "
                f"slice such as index.{name}_ptr[w]), got {getattr(ptr, 'dtype', type(ptr))} "
                f"{tuple(getattr(ptr, 'shape', ()))}"
            )
        if not isinstance(col, torch.Tensor) or col.dtype != torch.int32 or col.dim() != 1:
            raise ValueError(
                f"{name}_col must be a 1-D int32 tensor, got {getattr(col, 'dtype', type(col))} "
                f"{tuple(getattr(col, 'shape', ()))}"
            )
        if ptr.device != device or col.device != device:
            raise ValueError(f"{name}_ptr/{name}_col are on {ptr.device}/{col.device}; move them to {device}")
        if ptr.stride(-1) != 1:
            raise ValueError(f"{name}_ptr must have a unit last stride; pass {name}_ptr.contiguous()")
        if not col.is_contiguous():
            raise ValueError(f"{name}_col must be contiguous; pass {name}_col.contiguous()")


def _document_arguments(query_doc_ids, key_doc_ids, q: torch.Tensor, key_len: int, placeholder: torch.Tensor):
    """The kernels' (QUERY_DOCS, KEY_DOCS, stride_docb) and ``DOCUMENTS`` flag; without documents a
    placeholder pointer the kernels never read."""
    check_doc_ids(query_doc_ids, key_doc_ids, q.shape[0], q.shape[1], key_len, q.device)
    if query_doc_ids is None:
        return (placeholder, placeholder, 0), {"DOCUMENTS": False}
    query_doc_ids, key_doc_ids = query_doc_ids.contiguous(), key_doc_ids.contiguous()
    return (query_doc_ids, key_doc_ids, query_doc_ids.stride(0)), {"DOCUMENTS": True}


# ---------------------------------------------------------------------------------------- configs
# Picked from the compiler's resource report for sm_90 (no register spills, loads pipelined): the
# forward uses 192-229 registers; the key-major passes walk a query block in 64-row slices, since
# whole 128-row slices spill with dk/dv [64, d] held in registers. The query-major backward's three
# pipeline stages and the bar-chunk pass's four warps were picked by timing (tools/tune_triton.py; the
# timings are in docs/benchmarks.md).
def _forward_config(dim: int) -> dict:
    return {"num_warps": 4 if dim == 64 else 8, "num_stages": 3}


QUERY_MAJOR_CONFIG = {"num_warps": 8, "num_stages": 3}
KEY_MAJOR_CONFIG = {"num_warps": 8, "num_stages": 3, "QUERY_ROWS": 64}
BAR_CHUNK_CONFIG = {"num_warps": 4, "num_stages": 2, "QUERY_ROWS": 64}


@functools.cache
def _cuda_device_facts(device_index: int) -> tuple[int, int]:
    """(compute capability major, streaming multiprocessors) of CUDA device ``device_index``, asked once: the
    launchers consult them on every step, and torch's queries cost the host microseconds each time."""
    properties = torch.cuda.get_device_properties(device_index)
    return properties.major, properties.multi_processor_count


def _device_facts(device: torch.device) -> tuple[int, int]:
    """:func:`_cuda_device_facts` of a CUDA ``device`` (one without an index is the current device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_device_facts(index)


def _capability_major(device: torch.device) -> int:
    """The compute capability major of a CUDA device (9 for Hopper)."""
    return _device_facts(device)[0]


def _multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device, which size the bars' segments; 1 elsewhere (the
    interpreter runs the programs one after another)."""
    return _device_facts(device)[1] if device.type == "cuda" else 1


def _copies_tiles(*tensors: torch.Tensor) -> bool:
    """Whether the kernels read these ``[b, N, H, d]`` tensors' tiles by tensor-memory-access copies: the
    device has them (Hopper or newer; the interpreter emulates them) and every address and stride is a
    16-byte multiple. Otherwise the kernels gather the same tiles by pointer."""
    device = tensors[0].device
    if not (_interpreting() or (device.type == "cuda" and _capability_major(device) >= 9)):
        return False
    return all(
        t.data_ptr() % 16 == 0 and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
        for t in tensors
    )


def _one_pass_backward(q, k, v, dout, dk, dv):
    """``gluon_bwd.one_pass_backward`` where it applies, else None (the two passes of ``triton_bwd``): on Hopper
    (sm_90), head dim 128, contiguous 16-byte-aligned operands, and the Triton release whose Gluon API the kernel
    is written in and was tested with (:data:`ONE_PASS_TRITON`; Gluon is experimental and its API changes
    between releases)."""
    if _interpreting() or q.device.type != "cuda":
        return None
    if not triton.__version__.startswith(ONE_PASS_TRITON):
        return None
    if _capability_major(q.device) != 9 or q.shape[3] != 128 or dk.stride() != dv.stride():
        return None
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v, dout)):
        return None
    from .gluon_bwd import one_pass_backward  # Gluon only where it runs

    return one_pass_backward


def _gluon_block_forward(q, k, v, out, fresh: bool, documents: bool):
    """``gluon_fwd.block_forward`` where it applies, else None (``triton_fwd``): one fresh step writing out in
    q's dtype, without documents, on Hopper (sm_90), head dim 128, contiguous 16-byte-aligned operands, and the
    Triton release of :data:`ONE_PASS_TRITON`."""
    if not fresh or documents or _interpreting() or q.device.type != "cuda":
        return None
    if not triton.__version__.startswith(ONE_PASS_TRITON) or out.dtype != q.dtype or not out.is_contiguous():
        return None
    if _capability_major(q.device) != 9 or q.shape[3] != 128:
        return None
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v, out)):  # out: a copy's target too
        return None
    from .gluon_fwd import block_forward  # Gluon only where it runs

    return block_forward


def _tile_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """Descriptor of ``[b, N, H, d]`` tensor ``t`` copying ``[1, rows, 1, d]`` tiles (one (sample, head)), without
    ``TensorDescriptor``'s per-call checks: :func:`_copies_tiles` has checked its address and strides, its last
    stride is 1 and the tiles are powers of two; the driver checks them again when it encodes the descriptor."""
    descriptor = object.__new__(TensorDescriptor)
    descriptor.__dict__.update(
        base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=[1, rows, 1, t.shape[3]], padding="zero"
    )
    return descriptor


MAX_BAR_CHUNK_SPLITS = 8
BAR_CHUNK_PROGRAMS = 256  # about two per multiprocessor of an H100/H200


def _bar_chunk_splits(chunks: int) -> int:
    """Parts each bar chunk's walk is split into: the smallest power of two (up to :data:`MAX_BAR_CHUNK_SPLITS`)
    that gives a step's chunks :data:`BAR_CHUNK_PROGRAMS` programs. A function of the lists alone, so the
    deterministic sums are the same on every device."""
    splits = 1
    while splits < MAX_BAR_CHUNK_SPLITS and splits * chunks < BAR_CHUNK_PROGRAMS:
        splits *= 2
    return splits


def _tiles(dim: int) -> dict:
    return {"HEAD_DIM": dim, "BLOCK_M": BLOCK_SIZE, "BLOCK_N": SUB_TILE}


def _bhs(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, token, head) strides of a ``[b, N, H, d]`` tensor."""
    return t.stride()[:3]


# ---------------------------------------------------------------------------------------- forward
def block_bar_forward(
    q,
    k,
    v,
    blk_ptr,
    blk_col,
    bar_ptr,
    bar_col,
    out,
    lse,
    *,
    causal_diag: bool,
    softmax_scale: float,
    query_doc_ids=None,
    key_doc_ids=None,
    fresh: bool = False,
) -> None:
    """Attend one source chunk through one step's lists and merge into (out, lse) in place.

    q ``[b, Nq, Hq, d]``; k, v ``[b, Nk, Hkv, d]``; blk_ptr/bar_ptr int32 ``[b, Hq, nb+1]``
    (absolute offsets into blk_col/bar_col); out fp32 ``[b, Nq, Hq, d]`` and lse fp32 ``[b, Hq, Nq]``,
    contiguous. lse = −inf means "nothing yet"; rows without work are not written. ``fresh``: out and lse
    hold nothing yet (uninitialised is fine) and this step is the only one: every row is written, out in its
    own dtype (q's, or fp32) — the same values as merging into zeros and −inf, then casting.
    ``causal_diag`` applies the token causal mask to query block i's sub-tiles 2i and 2i+1.
    ``query_doc_ids`` int32 ``[b, Nq]`` and ``key_doc_ids`` int32 ``[b, Nk]`` (packed documents, both or
    neither; ``BlockBarIndex.step_doc_ids``): a listed score counts only where the two ids agree.
    """
    _check_inputs(q, k, v, softmax_scale)
    batch, query_len, heads, dim = q.shape
    num_blocks = query_len // BLOCK_SIZE
    _check_lists(blk_ptr, blk_col, bar_ptr, bar_col, batch, heads, num_blocks, q.device)
    out_dtype = out.dtype if fresh and isinstance(out, torch.Tensor) and out.dtype == q.dtype else ACCUMULATOR_DTYPE
    check_accumulator("out", out, tuple(q.shape), out_dtype, q.device, "the running output [b, Nq, Hq, d]")
    check_accumulator("lse", lse, (batch, heads, query_len), ACCUMULATOR_DTYPE, q.device, "the running lse [b, Hq, Nq]")
    documents, document_flag = _document_arguments(query_doc_ids, key_doc_ids, q, k.shape[1], blk_ptr)
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    block_forward = _gluon_block_forward(q, k, v, out, fresh, document_flag["DOCUMENTS"])
    if block_forward is not None:
        bars = dict(bar_ptr=bar_ptr, bar_col=bar_col) if bar_col.numel() else {}  # a shape: no host sync
        programs = _multiprocessors(q.device)
        block_forward(
            q,
            k,
            v,
            blk_ptr,
            blk_col,
            out,
            lse,
            causal_diag=causal_diag,
            softmax_scale=softmax_scale,
            programs=programs,
            **bars,
        )
        return
    tma = _copies_tiles(k, v)
    k_desc, v_desc = (_tile_descriptor(t, BLOCK_SIZE) for t in (k, v)) if tma else (k, v)
    direct(block_bar_forward_kernel)(
        (num_blocks, heads, batch),
        q,
        k,
        v,
        k_desc,
        v_desc,
        out,
        lse,
        blk_ptr,
        blk_col,
        bar_ptr,
        bar_col,
        *documents[:2],
        *_bhs(q),
        *_bhs(k),
        *_bhs(v),
        *_bhs(out),
        lse.stride(0),
        lse.stride(1),
        blk_ptr.stride(0),
        blk_ptr.stride(1),
        documents[2],
        num_blocks,
        heads // k.shape[2],
        softmax_scale * LOG2E,
        CAUSAL_DIAG=bool(causal_diag),
        FRESH=bool(fresh),
        TMA=tma,
        **document_flag,
        **_tiles(dim),
        **_forward_config(dim),
    )


# ---------------------------------------------------------------------------------------- backward
def output_delta(out: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """delta fp32 ``[b, Hq, N]`` = rowsum(out ⊙ dout) over d, from out and dout ``[b, N, Hq, d]`` (one pass, no
    fp32 copies of either); written into ``delta`` where given (contiguous)."""
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[1] % BLOCK_SIZE:
        raise ValueError(f"out must be a [b, N, Hq, d] tensor with N a multiple of {BLOCK_SIZE}, got {out.shape}")
    if not isinstance(dout, torch.Tensor) or dout.shape != out.shape or dout.device != out.device:
        raise ValueError(f"dout {getattr(dout, 'shape', None)} must match out {tuple(out.shape)} on {out.device}")
    batch, seq_len, heads, dim = out.shape
    out, dout = _unit_last_stride(out), _unit_last_stride(dout)
    if delta is None:
        delta = torch.empty(batch, heads, seq_len, dtype=ACCUMULATOR_DTYPE, device=out.device)
    direct(output_delta_kernel)(
        (seq_len // BLOCK_SIZE, heads, batch),
        out,
        dout,
        delta,
        *_bhs(out),
        *_bhs(dout),
        delta.stride(0),
        delta.stride(1),
        HEAD_DIM=dim,
        BLOCK_M=BLOCK_SIZE,
    )
    return delta


def _entry_range(ptr: torch.Tensor) -> tuple[int, int]:
    """(first, last) offset of one step's CSR slice ``[b, Hq, nb+1]``, checking that its rows lie back to
    back (DESIGN: ptr[b, h, nb] == ptr[b, h+1, 0]), as a bad slice would otherwise read the wrong entries
    silently. One host sync."""
    starts = ptr[..., :-1].reshape(-1).long()
    counts = (ptr[..., 1:] - ptr[..., :-1]).reshape(-1).long()
    first = ptr.reshape(-1)[0].long()
    scattered = (starts != torch.cumsum(counts, 0) - counts + first).any()
    first, last, scattered = torch.stack([first, ptr.reshape(-1)[-1].long(), scattered.long()]).tolist()
    if scattered:
        raise ValueError(
            "blk_ptr/bar_ptr rows are not back to back (ptr[b, h, nb] != ptr[b, h+1, 0]); "
            "pass one step's slice of a BlockBarIndex"
        )
    return first, last


def _check_backward(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    blk_ptr,
    blk_col,
    bar_ptr,
    bar_col,
    dq,
    dk,
    dv,
    *,
    softmax_scale,
    fresh_dq,
    fresh_dkv,
    out,
) -> None:
    """:func:`block_bar_backward`'s argument checks."""
    _check_inputs(q, k, v, softmax_scale)
    batch, query_len, heads = q.shape[:3]
    num_blocks = query_len // BLOCK_SIZE
    _check_lists(blk_ptr, blk_col, bar_ptr, bar_col, batch, heads, num_blocks, q.device)
    if not isinstance(dout, torch.Tensor) or dout.dtype != q.dtype:
        raise ValueError(f"dout must be a tensor of q's dtype {q.dtype}, got {getattr(dout, 'dtype', type(dout))}")
    if dout.shape != q.shape or dout.device != q.device:
        raise ValueError(f"dout {tuple(dout.shape)} on {dout.device} must match q {tuple(q.shape)} on {q.device}")
    check_accumulator("lse", lse, (batch, heads, query_len), ACCUMULATOR_DTYPE, q.device, "the final lse [b, Hq, Nq]")
    if delta is not None:
        check_accumulator(
            "delta", delta, (batch, heads, query_len), ACCUMULATOR_DTYPE, q.device, "rowsum(out * dout) [b, Hq, Nq]"
        )
    elif not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"delta is None, so out must be the forward's output like q ({tuple(q.shape)} {q.dtype} on {q.device}), "
            f"got {type(out).__name__} {tuple(getattr(out, 'shape', ()))}; pass it, or pass delta"
        )
    dq_dtype = dq.dtype if fresh_dq and isinstance(dq, torch.Tensor) and dq.dtype == q.dtype else ACCUMULATOR_DTYPE
    check_accumulator("dq", dq, tuple(q.shape), dq_dtype, q.device, "the dq accumulator [b, Nq, Hq, d]")
    fresh_low = fresh_dkv and isinstance(dk, torch.Tensor) and dk.dtype == k.dtype
    dkv_dtype = k.dtype if fresh_low else ACCUMULATOR_DTYPE
    check_accumulator("dk", dk, tuple(k.shape), dkv_dtype, q.device, "the dk accumulator [b, Nk, Hkv, d]")
    check_accumulator("dv", dv, tuple(v.shape), dkv_dtype, q.device, "the dv accumulator [b, Nk, Hkv, d]")


def block_bar_backward(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    blk_ptr,
    blk_col,
    bar_ptr,
    bar_col,
    dq,
    dk,
    dv,
    *,
    causal_diag: bool,
    softmax_scale: float,
    deterministic: bool = False,
    query_doc_ids=None,
    key_doc_ids=None,
    key_lists=None,
    bar_chunks=None,
    bar_width: int | None = None,
    fresh_dq: bool = False,
    fresh_dkv: bool = False,
    out=None,
    validated: bool = False,
) -> None:
    """Accumulate one step's gradients in place.

    lse fp32 ``[b, Hq, Nq]`` is the FINAL merged lse and delta fp32 ``[b, Hq, Nq]`` = rowsum(out ⊙ dout), or
    None with ``out`` (the forward's, like q): then computed here, inside the query-major pass where that pass
    runs first (no launch of its own), else by :func:`output_delta`. dout ``[b, Nq, Hq, d]`` in q's dtype. With
    P = exp(scale·q·kᵀ − lse), dS = P ⊙ (dout·vᵀ − delta): dq fp32 ``[b, Nq, Hq, d]`` += scale·dS·k,
    dk fp32 ``[b, Nk, Hkv, d]`` += scale·dSᵀ·q, dv += Pᵀ·dout.
    ``key_lists`` (:class:`~mtraining_kernels.index.KeyLists`): this step's block lists by key,
    ``BlockBarIndex.key_lists(source)``; without it they are built here (one host sync).
    ``deterministic`` uses no atomics; repeated calls on the same inputs are then bitwise equal. It reads
    the bars regrouped by column, ``bar_chunks`` (a :class:`~mtraining_kernels.bar_chunks.BarChunks`,
    ``BlockBarIndex.bar_chunks(source, Hkv)``); without it they are built here (one host sync).
    ``bar_width`` bounds the distinct bar columns of one (sample, query head) in this step (the index's
    ``vertical_width``): the Hopper one pass regroups the default mode's bars by column
    (:func:`~mtraining_kernels.bar_words.bar_words_by_column`) in chunks sized by it; without it they are
    counted there (one host sync).
    Document ids as in :func:`block_bar_forward`.
    ``fresh_dq``: dq holds nothing yet and this step is its only one: it is written, not added to, in its
    own dtype (q's, or fp32). ``fresh_dkv``: the same for dk and dv (k's dtype or fp32). The Hopper one pass
    writes them itself where it is their only contributor (no bars, no documents); otherwise they are accumulated
    in fp32 and copied.
    ``validated``: the caller vouches for every argument, so none is checked: the tensors and lists of a forward
    this backend checked, a dout that autograd matched to that forward's output, and dq/dk/dv made like q/k/v
    (the single-device interface's backward, where the checks would delay the first launch).
    """
    if not validated:
        _check_backward(
            q,
            k,
            v,
            dout,
            lse,
            delta,
            blk_ptr,
            blk_col,
            bar_ptr,
            bar_col,
            dq,
            dk,
            dv,
            softmax_scale=softmax_scale,
            fresh_dq=fresh_dq,
            fresh_dkv=fresh_dkv,
            out=out,
        )
    fresh_low = fresh_dkv and dk.dtype == k.dtype  # dk and dv written whole in k's dtype
    batch, query_len, heads, dim = q.shape
    num_blocks = query_len // BLOCK_SIZE
    documents, document_flag = _document_arguments(query_doc_ids, key_doc_ids, q, k.shape[1], blk_ptr)
    q, k, v, dout = (_unit_last_stride(t) for t in (q, k, v, dout))
    one_pass = _one_pass_backward(q, k, v, dout, dk, dv)
    sole_pass = one_pass is not None and not bar_col.numel() and not document_flag["DOCUMENTS"]  # no host sync
    if fresh_dkv and not (fresh_low and sole_pass):  # dk, dv summed in fp32 over passes, then written
        dk_sum, dv_sum = (torch.zeros(t.shape, dtype=ACCUMULATOR_DTYPE, device=q.device) for t in (k, v))
        block_bar_backward(
            q,
            k,
            v,
            dout,
            lse,
            delta,
            blk_ptr,
            blk_col,
            bar_ptr,
            bar_col,
            dq,
            dk_sum,
            dv_sum,
            causal_diag=causal_diag,
            softmax_scale=softmax_scale,
            deterministic=deterministic,
            query_doc_ids=query_doc_ids,
            key_doc_ids=key_doc_ids,
            key_lists=key_lists,
            bar_chunks=bar_chunks,
            bar_width=bar_width,
            fresh_dq=fresh_dq,
            out=out,
            validated=True,
        )
        dk.copy_(dk_sum)
        dv.copy_(dv_sum)
        return
    delta_from_out = delta is None
    if delta_from_out:
        out = _unit_last_stride(out)
        delta = torch.empty(batch, heads, query_len, dtype=ACCUMULATOR_DTYPE, device=q.device)
    kv_heads = k.shape[2]
    group = heads // kv_heads
    tiles = _tiles(dim)
    qk_scale_log2 = softmax_scale * LOG2E
    operand_strides = (*_bhs(q), *_bhs(k), *_bhs(v), *_bhs(dout))

    if key_lists is None:
        key_lists = KeyLists(*block_lists_by_key(blk_ptr, blk_col, *_entry_range(blk_ptr)), steps=1)
    key_ptr, key_qblock, list_steps = key_lists
    tma = _copies_tiles(q, k, v, dout)

    def one_pass_block_tiles(dq_out, bar_words=None) -> None:  # dq_out None: dk and dv alone
        one_pass(
            q,
            k,
            v,
            dout,
            lse,
            delta,
            dq_out,
            dk,
            dv,
            key_ptr,
            key_qblock,
            causal_diag=bool(causal_diag),
            softmax_scale=softmax_scale,
            documents=documents[:2] if document_flag["DOCUMENTS"] else None,
            bar_words=bar_words,
            list_steps=list_steps,
        )

    def query_major_pass(dq_out, fresh: bool, with_delta: bool) -> None:  # with_delta: it writes delta first
        direct(query_major_backward_kernel)(
            (num_blocks, heads, batch),
            q,
            k,
            v,
            *((_tile_descriptor(k, SUB_TILE), _tile_descriptor(v, SUB_TILE)) if tma else (k, v)),
            dout,
            out if with_delta else dout,  # strided as dout
            lse,
            delta,
            dq_out,
            dk,
            dv,
            blk_ptr,
            blk_col,
            bar_ptr,
            bar_col,
            *documents[:2],
            *operand_strides,
            *_bhs(dq_out),
            *_bhs(dk),
            *_bhs(dv),
            lse.stride(0),
            lse.stride(1),
            blk_ptr.stride(0),
            blk_ptr.stride(1),
            documents[2],
            num_blocks,
            group,
            softmax_scale,
            qk_scale_log2,
            CAUSAL_DIAG=bool(causal_diag),
            ATOMIC_BAR_DKDV=not deterministic,
            FRESH_DQ=fresh,
            DELTA_FROM_OUT=with_delta,
            TMA=tma,
            **document_flag,
            **tiles,
            **QUERY_MAJOR_CONFIG,
        )

    one_pass_dq = one_pass is not None and not deterministic and not document_flag["DOCUMENTS"]
    short_limit = SHORT_LISTS_WITH_BARS if bar_col.numel() else SHORT_LISTS  # shapes, so no host sync
    short_lists = one_pass_dq and key_qblock.numel() < short_limit * list_steps * batch * heads * num_blocks
    fused_delta = delta_from_out and not (one_pass_dq and not short_lists) and out.stride() == dout.stride()
    if delta_from_out and not fused_delta:
        output_delta(out, dout, delta)
    if one_pass_dq and not short_lists:  # the block tiles, then the bars by column, each in one pass adding into dq
        dq_sum = dq  # the one pass reduces into an fp32 dq through a tensor descriptor: 16-byte-aligned start
        if dq.dtype != ACCUMULATOR_DTYPE or dq.data_ptr() % 16 != 0:
            dq_sum = torch.zeros(q.shape, dtype=ACCUMULATOR_DTYPE, device=q.device)
        elif fresh_dq:
            dq_sum.zero_()
        bar_words = None
        if bar_col.numel() and bar_width != 0:
            bar_words = bar_words_by_column(bar_ptr, bar_col, k.shape[1], bar_width, _multiprocessors(q.device))
        one_pass_block_tiles(dq_sum, bar_words)
        if dq_sum is not dq:  # written on a fresh step, else added to the caller's accumulator
            if fresh_dq:
                dq.copy_(dq_sum)
            else:
                dq.add_(dq_sum)
        return
    query_major_pass(dq, fresh=bool(fresh_dq), with_delta=fused_delta)
    if one_pass is not None and (deterministic or short_lists):  # the block tiles' dk/dv in the one pass, no dq
        one_pass_block_tiles(None)
    else:  # the block tiles' dk/dv in the key-major pass
        query_rows = KEY_MAJOR_CONFIG["QUERY_ROWS"]
        direct(key_major_backward_kernel)(
            (num_blocks, kv_heads, batch),
            q,
            k,
            v,
            dout,
            *((_tile_descriptor(q, query_rows), _tile_descriptor(dout, query_rows)) if tma else (q, dout)),
            lse,
            delta,
            dk,
            dv,
            key_ptr,
            key_qblock,
            *documents[:2],
            *operand_strides,
            *_bhs(dk),
            *_bhs(dv),
            key_ptr.stride(0),
            key_ptr.stride(1),
            lse.stride(0),
            lse.stride(1),
            documents[2],
            num_blocks,
            heads,
            group,
            softmax_scale,
            qk_scale_log2,
            CAUSAL_DIAG=bool(causal_diag),
            HEAD_DIM=dim,
            BLOCK_M=BLOCK_SIZE,
            TMA=tma,
            **document_flag,
            **KEY_MAJOR_CONFIG,
        )
    if not deterministic:
        return

    if bar_chunks is None:
        entry_range = _entry_range(bar_ptr)  # no vertical width here: N_loc bounds a head's bar columns
        bar_chunks = bar_chunks_by_column(bar_ptr[None], bar_col, *entry_range, query_len, kv_heads, query_len)
    if bar_chunks.shape != (batch, heads, num_blocks) or bar_chunks.kv_heads != kv_heads:
        raise ValueError(
            f"bar_chunks were built for (b, Hq, nb) = {bar_chunks.shape} and {bar_chunks.kv_heads} KV heads, "
            f"this step has {(batch, heads, num_blocks)} and {kv_heads}; pass index.bar_chunks(source, {kv_heads})"
        )
    if bar_chunks.max_chunks == 0:
        return
    source = bar_chunks.source
    step_first_slot = bar_chunks.source_slots[source:]
    splits = _bar_chunk_splits(bar_chunks.max_chunks)
    scratch_dk = torch.empty(splits * bar_chunks.max_slots, dim, dtype=torch.float32, device=q.device)
    scratch_dv = torch.empty_like(scratch_dk)
    direct(bar_chunk_backward_kernel)(
        (bar_chunks.max_chunks, splits),
        q,
        k,
        v,
        dout,
        lse,
        delta,
        scratch_dk,
        scratch_dv,
        bar_chunks.source_chunks[source:],
        step_first_slot,
        bar_chunks.chunk_head,
        bar_chunks.chunk_first,
        bar_chunks.chunk_length,
        bar_chunks.column,
        bar_chunks.pair_ptr,
        bar_chunks.pair_qblock,
        bar_chunks.pair_bits,
        *documents[:2],
        *operand_strides,
        lse.stride(0),
        lse.stride(1),
        documents[2],
        heads,
        group,
        softmax_scale,
        qk_scale_log2,
        bar_chunks.max_slots,
        SPLITS=splits,
        **document_flag,
        **{**tiles, "BLOCK_N": BAR_CHUNK_COLUMNS},
        **BAR_CHUNK_CONFIG,
    )
    direct(bar_member_sum_kernel)(
        (bar_chunks.max_targets,),
        scratch_dk,
        scratch_dv,
        dk,
        dv,
        bar_chunks.source_targets[source:],
        step_first_slot,
        bar_chunks.target_row,
        bar_chunks.target_ptr,
        bar_chunks.target_slot,
        *_bhs(dk),
        *_bhs(dv),
        query_len,
        kv_heads,
        bar_chunks.max_slots,
        HEAD_DIM=dim,
        SPLITS=splits,
    )
