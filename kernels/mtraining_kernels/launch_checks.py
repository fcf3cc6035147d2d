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


def check_doc_ids(query_doc_ids, key_doc_ids, batch: int, query_len: int, key_len: int, device) -> None:
    """Raise ``ValueError`` unless both are None or int32 ``[b, Nq]`` / ``[b, Nk]`` on ``device`` (packed documents)."""
    if (query_doc_ids is None) != (key_doc_ids is None):
        raise ValueError(
            "query_doc_ids and key_doc_ids go together (packed documents: index.step_doc_ids(source)); "
            "pass both or neither"
        )
    if query_doc_ids is None:
        return
    for name, ids, length in (("query_doc_ids", query_doc_ids, query_len), ("key_doc_ids", key_doc_ids, key_len)):
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32 or tuple(ids.shape) != (batch, length):
            raise ValueError(
                f"{name} must be an int32 tensor [b, {'Nq' if name[0] == 'q' else 'Nk'}] = {(batch, length)} "
                f"(the index's doc_ids of this step), got {getattr(ids, 'dtype', type(ids))} "
                f"{tuple(getattr(ids, 'shape', ()))}"
            )
        if ids.device != device:
            raise ValueError(f"{name} is on {ids.device}; move it to {device}")


# implementation="auto": the Triton kernel for CUDA tensors, PyTorch ops elsewhere; "torch" / "triton" force one
# path (the PyTorch path on a GPU; Triton-interpreter tests on the CPU). Both give the same results.
IMPLEMENTATIONS = ("auto", "torch", "triton")


def uses_triton(implementation: str, tensor: torch.Tensor) -> bool:
    """Whether ``implementation`` runs the Triton kernel for ``tensor``; ``ValueError`` for an unknown name."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    return implementation == "triton" or (implementation == "auto" and tensor.is_cuda)
