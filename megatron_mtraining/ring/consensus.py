"""Validate-by-consensus: every rank of a group raises together, or none does.

A distributed op whose inputs are bad or inconsistent on one rank must not leave its peers waiting
inside a collective. Each op checks its inputs locally, describes every setting that changes what it
sends or computes, then calls :func:`agree_on_inputs` before its first other collective.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
import torch.distributed as dist

DIGEST_BYTES = 32  # one SHA-256 digest per setting
SHOWN_POSITIONS = 4  # differing positions of a sequence setting named in the message


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor for a collective on ``group`` (None: the default group) must live: the current GPU
    for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def canonical(value):
    """``value`` as plain Python data whose ``repr`` is exact: a tensor becomes the tuple of its elements,
    a list a tuple, a dtype its name; ints, floats (repr round-trips), strings, bools and None stay."""
    if isinstance(value, torch.Tensor):
        return tuple(value.flatten().tolist())
    if isinstance(value, (list, tuple)):
        return tuple(canonical(item) for item in value)
    if isinstance(value, torch.dtype):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot agree on a value of type {type(value).__name__}; describe it as numbers or text")


def _digest(value) -> bytes:
    return hashlib.sha256(repr(value).encode()).digest()


def _by_rank(name: str, values: list) -> dict[str, list]:
    """The differing ``values`` (one per rank) of setting ``name``; a sequence shows its first differing
    positions as ``name[i]`` (None where a rank's sequence is shorter)."""
    if not all(isinstance(value, tuple) for value in values):
        return {name: values}
    longest = max(len(value) for value in values)
    shown = {}
    if any(len(value) != longest for value in values):
        shown[f"len({name})"] = [len(value) for value in values]
    for position in range(longest):
        at = [value[position] if position < len(value) else None for value in values]
        if any(item != at[0] for item in at):
            shown[f"{name}[{position}]"] = at
            if len(shown) == SHOWN_POSITIONS:
                break
    return shown


def agree_on_inputs(
    what: str, names: Sequence[str], values: Sequence | None, error: ValueError | None, group: dist.ProcessGroup
) -> None:
    """Raise on every rank of ``group`` unless no rank has an ``error`` and all ranks' ``values`` are equal.

    Call it before the first other collective, so that a bad or inconsistent rank never leaves its
    peers waiting inside one. ``names`` (the same on every rank) label ``values`` (one per name, any of
    :func:`canonical`'s types; None where this rank's inputs could not be read, which needs an ``error``).
    Values are compared exactly, as the SHA-256 of their canonical form: one all-gather of
    ``32·len(names) + 1`` bytes on the group's device (cuda for nccl, else cpu), and a host copy of it.
    A rank with an ``error`` re-raises it; the others raise a ``ValueError`` naming those ranks. When all
    are valid but differ, a second all-gather (of the differing values only, on every rank alike) lets
    every rank raise a ``ValueError`` naming them by rank.
    """
    if (values is None) == (error is None):
        raise ValueError("agree_on_inputs needs either this rank's values or its error")
    if values is not None and len(values) != len(names):
        raise ValueError(f"agree_on_inputs got {len(values)} values for the {len(names)} names {tuple(names)}")
    described = None if values is None else [canonical(value) for value in values]
    digests = bytes(DIGEST_BYTES * len(names)) if described is None else b"".join(map(_digest, described))
    mine = torch.frombuffer(bytearray(digests + bytes([error is not None])), dtype=torch.uint8)
    mine = mine.to(collective_device(group))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()  # [W, 32·len(names) + 1]
    if error is not None:
        raise error
    bad = table[:, -1].nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"{what}: the input is invalid on rank(s) {bad} of the group (they raised the reason); fix the input there"
        )
    per_setting = table[:, :-1].view(len(gathered), len(names), DIGEST_BYTES)
    differing = (per_setting != per_setting[:1]).any(dim=2).any(dim=0).nonzero().flatten().tolist()
    if not differing:
        return
    everyone = [None] * len(gathered)
    dist.all_gather_object(everyone, [described[i] for i in differing], group=group)
    shown = {}
    for position, i in enumerate(differing):
        shown.update(_by_rank(names[i], [rank_values[position] for rank_values in everyone]))
    raise ValueError(
        f"{what}: the ranks of the group disagree on {shown} (values by rank); every rank "
        "must pass the same shapes, dtype, budget and options"
    )
