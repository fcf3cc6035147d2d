"""Sparse ring attention over NCCL with the Triton backend, vs the fp32 reference: on 2 GPUs, and on every GPU
of a 4- or 8-GPU host (flat and hierarchical rings)."""

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from tool_modules import load_tool
from triton_cases import assert_close_fa, make_index, make_qkv_dout, reference_attention

from mtraining_kernels.index import convert_index
from mtraining_kernels.layout import Layout

slow_link = load_tool("slow_link")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

CASES = [  # (layout, pattern, (b, N, Hq, Hkv, d), dtype)
    ("striped", "mixed", (1, 8192, 8, 2, 128), torch.bfloat16),
    ("striped", "full", (1, 4096, 4, 1, 64), torch.bfloat16),
    ("zigzag", "mixed", (1, 8192, 4, 1, 64), torch.float16),
    ("striped", "bars", (2, 4096, 8, 2, 128), torch.bfloat16),
]


def _inputs(seed, shape, dtype, pattern, device):
    b, n, hq, hkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = make_qkv_dout(b, n, hq, hkv, d, dtype, device, gen)
    v_idx, s_idx = make_index(b, hq, n, pattern, gen)
    return q, k, v, dout, v_idx.to(device), s_idx.to(device)


def _ring_on_gpus(rank, world_size, seed, kind, pattern, shape, dtype, wire, inner=None):
    from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups
    from megatron_mtraining.ring.sparse_ring import ring_attention

    device = torch.device("cuda", rank)
    q, k, v, dout, v_idx, s_idx = _inputs(seed, shape, dtype, pattern, device)
    layout = Layout(kind, world_size)
    local = [layout.shard(t, rank).contiguous().requires_grad_(t is not dout) for t in (q, k, v, dout)]
    index = convert_index(v_idx, s_idx, layout, rank, shape[1])
    groups = RingGroups.flat(dist.group.WORLD) if inner is None else build_hierarchical_groups(inner_size=inner)
    out, lse = ring_attention(
        local[0], local[1], local[2], index, groups, backend="triton", grad_wire_dtype=wire, return_lse=True
    )
    out.backward(local[3])
    return [t.detach().cpu() for t in (out, lse.transpose(1, 2), local[0].grad, local[1].grad, local[2].grad)]


def _assert_matches_reference(results, seed, kind, pattern, shape, dtype, context):
    layout = Layout(kind, len(results))
    ours = [layout.unshard([r[i] for r in results]) for i in range(5)]
    ours[1] = ours[1].transpose(1, 2)
    q, k, v, dout, v_idx, s_idx = _inputs(seed, shape, dtype, pattern, torch.device("cuda", 0))
    ref = reference_attention(q, k, v, dout, v_idx, s_idx, torch.float32)
    low = reference_attention(q, k, v, dout, v_idx, s_idx, dtype)
    for name, a, r, lo in zip(("out", "lse", "dq", "dk", "dv"), ours, ref, low):
        assert_close_fa(name, a.cuda(), r, lo, dtype, context)


@pytest.mark.parametrize("kind, pattern, shape, dtype", CASES)
def test_ring_on_two_gpus_matches_reference(seed, kind, pattern, shape, dtype):
    results = run_on_ranks(_ring_on_gpus, 2, seed, kind, pattern, shape, dtype, "fp32", backend="nccl")
    _assert_matches_reference(results, seed, kind, pattern, shape, dtype, f"seed={seed} {kind} {pattern} {shape}")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 or more GPUs")
@pytest.mark.parametrize("inner", [None, 2, 4], ids=["flat", "inner2", "inner4"])
@pytest.mark.parametrize("kind", ["striped", "zigzag"])
def test_ring_on_every_gpu_matches_reference(seed, kind, inner):
    """W = all GPUs of the host (4 or 8): the flat ring, and the hierarchical ring with inner rings of 2 and 4
    GPUs where they leave at least two outer steps."""
    world = torch.cuda.device_count()
    if inner is not None and (world % inner or world // inner < 2):
        pytest.skip(f"an inner ring of {inner} leaves no outer ring on {world} GPUs")
    inner_size = inner
    pattern, shape, dtype = "mixed", (1, 16384, 8, 2, 128), torch.bfloat16
    results = run_on_ranks(_ring_on_gpus, world, seed, kind, pattern, shape, dtype, "fp32", inner_size, backend="nccl")
    _assert_matches_reference(
        results, seed, kind, pattern, shape, dtype, f"seed={seed} W={world} inner={inner_size} {kind} {shape}"
    )


def _emulated_ring_on_gpus(rank, world_size, seed, inner, node_size, delay_s):
    """(plain vs emulated-slow-link outputs equal?, this rank's delayed?, ms of one delayed exchange)."""
    from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups
    from megatron_mtraining.ring.sparse_ring import ring_attention

    SlowLink, SlowLinkExchange = slow_link.SlowLink, slow_link.SlowLinkExchange
    SlowLinkRingGroups = slow_link.SlowLinkRingGroups

    device = torch.device("cuda", rank)
    plain = RingGroups.flat(dist.group.WORLD) if inner == world_size else build_hierarchical_groups(inner_size=inner)
    slow = SlowLinkRingGroups.wrap(plain, SlowLink(node_size=node_size, slowdown=10.0, inner_bytes_per_s=100e9))
    q, k, v, dout, v_idx, s_idx = _inputs(seed, (1, 8192, 8, 2, 128), torch.bfloat16, "mixed", device)
    layout = Layout("striped", world_size)
    index = convert_index(v_idx, s_idx, layout, rank, 8192)
    results = []
    for groups in (plain, slow):
        local = [layout.shard(t, rank).contiguous().requires_grad_(t is not dout) for t in (q, k, v, dout)]
        out = ring_attention(local[0], local[1], local[2], index, groups, backend="triton", deterministic=True)
        out.backward(local[3])
        results.append([t.detach() for t in (out, local[0].grad, local[1].grad, local[2].grad)])
    equal = all(torch.equal(a, b) for a, b in zip(*results))
    payload = torch.empty(2**20, dtype=torch.uint8, device=device)
    exchange = SlowLinkExchange(dist.group.WORLD, [0, 1], SlowLink(node_size, 2.0, payload.numel() / delay_s))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    exchange.post(payload)
    exchange.wait()
    end.record()
    end.synchronize()
    return equal, exchange.slow, start.elapsed_time(end)


@pytest.mark.parametrize("inner, node_size", [(2, 1), (1, 1), (2, 2)])  # flat all-slow, hierarchical 1x2, 2x1
def test_slow_link_emulation_on_two_gpus(seed, inner, node_size):
    delay_s = 0.05
    results = run_on_ranks(_emulated_ring_on_gpus, 2, seed, inner, node_size, delay_s, backend="nccl")
    for rank, (equal, slow, ms) in enumerate(results):
        assert equal, f"seed={seed} inner={inner} node_size={node_size} rank {rank}: the emulation changed a result"
        assert slow == (node_size == 1), f"rank {rank}: slow={slow}"
        if slow:
            assert ms >= delay_s * 1e3, f"rank {rank}: the delayed exchange took {ms:.2f} ms < {delay_s * 1e3} ms"
