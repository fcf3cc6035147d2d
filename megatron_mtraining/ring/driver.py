"""The ring schedule shared by every ring attention (DESIGN.md §2.4, §2.5): the sparse rings and the dense one.

K/V, packed as one ``[2, b, N_loc, Hkv, d]`` tensor, circulate over the inner ring, nested in the outer
ring of a hierarchical ring (a flat ring is the case of one outer step). Each transfer is posted before
the compute of the step it overlaps and waited for after it. In backward each step's dK/dV contribution
joins the partial of its chunk on a second ring (tag 1), which arrives home complete after one more hop
than K/V made. What a step computes is the caller's: a function of the K/V held, their source CP rank
and the step number; everything it accumulates locally (out, lse, dQ) is its own.
"""

from __future__ import annotations

from typing import Callable

import torch

from .comm import RingExchange
from .groups import RingGroups

# compute(held [2, b, N_loc, Hkv, d], source CP rank, step t = outer step · L + inner step)
ForwardStep = Callable[[torch.Tensor, int, int], None]
# the same, returning this step's dK/dV contribution [2, b, N_loc, Hkv, d] in the accumulator dtype
BackwardStep = Callable[[torch.Tensor, int, int], torch.Tensor]


def run_forward_ring(kv: torch.Tensor, groups: RingGroups, compute: ForwardStep) -> None:
    """Call ``compute`` once per source, in ring order, while the K/V of the next step travel."""
    inner_kv = groups.exchange(groups.inner)
    outer_kv = groups.exchange(groups.outer) if groups.outer is not None else None
    chunk = kv
    for o in range(groups.outer_size):
        last_outer = o == groups.outer_size - 1
        incoming_chunk = None if last_outer else outer_kv.post(chunk)
        held = chunk
        for i in range(groups.inner_size):
            last_inner = i == groups.inner_size - 1
            incoming = None if last_inner else inner_kv.post(held)
            compute(held, groups.source_of(o, i), o * groups.inner_size + i)
            if not last_inner:
                inner_kv.wait()
                held = incoming
        if not last_outer:
            outer_kv.wait()
            chunk = incoming_chunk


def add_and_forward(exchange: RingExchange, arriving, total: torch.Tensor, wire: torch.dtype):
    """Add the partial ``arriving`` on ``exchange`` (None before the first hop) into ``total`` (accumulator
    dtype), then send the sum onward in ``wire``; returns the buffer of the next partial to arrive."""
    if arriving is not None:
        exchange.wait()
        total += arriving
    return exchange.post(total.to(wire))


def run_backward_ring(kv: torch.Tensor, groups: RingGroups, compute: BackwardStep, wire: torch.dtype) -> torch.Tensor:
    """Replay the forward's K/V ring, sending each step's contribution on the dK/dV ring(s); returns this
    rank's complete dK/dV ``[2, b, N_loc, Hkv, d]`` in the contributions' dtype.

    Within an outer step a chunk's partial circulates the inner ring and is back after L hops with the
    node's total, which then rides the outer dK/dV ring; the O-th outer hop brings the gradient home.
    """
    inner_kv, inner_grad = groups.exchange(groups.inner), groups.exchange(groups.inner, tag=1)
    outer_kv = groups.exchange(groups.outer) if groups.outer is not None else None
    outer_grad = groups.exchange(groups.outer, tag=1) if groups.outer is not None else None
    chunk, outer_partial = kv, None
    for o in range(groups.outer_size):
        last_outer = o == groups.outer_size - 1
        incoming_chunk = None if last_outer else outer_kv.post(chunk)
        held, inner_partial = chunk, None
        for i in range(groups.inner_size):
            last_inner = i == groups.inner_size - 1
            incoming = None if last_inner else inner_kv.post(held)
            contribution = compute(held, groups.source_of(o, i), o * groups.inner_size + i)
            inner_partial = add_and_forward(inner_grad, inner_partial, contribution, wire)
            if not last_inner:
                inner_kv.wait()
                held = incoming
        inner_grad.wait()  # L-th hop: this node's total for the chunk held at the outer step's start
        node_total = inner_partial.to(contribution.dtype)
        if outer_grad is not None:  # add earlier nodes' total for the same chunk and pass it on
            outer_partial = add_and_forward(outer_grad, outer_partial, node_total, wire)
        if not last_outer:
            outer_kv.wait()
            chunk = incoming_chunk
    if outer_grad is None:
        return node_total
    outer_grad.wait()  # O-th outer hop brings the complete gradient home
    return outer_partial.to(node_total.dtype)
