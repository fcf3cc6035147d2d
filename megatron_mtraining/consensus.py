"""Validate-by-consensus: every rank of a group raises together, or none does.

A distributed op whose inputs are bad or inconsistent on one rank must not leave its peers waiting
inside a collective. Each op checks its inputs locally, then calls :func:`agree_on_inputs` before its
first other collective.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective on ``group`` (None: the default group) must live: the current GPU
    for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_inputs(what: str, names: Sequence[str], values: Sequence[int] | None, error: ValueError | None,
                    group: dist.ProcessGroup) -> None:
    """Raise on every rank of ``group`` unless no rank has an ``error`` and all ranks' ``values`` are equal.

    Call it before the first other collective, so that a bad or inconsistent rank never leaves its
    peers waiting inside one. ``names`` (the same on every rank) label ``values`` (ints, one per name;
    None where this rank's inputs could not be read, which needs an ``error``). One all-gather of
    ``len(names) + 1`` int64 on the group's device (cuda for nccl, else cpu), and a host copy of it.
    A rank with an ``error`` re-raises it; the others raise a ``ValueError`` naming those ranks, or,
    when all are valid but differ, the differing values by rank.
    """
    if (values is None) == (error is None):
        raise ValueError("agree_on_inputs needs either this rank's values or its error")
    device = collective_device(group)
    mine = torch.tensor([*(values if error is None else [-1] * len(names)), int(error is not None)],
                        dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()                                          # [W, len(names) + 1]
    if error is not None:
        raise error
    bad = table[:, -1].nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{what}: the input is invalid on rank(s) {bad} of the group (they raised the reason); "
                         "fix the input there")
    differing = {name: table[:, i].tolist() for i, name in enumerate(names) if not (table[:, i] == table[0, i]).all()}
    if differing:
        raise ValueError(f"{what}: the ranks of the group disagree on {differing} (values by rank); every rank "
                         "must pass the same shapes, dtype, budget and options")
