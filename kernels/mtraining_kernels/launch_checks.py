"""Checks shared by the backends' step launchers (``torch_backend``, ``triton_backend``), and the choice
between a Triton kernel and its PyTorch twin (estimation, index conversion)."""

from __future__ import annotations

import torch


def check_accumulator(name: str, tensor, shape: tuple, dtype: torch.dtype, device, meaning: str) -> None:
    """Raise ``ValueError`` unless ``tensor`` is a contiguous ``dtype`` buffer of ``shape`` on ``device``.

    The launchers update these buffers in place (running out/lse, dq/dk/dv) or read them whole (lse, delta).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor ({meaning}), got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({meaning}), got {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}; it must be {dtype} ({meaning})")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}; move it to {device}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (it is updated in place); pass {name}.contiguous() "
            f"and read the result from that tensor"
        )


# implementation="auto": the Triton kernel for CUDA tensors, PyTorch ops elsewhere; "torch" / "triton" force one
# path (the PyTorch path on a GPU; Triton-interpreter tests on the CPU). Both give the same results.
IMPLEMENTATIONS = ("auto", "torch", "triton")


def uses_triton(implementation: str, tensor: torch.Tensor) -> bool:
    """Whether ``implementation`` runs the Triton kernel for ``tensor``; ``ValueError`` for an unknown name."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    return implementation == "triton" or (implementation == "auto" and tensor.is_cuda)
