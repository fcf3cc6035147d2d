"""The SDPA zigzag dense ring (megatron_mtraining.ring.dense_ring) on gloo CPU ranks vs the fp64 reference.

On CPU the ring runs torch's CPU flash kernel (impl "flash"), so the ring logic (step plan, merge,
dK/dV ring) is the one the GPU runs with cuDNN. Also: the step plan covers exactly the causal triangle,
bad input on one rank raises on every rank, and ``MTrainingAttention`` with an SDPA kernel (CP = 2)
matches the reference and reports density 1.0 without building an index.
"""

from __future__ import annotations

import argparse
import re

import pytest
import torch
import torch.distributed as dist

from mtraining_kernels.layout import Layout
from mtraining_kernels.merge import merge_attention
from mtraining_kernels.reference import reference_sparse_attention


def _inputs(seed, b, n, hq, hkv, d):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, n, h, d, generator=gen) for h in (hq, hkv, hkv, hq))


def _reference(q, k, v, dout):
    """fp64 causal attention: out, lse, dq, dk, dv."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    out, lse = reference_sparse_attention(q, k, v, causal)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _gather(results, world):
    """Per-rank [out, lse, dq, dk, dv] → global order (lse is [b, H, N_loc])."""
    layout = Layout("zigzag", world)
    gathered = [layout.unshard([r[i] for r in results]) for i in (0, 2, 3, 4)]
    lse = layout.unshard([r[1] for r in results], dim=2)
    return gathered[0], lse, gathered[1], gathered[2], gathered[3]


def _dense_ring_rank(rank, world_size, shape, seed, wire):
    from megatron_mtraining.ring.dense_ring import dense_ring_attention
    from megatron_mtraining.ring.groups import RingGroups

    layout = Layout("zigzag", world_size)
    q, k, v, dout = _inputs(seed, *shape)
    local = [layout.shard(t, rank).clone().requires_grad_(t is not dout) for t in (q, k, v, dout)]
    out, lse = dense_ring_attention(
        local[0],
        local[1],
        local[2],
        layout,
        RingGroups.flat(dist.group.WORLD),
        impl="flash",
        grad_wire_dtype=wire,
        return_lse=True,
    )
    out.backward(local[3])
    return [t.detach() for t in (out, lse, local[0].grad, local[1].grad, local[2].grad)]


CASES = [  # (world, (b, N, Hq, Hkv, d))
    (2, (1, 256, 8, 2, 16)),  # GQA 4:1
    (2, (2, 128, 2, 2, 32)),  # MHA, batch 2
    (3, (1, 384, 8, 2, 16)),  # W = 3, GQA 4:1
    (3, (1, 66, 4, 1, 8)),  # chunks of 11 tokens (no block structure needed)
]


@pytest.mark.parametrize("world, shape", CASES, ids=[f"W{w}-{'x'.join(map(str, s))}" for w, s in CASES])
def test_dense_ring_matches_single_device_reference(distributed, seed, world, shape):
    ours = _gather(distributed(_dense_ring_rank, world, shape, seed, "fp32"), world)
    ref = _reference(*_inputs(seed, *shape))
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):  # fp32 inputs: fp32 rounding only
        assert a.dtype == torch.float32, f"{name} has dtype {a.dtype}"
        err = (a.double() - r).abs().max().item()
        assert err <= 2e-5 * max(1.0, r.abs().max().item()), f"{name} differs by {err} (W={world}, seed={seed})"


def test_bf16_gradient_wire_stays_within_tolerance(distributed, seed):
    shape = (1, 384, 8, 2, 16)
    _, _, dq, dk, dv = _gather(distributed(_dense_ring_rank, 3, shape, seed, "bf16"), 3)
    _, _, ref_dq, ref_dk, ref_dv = _reference(*_inputs(seed, *shape))
    for name, ours, ref in (("dk", dk, ref_dk), ("dv", dv, ref_dv)):
        rmse = ((ours.double() - ref).norm() / ref.norm()).item()
        assert rmse < 5e-3, f"{name} relative RMSE {rmse} with a bf16 wire (seed={seed})"
    err = (dq.double() - ref_dq).abs().max().item()
    assert err <= 2e-5 * max(1.0, ref_dq.abs().max().item()), f"dq never travels, yet differs by {err}"


# ------------------------------------------------------------------------------------------ step plan and merge
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_step_plan_covers_the_causal_triangle_once(world):
    """Over all ranks and steps, the (query, key) pairs of the plan are exactly the causal pairs, each once."""
    from megatron_mtraining.ring.dense_ring import zigzag_step

    chunk = 3
    layout, seq_len = Layout("zigzag", world), 2 * world * chunk
    covered = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    for rank in range(world):
        queries = layout.global_positions(seq_len, rank)
        for step in range(world):
            source = (rank - step) % world
            plan = zigzag_step(rank, source, 2 * chunk)
            keys = layout.global_positions(seq_len, source)
            q_pos, k_pos = queries[plan.queries], keys[plan.keys]
            block = torch.ones(len(q_pos), len(k_pos), dtype=torch.int64)
            if plan.causal:
                block = block.tril()
            else:
                assert bool((k_pos[None, :] < q_pos[:, None]).all()), f"rank {rank} source {source}: a future key"
            covered[q_pos[:, None], k_pos[None, :]] += block
    assert torch.equal(covered, torch.ones(seq_len, seq_len, dtype=torch.int64).tril())


@pytest.mark.parametrize("lse_offset", [0.0, 1e4], ids=["lse~4", "lse~1e4"])
def test_merge_step_into_a_row_range_equals_reference_merge(seed, lse_offset):
    """The ring merges into views (the second chunk's rows): those rows match merge_attention, the rest stay.

    At |lse| ~ 1e4 (fp32 ulp 1e-3) both merges must take their weights from the lse difference to agree.
    """
    from megatron_mtraining.ring.dense_ring import merge_step

    b, n, h, d = 2, 24, 3, 8
    out, lse = torch.randn(b, n, h, d), torch.randn(b, h, n) * 4 + lse_offset
    step_out, step_lse = torch.randn(b, n // 2, h, d), torch.randn(b, h, n // 2) * 4 + lse_offset
    before_out, before_lse = out.clone(), lse.clone()
    expected_out, expected_lse = merge_attention(out[:, n // 2 :], lse[:, :, n // 2 :], step_out, step_lse)
    merge_step(out[:, n // 2 :], lse[:, :, n // 2 :], step_out, step_lse)
    torch.testing.assert_close(out[:, n // 2 :], expected_out, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(
        lse[:, :, n // 2 :], expected_lse, rtol=1e-6, atol=1e-6, msg=lambda m: f"seed={seed}: {m}"
    )
    assert torch.equal(out[:, : n // 2], before_out[:, : n // 2]), f"rows outside the view changed (seed={seed})"
    assert torch.equal(lse[..., : n // 2], before_lse[..., : n // 2]), f"rows outside the view changed (seed={seed})"


# ------------------------------------------------------------------------------------------ bad input
def _replay_rank(rank, world_size, seed):
    """Gradients of a plain dense-ring call vs a call replaying its (out, lse) with no SDPA forward."""
    from replay import replay_matches

    from megatron_mtraining.ring import dense_ring
    from megatron_mtraining.ring.groups import RingGroups

    layout, groups = Layout("zigzag", world_size), RingGroups.flat(dist.group.WORLD)
    local = [layout.shard(t, rank).clone() for t in _inputs(seed, 1, 256, 4, 2, 16)]

    def attention(q, k, v, replay_output):
        return dense_ring.dense_ring_attention(
            q, k, v, layout, groups, impl="flash", return_lse=True, replay_output=replay_output
        )

    return replay_matches(attention, local[:3], local[3], dense_ring, "attention_forward")


def test_replayed_output_gives_the_same_gradients_without_a_forward(distributed, seed):
    assert distributed(_replay_rank, 2, seed) == [True, True], f"seed={seed}"


def _bad_dense_ring_input(rank, world_size, problem):
    from megatron_mtraining.ring.dense_ring import dense_ring_attention
    from megatron_mtraining.ring.groups import RingGroups

    layout = Layout("zigzag", world_size)
    q, k, v = (torch.randn(1, 64, h, 16) for h in (4, 1, 1))
    impl, wire, scale = "flash", "fp32", None
    if problem == "wire_differs" and rank == 1:
        wire = "bf16"
    if problem == "unknown_wire" and rank == 1:
        wire = "fp16"
    if problem == "scale_differs" and rank == 1:
        scale = 0.3
    if problem == "odd_local_length" and rank == 1:
        q, k, v = (t[:, :63] for t in (q, k, v))
    if problem == "shapes_differ" and rank == 1:
        q, k, v = (t[..., :8].contiguous() for t in (q, k, v))
    if problem == "striped_layout":
        layout = Layout("striped", world_size)
    if problem == "cudnn_on_cpu":
        impl = "cudnn"
    try:
        dense_ring_attention(
            q, k, v, layout, RingGroups.flat(dist.group.WORLD), impl=impl, softmax_scale=scale, grad_wire_dtype=wire
        )
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.parametrize(
    "problem, message",
    [
        ("odd_local_length", r"invalid on rank\(s\) \[1\]|CP rank 1: N_loc=63 is odd.*multiple of 2 x 2"),
        ("shapes_differ", r"dense ring attention: the ranks of the group disagree on \{'d': \[16, 8\]"),
        ("striped_layout", r"needs the zigzag layout, got Layout\(kind='striped'.*use Layout\('zigzag', world_size\)"),
        ("cudnn_on_cpu", r"impl='cudnn' needs CUDA tensors, got CPU tensors.*use impl='flash'"),
        (
            "wire_differs",
            r"dense ring attention: the ranks of the group disagree on \{'grad_wire_dtype': \['fp32', 'bf16'\]",
        ),
        ("unknown_wire", r"invalid on rank\(s\) \[1\]|CP rank 1: grad_wire_dtype='fp16' is not one of"),
        (
            "scale_differs",
            r"dense ring attention: the ranks of the group disagree on \{'softmax_scale': \[0\.25, 0\.3\]",
        ),
    ],
)
def test_bad_input_raises_on_every_rank_without_hanging(distributed, problem, message):
    errors = distributed(_bad_dense_ring_input, 2, problem, timeout=60, collective_timeout=20)
    for rank, error in enumerate(errors):
        assert error is not None and re.search(message, error), f"rank {rank}: {error!r}"


# ------------------------------------------------------------------------------------------ MTrainingAttention
def _sdpa_attention_module(cp_group, dense_impl: str = "sdpa_flash", layout: str = "zigzag"):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.attention import MTrainingAttention
    from megatron_mtraining.config import MTrainingConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=1,
        kv_channels=16,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return MTrainingAttention(
        config=config,
        layer_number=2,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        pg_collection=ProcessGroupCollection(tp=None, cp=cp_group, hcp=None),
        mtraining=MTrainingConfig(dense_impl=dense_impl, dense=True, layout=layout),
    )


def _module_rank(rank, world_size, seed, shape):
    """MTrainingAttention (sdpa_flash) on this rank's zigzag tokens: out/grads [b, N_loc, H, d] and its stats."""
    attention = _sdpa_attention_module(dist.group.WORLD if world_size > 1 else None)
    layout = Layout("zigzag", world_size)
    b, n, hq, hkv, d = shape
    q, k, v, dout = _inputs(seed, *shape)
    local = [
        layout.shard(t, rank).permute(1, 0, 2, 3).contiguous().requires_grad_(t is not dout) for t in (q, k, v, dout)
    ]  # Megatron's [s, b, heads, d]
    out = attention(local[0], local[1], local[2], None)
    out.backward(local[3].reshape(out.shape))
    stats = attention.last_stats
    balance = stats.balance()
    tensors = [out.detach().view(-1, b, hq, d)] + [t.grad for t in local[:3]]
    return (
        [t.permute(1, 0, 2, 3) for t in tensors],
        dict(
            density=stats.density,
            dense=stats.dense,
            has_index=stats.v_idx is not None,
            worker=balance.worker_imbalance,
            step=balance.step_imbalance,
            layer=stats.layer_number,
        ),
    )


@pytest.mark.parametrize("world", [1, 2])
def test_attention_module_runs_the_sdpa_baseline(distributed, seed, world):
    shape = (1, 512, 4, 1, 16)  # the launcher's unit: 2 x CP x 128 tokens
    results = distributed(_module_rank, world, seed, shape) if world > 1 else [_module_rank(0, 1, seed, shape)]
    layout = Layout("zigzag", world)
    ours = [layout.unshard([r[0][i] for r in results]) for i in range(4)]
    out, _, dq, dk, dv = _reference(*_inputs(seed, *shape))
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, (out, dq, dk, dv)):
        err = (a.double() - r).abs().max().item()
        assert err <= 2e-5 * max(1.0, r.abs().max().item()), f"{name} differs by {err} (CP={world}, seed={seed})"
    for rank, (_, stats) in enumerate(results):
        assert stats == dict(density=1.0, dense=True, has_index=False, worker=1.0, step=1.0, layer=2), (rank, stats)


def test_attention_module_refuses_sdpa_with_another_layout_at_cp2(distributed):
    errors = distributed(_striped_sdpa_module, 2)
    for error in errors:
        assert re.search(
            r"--mtraining-dense-impl=sdpa_cudnn with --context-parallel-size=2 runs the zigzag dense "
            r"ring, but --mtraining-layout=striped; add --mtraining-layout zigzag",
            error,
        ), error


def _striped_sdpa_module(rank, world_size):
    try:
        _sdpa_attention_module(dist.group.WORLD, dense_impl="sdpa_cudnn", layout="striped")
    except ValueError as err:
        return str(err)
    return "accepted"


# ------------------------------------------------------------------------------------------ launcher
@pytest.mark.parametrize(
    "extra, cp, impl",
    [
        ("--mtraining-dense-impl sdpa_cudnn --mtraining-dense --mtraining-layout zigzag", 2, "cudnn"),
        (
            "--mtraining-dense-impl sdpa_flash --mtraining-dense --mtraining-layout zigzag "
            "--mtraining-grad-wire-dtype bf16",
            4,
            "flash",
        ),
        ("--mtraining-dense-impl sdpa_cudnn --mtraining-dense", 1, "cudnn"),  # CP = 1: any layout
    ],
)
def test_launcher_accepts_the_sdpa_baseline(extra, cp, impl):
    from megatron.training.arguments import add_megatron_arguments

    from megatron_mtraining.arguments import add_mtraining_args, validate_mtraining_args

    parser = argparse.ArgumentParser(allow_abbrev=False)  # as Megatron's parse_args builds it
    add_megatron_arguments(parser)
    add_mtraining_args(parser)
    args = parser.parse_args(
        f"--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 1024 "
        f"--max-position-embeddings 1024 --micro-batch-size 1 --context-parallel-size {cp} "
        f"{extra}".split()
    )
    config = validate_mtraining_args(args)
    assert (config.dense, config.dense_impl, config.sdpa_impl) == (True, f"sdpa_{impl}", impl)
