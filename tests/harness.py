"""Run a function on W processes joined by a process group (gloo on CPU, or NCCL with one GPU per
rank), and collect per-rank results.

Used by every distributed test. The function must be defined at module level (it is pickled into
the worker processes) and is called as ``fn(rank, world_size, *args)``; its return value must be
picklable. A rank that raises makes the whole call fail with that rank's traceback; a call that
produces no result for ``timeout`` seconds fails and its processes are killed, so a hang can never
block the suite.

Starting a process that imports torch and Megatron costs seconds, so the W processes of a world
size are kept between calls (one process group each); a failed or timed-out call retires them, and
the next call starts fresh ones. Tests must leave no global state behind (destroy what they initialise).

Nothing waits on a slow process with a short timeout, so a loaded machine slows the tests down but
does not fail them: the ranks meet through a ``FileStore`` in a fresh temporary folder (no port to
pick and race for), wait for each other there (up to :data:`STARTUP_TIMEOUT`) before the process
group's rendezvous, and every call starts only once every rank has unpickled it (imported its module,
up to :data:`LOAD_TIMEOUT`); only then do ``timeout`` and the collectives' ``collective_timeout`` run.

A call that times out says where it stopped: every live rank writes its threads' Python stacks (``faulthandler``
on ``SIGUSR1``) and the error carries them, so a hang in CI names its line instead of only its test.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import io
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STARTUP_TIMEOUT = 300.0  # seconds for every rank to start, import torch and join the group
LOAD_TIMEOUT = 300.0  # seconds for every rank to unpickle a call (importing the test's modules)
_STOP, _GO, _CLEAN_UP = "stop", "go", "clean up"
_READY, _LOADED, _DONE, _FAILED = "ready", "loaded", "done", "failed"
STACK_DUMP_WAIT = 3.0  # seconds a signalled rank gets to write its stacks


def _wait_for_every_rank(store: dist.Store, rank: int, world_size: int) -> None:
    """Return once all ``world_size`` ranks have reached this point (or fail after STARTUP_TIMEOUT)."""
    store.set(f"harness/started/{rank}", "1")
    store.wait([f"harness/started/{r}" for r in range(world_size)], timedelta(seconds=STARTUP_TIMEOUT))


def _stacks_path(store_path: str, rank: int) -> str:
    return f"{store_path}.stacks.{rank}"


def _destroy_groups_but_world() -> None:
    """Destroy every process group but the world's, so that no call's groups outlive it.

    Megatron's ``destroy_model_parallel`` only forgets its groups: torch keeps them registered, and a gloo
    group keeps three threads, one of them its socket loop. A pool that had served the Megatron tests held
    about 700 groups and 2,000 threads per rank, hundreds of them runnable, and slowed every other process
    on a 2-core machine until the CPU demo and an interpreted ring test ran past their timeouts in CI.
    """
    for group in [g for g in dist.distributed_c10d._world.pg_map if g != dist.GroupMember.WORLD]:
        dist.destroy_process_group(group)
    gc.collect()  # the groups' last references may sit in reference cycles of the call's objects


def _worker(rank, world_size, store_path, backend, tasks, results, collective_timeout):
    torch.set_num_threads(1)  # W ranks share a few cores; more threads per rank only contend
    stacks = open(_stacks_path(store_path, rank), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    _wait_for_every_rank(store, rank, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=collective_timeout)
    )
    results.put((0, rank, _READY, b""))
    while True:
        task = tasks.get()
        if task == _STOP:
            break
        if task == _CLEAN_UP:  # every rank has finished the call: its groups are idle
            if backend == "gloo":  # tearing down NCCL communicators between calls has not run yet
                _destroy_groups_but_world()
            continue
        call_id, payload = task
        try:
            fn, args = pickle.loads(payload)
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((call_id, rank, _FAILED, traceback.format_exc()))
            continue
        results.put((call_id, rank, _LOADED, b""))
        if tasks.get() != (call_id, _GO):
            break
        try:
            buffer = io.BytesIO()  # plain bytes: shared-memory tensors would not outlive the message
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((call_id, rank, _DONE, buffer.getvalue()))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((call_id, rank, _FAILED, traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int, backend: str, collective_timeout: float):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.folder = tempfile.mkdtemp(prefix="harness-store-")
        self.store_path = os.path.join(self.folder, "store")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    world_size,
                    self.store_path,
                    backend,
                    self.tasks[r],
                    self.results,
                    collective_timeout,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.calls = 0
        try:
            self._collect(0, _READY, STARTUP_TIMEOUT, "start and join the process group")
        except BaseException:
            self.close(graceful=False)
            raise

    def _collect(self, call_id: int, status: str, timeout: float, what: str) -> dict:
        """Payloads by rank of the ``status`` messages of call ``call_id``, one per rank. Raises if a rank
        failed, died, or sent nothing for ``timeout`` seconds."""
        collected, failures = {}, {}
        last_message = time.monotonic()
        while len(collected) + len(failures) < self.world_size:
            try:
                message_id, rank, message_status, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
                waited = time.monotonic() - last_message
                if dead or waited > timeout:
                    raise TimeoutError(
                        f"{self.world_size} ranks did not {what} ({waited:.0f}s without a message, limit "
                        f"{timeout:.0f}s); ranks done: {sorted(collected)}, ranks exited: {dead}\n"
                        + "".join(f"{failure}\n" for failure in failures.values())
                        + self._stacks(skip=set(collected) | set(dead) | set(failures))
                    ) from None
                continue
            last_message = time.monotonic()
            if message_id != call_id:
                continue
            if message_status == _FAILED:
                failures[rank] = f"--- rank {rank} failed ---\n{value}"
            elif message_status == status:
                collected[rank] = value
        if failures:
            raise RuntimeError("distributed run failed:\n" + "\n".join(failures.values()))
        return collected

    def _stacks(self, skip: set[int]) -> str:
        """Where every rank not in ``skip`` is now: its threads' Python stacks, written on SIGUSR1."""
        asked = [r for r, p in enumerate(self.procs) if r not in skip and p.exitcode is None]
        for r in asked:
            os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT)
        parts = []
        for r in asked:
            with open(_stacks_path(self.store_path, r)) as dump:
                parts.append(f"--- rank {r} stacks ---\n{dump.read()[-6000:]}")
        return "\n".join(parts)

    def run(self, fn, args, timeout):
        self.calls += 1
        payload = pickle.dumps((fn, args))
        for q in self.tasks:
            q.put((self.calls, payload))
        self._collect(self.calls, _LOADED, LOAD_TIMEOUT, f"load {fn.__name__}")
        for q in self.tasks:
            q.put((self.calls, _GO))
        collected = self._collect(self.calls, _DONE, timeout, f"finish {fn.__name__}")
        for q in self.tasks:
            q.put(_CLEAN_UP)
        return [torch.load(io.BytesIO(collected[r]), weights_only=False) for r in range(self.world_size)]

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.tasks:
                q.put(_STOP)
        for p in self.procs:
            p.join(timeout=5 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self.folder, ignore_errors=True)


_pools: dict[tuple[int, str, float], _Pool] = {}


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close(graceful=True)
    _pools.clear()


def run_on_ranks(
    fn, world_size: int, *args, backend: str = "gloo", timeout: float = 300.0, collective_timeout: float = 180.0
):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``timeout``: seconds the call may go without a rank finishing; ``collective_timeout``: seconds a
    collective of the process group waits.
    """
    key = (world_size, backend, collective_timeout)
    try:
        if key not in _pools:
            _pools[key] = _Pool(world_size, backend, collective_timeout)
        return _pools[key].run(fn, args, timeout)
    except BaseException:
        # a failed rank may have left its peers inside a collective: retire the whole pool
        pool = _pools.pop(key, None)
        if pool is not None:
            pool.close(graceful=False)
        raise
