"""Counting the host reads of our code on a CPU (each one is a device synchronisation on a GPU), and the
synchronisations themselves on a GPU.

:class:`HostReads` is a ``TorchFunctionMode`` that records every tensor operation that hands a value to
the host (``int()``, ``bool()``, ``float()``, ``item``, ``tolist``, ``nonzero``, ``cpu``, boolean-mask
indexing, ``repeat_interleave`` without ``output_size``, ``unique``) when it is called from a file of
``mtraining_kernels`` or ``megatron_mtraining``, so Triton's interpreter and torch itself do not count.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

OUR_PACKAGES = ("mtraining_kernels", "megatron_mtraining")
READS = {"__int__", "__bool__", "__float__", "__index__", "item", "tolist", "nonzero", "cpu", "numpy", "unique"}


def _is_host_read(name: str, args: tuple, kwargs: dict) -> bool:
    if name in READS:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name == "__getitem__" and len(args) > 1:
        keys = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(key, torch.Tensor) and key.dtype == torch.bool for key in keys)
    return False


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...``, then ``reads.sites``: ``"file:line op"`` of every host read."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _is_host_read(name, args, kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if any(part in OUR_PACKAGES for part in Path(caller).parts):
                self.sites.append(f"{Path(caller).name}:{sys._getframe(1).f_lineno} {name}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_syncs():
    """``with device_syncs() as syncs: ...``: the synchronising CUDA calls made inside the block, as the
    warnings of torch's sync debug mode (one per call; on a CUDA device only)."""
    torch.cuda.synchronize()
    syncs: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the mode's own notice ("a prototype feature ...") is no synchronising call
    calls = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    syncs.extend(message for message in calls if "prototype feature" not in message)
