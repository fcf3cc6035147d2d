"""Run a function on W processes joined by a process group (gloo on CPU, or NCCL with one GPU per
rank), and collect per-rank results.

Used by every distributed test. The function must be defined at module level (it is pickled into
the worker processes) and is called as ``fn(rank, world_size, *args)``; its return value must be
picklable. A rank that raises makes the whole call fail with that rank's traceback; a call that
exceeds ``timeout`` fails and its processes are killed, so a hang can never block the suite.

Starting a process that imports torch and Megatron costs seconds, so the W processes of a world
size are kept between calls (one gloo group each); a failed or timed-out call retires them, and the
next call starts fresh ones. Tests must leave no global state behind (destroy what they initialise).
"""

from __future__ import annotations

import atexit
import io
import queue
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_STOP = "stop"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, backend, tasks, results, collective_timeout):
    torch.set_num_threads(1)  # W ranks share a few cores; more threads per rank only contend
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=collective_timeout),
    )
    while True:
        task = tasks.get()
        if task == _STOP:
            break
        call_id, fn, args = task
        try:
            buffer = io.BytesIO()  # plain bytes: shared-memory tensors would not outlive the message
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((call_id, rank, True, buffer.getvalue()))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((call_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int, backend: str, collective_timeout: float):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, backend, self.tasks[r], self.results,
                                              collective_timeout), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.calls = 0

    def run(self, fn, args, timeout):
        self.calls += 1
        for q in self.tasks:
            q.put((self.calls, fn, args))
        collected, failures = {}, []
        while len(collected) + len(failures) < self.world_size:
            try:
                call_id, rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"distributed run of {fn.__name__} on {self.world_size} ranks produced no result for "
                    f"{timeout}s; ranks finished: {sorted(collected)}"
                ) from None
            if call_id != self.calls:
                continue
            if ok:
                collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            raise RuntimeError("distributed run failed:\n" + "\n".join(failures))
        return [collected[r] for r in range(self.world_size)]

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.tasks:
                q.put(_STOP)
        for p in self.procs:
            p.join(timeout=5 if graceful else 0.1)
            if p.is_alive():
                p.kill()


_pools: dict[tuple[int, str, float], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close(graceful=True)
    _pools.clear()


def run_on_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 180.0,
                 collective_timeout: float = 60.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank."""
    key = (world_size, backend, collective_timeout)
    if key not in _pools:
        _pools[key] = _Pool(world_size, backend, collective_timeout)
    try:
        return _pools[key].run(fn, args, timeout)
    except BaseException:
        # a failed rank may have left its peers inside a collective: retire the whole pool
        _pools.pop(key).close(graceful=False)
        raise
