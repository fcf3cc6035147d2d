"""Analytic time model of one attention layer on the flat and the hierarchical sparse ring (DESIGN.md §2.4–2.5).

Inputs are per (rank, step) cell: ``compute_fwd_s`` / ``compute_bwd_s`` (the balanced layout gives every
cell the same work), the bytes one hop moves (K+V forward; K+V plus the dK/dV partial backward) and the
link bandwidths. A hop takes ``latency_s + bytes / bandwidth``; compute and the transfer posted before it
overlap, so a step lasts max(compute, hop). A flat ring whose W ranks span several nodes is paced by its
slowest hop, the inter-node one. Forward:

    flat:          (W − 1) · max(c, hop) + c
    hierarchical:  (O − 1) · max(R, hop_outer) + R,   R = (L − 1) · max(c, hop_inner) + c

(one outer transfer hides behind a whole inner round R). Backward: the same with the backward compute,
hops that carry K/V and a gradient partial together, and the extra gradient hop(s) that bring the
partials home (one per ring level).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CellCosts:
    """One (rank, step) cell and the links: seconds, bytes, bytes per second."""

    compute_fwd_s: float
    compute_bwd_s: float
    kv_bytes: float  # K + V of one chunk, the forward hop
    grad_bytes: float  # the dK + dV partial that rides the backward's second ring
    inner_bytes_per_s: float
    outer_bytes_per_s: float
    latency_s: float = 0.0

    def hop_s(self, nbytes: float, outer: bool) -> float:
        return self.latency_s + nbytes / (self.outer_bytes_per_s if outer else self.inner_bytes_per_s)


@dataclass(frozen=True)
class LayerTime:
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def _ring_time(compute_s: float, hop_s: float, steps: int) -> float:
    """``steps`` compute steps, each overlapping the hop that brings the next chunk (none after the last)."""
    return (steps - 1) * max(compute_s, hop_s) + compute_s


def flat_ring(costs: CellCosts, world: int, node_size: int) -> LayerTime:
    """A flat ring over ``world`` ranks in nodes of ``node_size``: every step waits for the slowest hop."""
    if world < 1 or node_size < 1 or world % node_size:
        raise ValueError(f"world={world} must be a positive multiple of node_size={node_size}")
    crosses = world > node_size
    forward = _ring_time(costs.compute_fwd_s, costs.hop_s(costs.kv_bytes, crosses), world)
    if world == 1:
        return LayerTime(forward, costs.compute_bwd_s)
    backward_hop = costs.hop_s(costs.kv_bytes + costs.grad_bytes, crosses)
    backward = _ring_time(costs.compute_bwd_s, backward_hop, world) + costs.hop_s(costs.grad_bytes, crosses)
    return LayerTime(forward, backward)


def hierarchical_ring(costs: CellCosts, inner: int, outer: int) -> LayerTime:
    """Inner rings of ``inner`` ranks (one node each, intra-node links) inside an outer ring of ``outer`` nodes."""
    if inner < 1 or outer < 1:
        raise ValueError(f"inner={inner} and outer={outer} must be >= 1")
    inner_round = _ring_time(costs.compute_fwd_s, costs.hop_s(costs.kv_bytes, False), inner)
    forward = _ring_time(inner_round, costs.hop_s(costs.kv_bytes, True), outer)
    inner_grad_home = costs.hop_s(costs.grad_bytes, False) if inner > 1 else 0.0
    inner_round_bwd = (
        _ring_time(costs.compute_bwd_s, costs.hop_s(costs.kv_bytes + costs.grad_bytes, False), inner) + inner_grad_home
    )
    outer_grad_home = costs.hop_s(costs.grad_bytes, True) if outer > 1 else 0.0
    backward = (
        _ring_time(inner_round_bwd, costs.hop_s(costs.kv_bytes + costs.grad_bytes, True), outer) + outer_grad_home
    )
    return LayerTime(forward, backward)


def hop_bytes(
    seq_len: int, world: int, kv_heads: int, head_dim: int, element_bytes: int = 2, grad_element_bytes: int = 4
) -> tuple[int, int]:
    """(K + V bytes of one rank's chunk, dK + dV partial bytes on the gradient wire)."""
    chunk = seq_len // world * kv_heads * head_dim
    return 2 * chunk * element_bytes, 2 * chunk * grad_element_bytes


def attention_cell_costs(
    seq_len: int,
    world: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    density: float,
    tflops: float,
    inner_bytes_per_s: float,
    outer_bytes_per_s: float,
    element_bytes: int = 2,
    grad_element_bytes: int = 4,
    latency_s: float = 0.0,
) -> CellCosts:
    """Cell costs of causal attention at ``density`` of the causal area, computed at ``tflops`` (actually computed
    work; DESIGN.md §7: forward 4·d FLOPs per (i ≥ j) entry and head, backward 2.5 ×)."""
    forward_flops = 4.0 * head_dim * heads * density * seq_len * (seq_len + 1) / 2 / world**2
    kv_bytes, grad_bytes = hop_bytes(seq_len, world, kv_heads, head_dim, element_bytes, grad_element_bytes)
    return CellCosts(
        compute_fwd_s=forward_flops / (tflops * 1e12),
        compute_bwd_s=2.5 * forward_flops / (tflops * 1e12),
        kv_bytes=kv_bytes,
        grad_bytes=grad_bytes,
        inner_bytes_per_s=inner_bytes_per_s,
        outer_bytes_per_s=outer_bytes_per_s,
        latency_s=latency_s,
    )
