"""Sparse ring attention on gloo CPU ranks vs the single-device fp64 reference (DESIGN.md §6)."""

import pytest
import torch
import torch.distributed as dist
from patterns import random_index

from mtraining_kernels.index import convert_index
from mtraining_kernels.layout import Layout
from mtraining_kernels.reference import reference_sparse_attention, vertical_slash_mask
from mtraining_kernels.vertical_slash import full_index


def _inputs(seed, b, n, hq, hkv, d, n_vertical, n_slash, full):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, n, h, d, generator=gen) for h in (hq, hkv, hkv, hq))
    if full:
        v_idx, s_idx = full_index(b, hq, n)
    else:
        v_idx, s_idx = random_index(b, hq, n, n_vertical, n_slash, gen)
    return q, k, v, dout, v_idx, s_idx


def _groups_for(mode, world_size):
    from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups

    if mode == "flat":
        return RingGroups.flat(dist.group.WORLD)
    if mode == "hier2x2":
        return build_hierarchical_groups(inner_size=2)
    if mode == "dp2xcp2":  # two data-parallel replicas, each a CP group of 2 adjacent ranks
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        return RingGroups.flat(groups[dist.get_rank() // 2])
    if mode == "tp2xcp2":  # CP groups of non-adjacent global ranks, as with TP = 2 inside
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        return RingGroups.flat(groups[dist.get_rank() % 2])
    raise AssertionError(mode)


def _ring_rank(rank, world_size, mode, kind, shape, seed, full, wire):
    from megatron_mtraining.ring.sparse_ring import ring_attention

    groups = _groups_for(mode, world_size)
    cp_size, cp_rank = groups.world_size, groups.cp_rank
    b, n, hq, hkv, d = shape
    q, k, v, dout, v_idx, s_idx = _inputs(seed, b, n, hq, hkv, d, n // 4, n // 256 + 2, full)
    layout = Layout(kind, cp_size)
    local = [layout.shard(t, cp_rank, dim=1).clone().requires_grad_(t is not dout) for t in (q, k, v, dout)]
    index = convert_index(v_idx, s_idx, layout, cp_rank, n)
    out, lse = ring_attention(
        local[0], local[1], local[2], index, groups, backend="torch_blocksparse", grad_wire_dtype=wire, return_lse=True
    )
    out.backward(local[3])
    return cp_rank, [t.detach() for t in (out, lse, local[0].grad, local[1].grad, local[2].grad)]


def _gather_by_cp_rank(results, kind):
    cp_size = max(r for r, _ in results) + 1
    layout = Layout(kind, cp_size)
    by_rank = {}
    for cp_rank, tensors in results:  # replicas (DP) must agree bitwise
        if cp_rank in by_rank:
            for a, b in zip(by_rank[cp_rank], tensors):
                assert torch.equal(a, b), "CP replicas computed different results"
        by_rank[cp_rank] = tensors
    parts = [by_rank[r] for r in range(cp_size)]
    gathered = [layout.unshard([p[i] for p in parts], dim=1) for i in (0, 2, 3, 4)]
    lse = layout.unshard([p[1] for p in parts], dim=2)
    return gathered[0], lse, gathered[1], gathered[2], gathered[3]


CASES = [
    # (world, mode, layout, (b, N, Hq, Hkv, d))
    (2, "flat", "striped", (1, 1024, 4, 1, 64)),
    (2, "flat", "zigzag", (1, 1024, 2, 2, 32)),
    (3, "flat", "striped", (1, 1152, 5, 5, 16)),  # 3 blocks per rank, odd head count
    (3, "flat", "skewed", (1, 1152, 4, 2, 16)),
    (4, "flat", "contiguous", (2, 1024, 8, 1, 16)),  # GQA 8:1
    (2, "flat", "striped", (1, 512, 4, 1, 128)),  # head dim 128
    (4, "hier2x2", "striped", (1, 2048, 4, 1, 32)),
    (4, "dp2xcp2", "striped", (1, 1024, 4, 2, 16)),
    (4, "tp2xcp2", "zigzag", (1, 1024, 4, 2, 16)),
]


@pytest.mark.parametrize("world, mode, kind, shape", CASES)
@pytest.mark.parametrize("full", [False, True], ids=["sparse", "full"])
def test_ring_matches_single_device_reference(distributed, seed, world, mode, kind, shape, full):
    results = distributed(_ring_rank, world, mode, kind, shape, seed, full, "fp32")
    out, lse, dq, dk, dv = _gather_by_cp_rank(results, kind)
    b, n, hq, hkv, d = shape
    q, k, v, dout, v_idx, s_idx = _inputs(seed, b, n, hq, hkv, d, n // 4, n // 256 + 2, full)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    if full:  # the full pattern is exactly dense causal attention
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).repeat_interleave(hq // hkv, 1),
            v.transpose(1, 2).repeat_interleave(hq // hkv, 1),
            is_causal=True,
        ).transpose(1, 2)
        ref_lse = None
    else:
        ref, ref_lse = reference_sparse_attention(q, k, v, vertical_slash_mask(v_idx, s_idx, n))
    ref.backward(dout.double())
    pairs = [("out", out, ref), ("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)]
    if ref_lse is not None:
        pairs.append(("lse", lse, ref_lse))
    for name, ours, theirs in pairs:  # fp32 inputs, fp64 reference: fp32 rounding only
        err = (ours.double() - theirs).abs().max().item()
        assert err <= 2e-5 * max(1.0, theirs.abs().max().item()), f"{name} differs by {err} (seed={seed})"


def test_bf16_gradient_wire_stays_within_tolerance(distributed, seed):
    shape = (1, 1024, 4, 1, 32)
    results = distributed(_ring_rank, 4, "flat", "striped", shape, seed, False, "bf16")
    _, _, dq, dk, dv = _gather_by_cp_rank(results, "striped")
    b, n, hq, hkv, d = shape
    q, k, v, dout, v_idx, s_idx = _inputs(seed, b, n, hq, hkv, d, n // 4, n // 256 + 2, False)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = reference_sparse_attention(q, k, v, vertical_slash_mask(v_idx, s_idx, n))
    ref.backward(dout.double())
    for name, ours, theirs in [("dk", dk, k.grad), ("dv", dv, v.grad)]:
        rel = ((ours.double() - theirs).norm() / theirs.norm()).item()
        assert rel < 5e-3, f"{name} relative RMSE {rel} with a bf16 wire (seed={seed})"
    err = (dq.double() - q.grad).abs().max().item()
    assert err <= 2e-5 * max(1.0, q.grad.abs().max().item()), f"dq never travels, yet differs by {err}"


def _bad_ring_input(rank, world_size, problem):
    from megatron_mtraining.ring.groups import RingGroups, build_hierarchical_groups
    from megatron_mtraining.ring.sparse_ring import ring_attention

    n, layout = 1024, Layout("striped", world_size)
    v_idx, s_idx = full_index(1, 2, n)
    q, k, v = (torch.randn(1, n // world_size, h, 16) for h in (2, 1, 1))
    index = convert_index(v_idx, s_idx, layout, rank, n)
    groups = RingGroups.flat(dist.group.WORLD)
    try:
        if problem == "index_for_another_rank" and rank == 1:
            index = convert_index(v_idx, s_idx, layout, 0, n)
        if problem == "shapes_differ" and rank == 1:
            q, k, v = (t[:, :, :, :8].contiguous() for t in (q, k, v))
        if problem == "hierarchy_does_not_tile":
            build_hierarchical_groups(inner_size=3)
        replay = None
        if problem == "replay_on_one_rank" and rank == 1:
            replay = (torch.zeros_like(q), torch.zeros(1, 2, q.shape[1]))
        if problem == "replay_of_other_shape" and rank == 1:
            replay = (torch.zeros_like(q), torch.zeros(1, 2, q.shape[1] + 1))
        ring_attention(q, k, v, index, groups, backend="torch_blocksparse", replay_output=replay)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    "problem, message",
    [
        (
            "index_for_another_rank",
            "invalid on rank\\(s\\) \\[1\\]|built for world_size=2, rank=0 but this is CP rank 1",
        ),
        ("shapes_differ", r"ring attention: the ranks of the group disagree on \{'d': \[16, 8\]"),
        ("hierarchy_does_not_tile", "inner_size=3 does not divide the CP size 2"),
        ("replay_on_one_rank", r"ring attention: the ranks of the group disagree on \{'replay': \[0, 1\]"),
        ("replay_of_other_shape", r"invalid on rank\(s\) \[1\]|replay_output lse \(1, 2, 513\)"),
    ],
)
def test_bad_input_raises_on_every_rank_without_hanging(distributed, problem, message):
    import re

    errors = distributed(_bad_ring_input, 2, problem, timeout=60, collective_timeout=20)
    for rank, error in enumerate(errors):
        assert error is not None and re.search(message, error), f"rank {rank}: {error!r}"


def _replay_rank(rank, world_size, seed):
    """Gradients of a plain ring call vs a call replaying the plain call's (out, lse) with no forward launch."""
    from replay import replay_matches

    from megatron_mtraining.ring.groups import RingGroups
    from megatron_mtraining.ring.sparse_ring import ring_attention
    from mtraining_kernels import torch_backend

    n, layout, groups = 1024, Layout("striped", world_size), RingGroups.flat(dist.group.WORLD)
    q, k, v, dout, v_idx, s_idx = _inputs(seed, 1, n, 4, 2, 16, n // 4, n // 256 + 2, False)
    local = [layout.shard(t, rank, dim=1).clone() for t in (q, k, v, dout)]
    index = convert_index(v_idx, s_idx, layout, rank, n)

    def attention(q, k, v, replay_output):
        return ring_attention(
            q, k, v, index, groups, backend="torch_blocksparse", return_lse=True, replay_output=replay_output
        )

    return replay_matches(attention, local[:3], local[3], torch_backend, "block_bar_forward")


def test_replayed_output_gives_the_same_gradients_without_a_forward(distributed, seed):
    assert distributed(_replay_rank, 2, seed) == [True, True], f"seed={seed}"


def _triton_deterministic_rank(rank, world_size, seed):
    """The flat ring on the Triton backend (interpreted, fp16), deterministic twice, then on torch_blocksparse;
    the per-call bar regrouping patched to fail, so every step must read the index's cached bar chunks."""
    from unittest import mock

    from megatron_mtraining.ring.groups import RingGroups
    from megatron_mtraining.ring.sparse_ring import ring_attention
    from mtraining_kernels import triton_backend

    def per_call_regrouping(*args):
        raise AssertionError("a ring step regrouped the bars itself instead of reading index.bar_chunks")

    groups = RingGroups.flat(dist.group.WORLD)
    n, layout = 512, Layout("striped", world_size)
    q, k, v, dout, v_idx, s_idx = _inputs(seed, 1, n, 4, 1, 64, n // 4, 4, False)
    index = convert_index(v_idx, s_idx, layout, rank, n)
    grads = []
    with mock.patch.object(triton_backend, "bar_chunks_by_column", per_call_regrouping):
        for backend in ("triton", "triton", "torch_blocksparse"):
            local = [layout.shard(t, rank, dim=1).half().requires_grad_(t is not dout) for t in (q, k, v, dout)]
            out = ring_attention(*local[:3], index, groups, backend=backend, deterministic=True)
            grads.append(torch.autograd.grad(out, local[:3], local[3]))
    return grads


def test_triton_deterministic_ring_reads_the_cached_bar_chunks_and_repeats_bitwise(distributed, seed):
    for rank, (first, second, torch_blocksparse) in enumerate(distributed(_triton_deterministic_rank, 2, seed)):
        for name, a, b, c in zip(("dq", "dk", "dv"), first, second, torch_blocksparse):
            assert torch.equal(a, b), f"seed={seed} rank {rank}: {name} differs between two deterministic backwards"
            error = (a.double() - c.double()).norm() / c.double().norm()
            assert error < 5e-3, f"seed={seed} rank {rank} {name}: relative RMSE {error:.2e} against torch_blocksparse"
