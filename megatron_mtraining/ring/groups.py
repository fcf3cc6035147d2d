"""Process groups of a (possibly hierarchical) context-parallel ring (DESIGN.md §2.5).

A CP group of W = O·L ranks is an *inner* ring of L ranks (inside a node, NVLink) nested in an
*outer* ring of O ranks (one per node), with cp_rank = outer_rank·L + inner_rank. The flat ring is
the case O = 1. Peers are always global ranks, and nothing is read from the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from .comm import RingExchange


@dataclass(frozen=True)
class RingGroups:
    """The CP group and its inner/outer rings. ``outer`` is None for a flat ring."""

    cp: dist.ProcessGroup
    inner: dist.ProcessGroup
    outer: dist.ProcessGroup | None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.cp)

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp)

    @property
    def inner_size(self) -> int:
        return dist.get_world_size(self.inner)

    @property
    def outer_size(self) -> int:
        return 1 if self.outer is None else dist.get_world_size(self.outer)

    @property
    def inner_rank(self) -> int:
        return dist.get_rank(self.inner)

    @property
    def outer_rank(self) -> int:
        return 0 if self.outer is None else dist.get_rank(self.outer)

    def exchange(self, group: dist.ProcessGroup, tag: int = 0) -> RingExchange:
        """The ring exchange over ``group`` (``inner``, ``outer`` or ``cp``) that the rings use; a subclass may
        model its links (the benchmark tools' ``SlowLinkRingGroups``, tools/slow_link.py)."""
        return RingExchange(group, tag)

    def source_of(self, outer_step: int, inner_step: int) -> int:
        """CP rank whose K/V chunk this rank holds at (outer step, inner step)."""
        inner, outer = self.inner_size, self.outer_size
        return ((self.outer_rank - outer_step) % outer) * inner + (self.inner_rank - inner_step) % inner

    @classmethod
    def flat(cls, cp: dist.ProcessGroup) -> "RingGroups":
        return cls(cp=cp, inner=cp, outer=None)

    @classmethod
    def hierarchical(cls, cp: dist.ProcessGroup, inner: dist.ProcessGroup, outer: dist.ProcessGroup) -> "RingGroups":
        """Check that (inner, outer) tile ``cp`` as cp_rank = outer_rank·L + inner_rank; no communication."""
        cp_members = dist.get_process_group_ranks(cp)
        inner_members = dist.get_process_group_ranks(inner)
        outer_members = dist.get_process_group_ranks(outer)
        size_l, size_o = len(inner_members), len(outer_members)
        if size_l * size_o != len(cp_members):
            raise ValueError(
                f"hierarchical ring sizes inner={size_l} x outer={size_o} != CP size {len(cp_members)}; "
                f"choose sizes whose product is the CP size"
            )
        outer_rank, inner_rank = dist.get_rank(outer), dist.get_rank(inner)
        node = cp_members[outer_rank * size_l : (outer_rank + 1) * size_l]
        column = cp_members[inner_rank::size_l]
        if inner_members != node or outer_members != column:
            raise ValueError(
                f"inner group {inner_members} / outer group {outer_members} do not tile the CP group "
                f"{cp_members} as cp_rank = outer_rank*{size_l} + inner_rank (expected inner {node}, "
                f"outer {column}); level 0 of the hierarchy must hold adjacent CP ranks"
            )
        return cls(cp=cp, inner=inner, outer=outer)


def build_hierarchical_groups(inner_size: int, cp_groups: Sequence[Sequence[int]] | None = None) -> RingGroups:
    """Create the groups of a hierarchical ring for standalone (non-Megatron) callers.

    ``cp_groups`` lists every CP group as global ranks (default: the whole world is one CP group).
    Collective: every rank of the default group must call it with the same arguments.
    """
    world = dist.get_world_size()
    groups = [list(g) for g in (cp_groups or [range(world)])]
    me = dist.get_rank()
    for members in groups:
        if len(members) % inner_size:
            raise ValueError(f"inner_size={inner_size} does not divide the CP size {len(members)}; pick a divisor")
    mine: dict[str, dist.ProcessGroup] = {}
    for members in groups:  # same creation order on every rank, as new_group requires
        levels = {
            "cp": [members],
            "inner": [members[i : i + inner_size] for i in range(0, len(members), inner_size)],
            "outer": [members[i::inner_size] for i in range(inner_size)],
        }
        for level, rank_lists in levels.items():
            for ranks in rank_lists:
                group = dist.new_group(ranks)
                if me in ranks:
                    mine[level] = group
    if "cp" not in mine:
        raise ValueError(f"rank {me} is in none of the CP groups {groups}")
    return RingGroups.hierarchical(mine["cp"], mine["inner"], mine["outer"])
