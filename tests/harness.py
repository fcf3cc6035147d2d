"""Run a function on W CPU processes joined by a gloo process group, and collect per-rank results.

Used by every distributed test. The function must be defined at module level (it is pickled into
spawned processes) and is called as ``fn(rank, world_size, *args)``; its return value must be
picklable. A rank that raises makes the whole call fail with that rank's traceback; a run that
exceeds ``timeout`` is killed and fails, so a hang can never block the suite.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results, collective_timeout):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, world_size: int, *args, timeout: float = 180.0, collective_timeout: float = 60.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, collective_timeout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, object] = {}
    failures: list[str] = []
    try:
        while len(collected) + len(failures) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"distributed run of {fn.__name__} on {world_size} ranks produced no result for "
                    f"{timeout}s; ranks finished: {sorted(collected)}"
                ) from None
            if ok:
                collected[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError("distributed run failed:\n" + "\n".join(failures))
    return [collected[r] for r in range(world_size)]
