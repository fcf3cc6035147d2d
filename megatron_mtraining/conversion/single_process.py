"""Megatron's ``dist_checkpointing`` in this one process, as the converters run it: a one-rank gloo group,
and (without CUDA) the few CUDA calls of the ``torch_dist`` writer kept on the CPU.
"""

from __future__ import annotations

import queue
from contextlib import contextmanager
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist


@contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank gloo process group for ``dist_checkpointing`` (kept as is when one already exists)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def torch_dist_writer_on_cpu() -> Iterator[None]:
    """Let Megatron's ``torch_dist`` writer save from this one-process gloo group without CUDA; restored on exit.

    With CUDA nothing is replaced. Without it, for the duration of the block: ``torch.cuda.current_device``
    → ``"cpu"`` (the writer broadcasts its failure flag as a tensor on the current device),
    ``torch.cuda.synchronize`` → no-op (called after the copy to host memory, where the tensors already
    are), and the write-results queue → an in-process ``queue.Queue`` (a synchronous save writes from
    threads of this process; the stock queue would start a ``multiprocessing`` manager process).
    """
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with (
        mock.patch.object(torch.cuda, "current_device", lambda: "cpu"),
        mock.patch.object(torch.cuda, "synchronize", lambda device=None: None),
        mock.patch.object(filesystem_async, "_results_queue", queue.Queue()),
    ):
        yield
