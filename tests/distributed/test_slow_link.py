"""The benchmark's slow-link emulation (tools/slow_link.py) on gloo CPU ranks, 4 and 8 processes:
it delays exactly the transfers that cross an emulated node boundary, by at least the modelled delay,
and changes no result of the flat or hierarchical ring."""

import time

import pytest
import torch
import torch.distributed as dist
from patterns import random_index
from tool_modules import load_tool

from mtraining_kernels.index import convert_index
from mtraining_kernels.layout import Layout

slow_link = load_tool("slow_link")


def _delay_rank(rank, world_size, node_size, delay_s):
    SlowLink, SlowLinkExchange = slow_link.SlowLink, slow_link.SlowLinkExchange

    tensor = torch.full((4096,), float(rank))
    nbytes = tensor.numel() * tensor.element_size()
    link = SlowLink(node_size=node_size, slowdown=2.0, inner_bytes_per_s=nbytes / delay_s)  # delay = delay_s
    exchange = SlowLinkExchange(dist.group.WORLD, list(range(world_size)), link)
    start = time.perf_counter()
    received = exchange.post(tensor)
    exchange.wait()
    return exchange.slow, time.perf_counter() - start, float(received[0])


@pytest.mark.parametrize("world, node_size", [(4, 2), (8, 4), (8, 8)])
def test_only_transfers_across_nodes_wait_for_the_delay(distributed, world, node_size):
    delay_s = 0.3
    results = distributed(_delay_rank, world, node_size, delay_s)
    for rank, (slow, elapsed, first) in enumerate(results):
        assert first == float((rank - 1) % world), f"rank {rank} received the wrong chunk"
        # rank r receives from r − 1, across a node boundary iff r starts a node (and there is more than one)
        assert slow == (rank % node_size == 0 and node_size < world), f"rank {rank}: slow={slow}"
        if slow:
            assert elapsed >= delay_s, f"rank {rank} waited {elapsed:.3f} s < the emulated {delay_s} s"


def _ring_rank(rank, world_size, inner, node_size, seed):
    from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups
    from megatron_mtraining.ring.sparse_ring import ring_attention

    SlowLink, SlowLinkRingGroups = slow_link.SlowLink, slow_link.SlowLinkRingGroups

    plain = RingGroups.flat(dist.group.WORLD) if inner == world_size else build_hierarchical_groups(inner_size=inner)
    slow = SlowLinkRingGroups.wrap(plain, SlowLink(node_size=node_size, slowdown=20.0, inner_bytes_per_s=1e9))
    n, hq, hkv, d = 256 * world_size, 4, 1, 16
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, n, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
    v_idx, s_idx = random_index(1, hq, n, n // 4, n // 256 + 2, gen)
    layout = Layout("striped", world_size)
    index = convert_index(v_idx, s_idx, layout, rank, n)
    results = []
    for groups in (plain, slow):
        local = [layout.shard(t, rank, dim=1).clone().requires_grad_(t is not dout) for t in (q, k, v, dout)]
        out = ring_attention(local[0], local[1], local[2], index, groups, backend="torch_blocksparse")
        out.backward(local[3])
        results.append([t.detach() for t in (out, local[0].grad, local[1].grad, local[2].grad)])
    return results


@pytest.mark.parametrize(
    "world, inner, node_size",
    [
        (4, 4, 2),  # flat ring, 2 emulated nodes of 2
        (4, 2, 2),  # hierarchical 2 x 2
        (8, 8, 4),  # flat ring, 2 nodes of 4
        (8, 4, 4),  # hierarchical: inner 4, outer 2
        (8, 2, 2),  # hierarchical: inner 2, outer 4
    ],
)
def test_emulation_changes_no_result(distributed, seed, world, inner, node_size):
    for rank, (plain, slow) in enumerate(distributed(_ring_rank, world, inner, node_size, seed)):
        for name, a, b in zip(("out", "dq", "dk", "dv"), plain, slow):
            assert torch.equal(a, b), f"seed={seed} W={world} inner={inner} rank {rank}: {name} differs"


def test_wrap_and_link_reject_bad_settings():
    SlowLink = slow_link.SlowLink

    for kwargs, message in (
        ({"node_size": 0, "slowdown": 2.0, "inner_bytes_per_s": 1.0}, "node_size=0"),
        ({"node_size": 2, "slowdown": 0.5, "inner_bytes_per_s": 1.0}, "slowdown=0.5"),
        ({"node_size": 2, "slowdown": 2.0, "inner_bytes_per_s": 0.0}, "inner_bytes_per_s=0.0"),
    ):
        with pytest.raises(ValueError, match=message):
            SlowLink(**kwargs)
    link = SlowLink(node_size=4, slowdown=10.0, inner_bytes_per_s=1e9)
    assert link.delay_s(10**6) == pytest.approx(9e-3)
    assert link.crosses(3, 4) and not link.crosses(4, 7)


def _wrap_errors_rank(rank, world_size):
    from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups

    SlowLink, SlowLinkRingGroups = slow_link.SlowLink, slow_link.SlowLinkRingGroups

    errors = []
    for groups, node_size in ((build_hierarchical_groups(inner_size=2), 4), (RingGroups.flat(dist.group.WORLD), 3)):
        try:
            SlowLinkRingGroups.wrap(groups, SlowLink(node_size=node_size, slowdown=2.0, inner_bytes_per_s=1e9))
        except ValueError as error:
            errors.append(str(error))
    return errors


def test_wrap_rejects_nodes_that_do_not_fit_the_ring(distributed):
    for errors in distributed(_wrap_errors_rank, 4):
        assert len(errors) == 2
        assert "must be the inner size 2" in errors[0] and "does not divide the CP size 4" in errors[1]
