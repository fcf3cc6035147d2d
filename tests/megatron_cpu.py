"""Test-only patches that let Megatron-Core 0.19 run on CPU ranks joined by gloo (DESIGN.md §3 "CPU/gloo").

Never imported by the package. A test rank does its Megatron work inside ``with megatron_on_cpu():``,
which applies the patches and, on exit, restores every patched name and destroys Megatron's
parallel state (the harness keeps worker processes between tests). What is replaced, and why:

1. ``torch.cuda.current_device`` → ``"cpu"``: ``RotaryEmbedding.get_emb`` (and YaRN's) moves
   ``inv_freq`` to it on the first forward, and ``dist_checkpointing`` builds small collective
   tensors there; "cpu" keeps both on the CPU.
2. ``get_pos_emb_on_this_cp_rank`` (Megatron's zigzag RoPE split; pins memory and calls ``.cuda()``)
   → the same zigzag selection on CPU. Only reached where Megatron's own split is compared.
3. ``torch.cuda.synchronize`` → no-op, ``dist_checkpointing``'s process-memory probe (psutil) → 0,
   and its write-results queue → a plain ``queue.Queue`` (a synchronous save writes in threads of this
   process; the stock ``Manager().Queue()`` starts a child process, which a daemonic worker cannot).
4. The CUDA RNG state that ``tensor_parallel.checkpoint`` saves and restores around a recomputation
   → an empty placeholder (Megatron still saves and restores the CPU generator's state).
"""

from __future__ import annotations

import queue
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist


def cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's zigzag RoPE selection (chunks r and 2W−1−r of 2W) without pinned memory or CUDA."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunks = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, chunks)
    return pos_emb.reshape(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def _groups_held_by(module) -> set:
    """The non-world process groups that ``module``'s globals hold, directly or in lists, tuples and dicts."""
    found, seen, pending = set(), set(), list(vars(module).values())
    while pending:
        value = pending.pop()
        if id(value) in seen:  # a container reached twice, or holding itself
            continue
        seen.add(id(value))
        if isinstance(value, dist.ProcessGroup):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return found - {dist.GroupMember.WORLD}


def reset_parallel_state() -> None:
    """Destroy Megatron's parallel state and its process groups, the hierarchical CP groups included.

    ``destroy_model_parallel`` only forgets the groups; torch keeps them, each gloo group with its threads, so a
    rank that initialises Megatron a few times would pile them up (see ``harness._destroy_groups_but_world``).
    """
    from megatron.core import parallel_state

    groups = _groups_held_by(parallel_state) if dist.is_initialized() else set()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    registered = dist.distributed_c10d._world.pg_map
    for group in groups:
        if group in registered:
            dist.destroy_process_group(group)


@contextmanager
def megatron_on_cpu() -> Iterator[None]:
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random

    replacements = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        (filesystem_async, "_process_memory", lambda: 0),
        (filesystem_async, "_results_queue", queue.Queue()),
        (tp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)),
        (tp_random, "_set_cuda_rng_state", lambda *args, **kwargs: None),
    ] + [
        (module, "get_pos_emb_on_this_cp_rank", cpu_pos_emb_on_this_cp_rank)
        for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding)
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in replacements]
    for owner, name, value in replacements:
        setattr(owner, name, value)
    try:
        yield
    finally:
        reset_parallel_state()
        for owner, name, value in originals:
            setattr(owner, name, value)
