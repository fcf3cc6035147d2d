"""Small host → device copies that leave the host running (DESIGN.md §2.2: no host syncs on the hot path).

A copy from pageable host memory to a CUDA device makes PyTorch wait for the whole stream; from pinned
memory with ``non_blocking=True`` it is queued like a kernel. PyTorch's caching host allocator keeps the
pinned buffer until the copy has run, so the source may be dropped at once.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``: a CPU tensor reaches a CUDA device through pinned memory, without a sync."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new copy of the host ``tensor`` on ``device``, never ``tensor`` itself; from pinned memory it is queued
    without a sync (a kept source, pinned once, saves the pinning of every call)."""
    if device.type == "cuda":
        return tensor.to(device, non_blocking=tensor.is_pinned())
    return tensor.clone()
