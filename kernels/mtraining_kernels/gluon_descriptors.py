"""Host tensor descriptors for the Gluon kernels' tensor-memory copies (``gluon_fwd``, ``gluon_bwd``)."""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def rows_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """Descriptor of contiguous ``[b, N, H, d]`` tensor ``t`` as ``[b·N, H·d]``, copying ``[rows, d]`` tiles."""
    batch, length, heads, dim = t.shape
    return _descriptor(t, (batch * length, heads * dim), [rows, dim], _tile_layout(rows, dim, t.dtype))


def dq_descriptor(dq: torch.Tensor, rows: int) -> TensorDescriptor:
    """Descriptor of contiguous fp32 ``[b, N, Hq, d]`` ``dq`` as ``[b·N, Hq·d]``, reducing ``[rows, d]`` slices
    into it from shared memory laid out as :data:`DQ_SLICE_LAYOUT`."""
    batch, length, heads, dim = dq.shape
    return _descriptor(dq, (batch * length, heads * dim), [rows, dim], DQ_SLICE_LAYOUT)


def stats_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """Descriptor of contiguous fp32 ``[b, Hq, N]`` row statistics ``t`` as ``[b·Hq, N]``, copying ``[1, rows]``."""
    batch, heads, length = t.shape
    return _descriptor(t, (batch * heads, length), [1, rows], _STATS_LAYOUT)


def _descriptor(
    t: torch.Tensor, shape: tuple[int, int], block_shape: list[int], layout: gl.NVMMASharedLayout
) -> TensorDescriptor:
    """``TensorDescriptor.from_tensor(t.view(shape), block_shape, layout)`` of contiguous ``t`` without the view or
    the per-call checks: the launcher reads only the base's address and dtype (its shape and strides are the
    descriptor's own), and the checks hold by construction here: 16-byte-aligned bases (the launchers check q, k, v
    and dO; the rest are fresh buffers), rows of whole 16-byte units, power-of-two tiles; the driver checks them
    again when it encodes the descriptor."""
    if not t.is_contiguous():
        raise ValueError(f"a tensor-memory descriptor needs a contiguous tensor, got strides {t.stride()}")
    descriptor = object.__new__(TensorDescriptor)
    descriptor.__dict__.update(
        base=t, shape=shape, strides=(shape[1], 1), block_shape=block_shape, layout=layout, padding="zero"
    )
    return descriptor


@functools.cache
def _tile_layout(rows: int, dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared layout of a bf16/fp16 ``[rows, dim]`` tile, built once per shape (it is immutable; building
    it is most of a descriptor's host time)."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([rows, dim], element)


_STATS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
DQ_SLICE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)  # fp32 dq slices
