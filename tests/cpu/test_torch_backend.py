"""The torch_blocksparse launchers and the single-device interface against the masked reference."""

import pytest
import torch
import torch.nn.functional as F

from mtraining_kernels import interface, torch_backend
from mtraining_kernels.index import convert_index
from mtraining_kernels.interface import get_backend, sparse_attention, torch_block_sparse_attention
from mtraining_kernels.layout import Layout
from mtraining_kernels.merge import merge_attention
from mtraining_kernels.reference import reference_sparse_attention, vertical_slash_mask
from mtraining_kernels.torch_backend import block_bar_backward, block_bar_forward
from mtraining_kernels.vertical_slash import full_index

BLOCK = 128
SINGLE = Layout("contiguous", 1)


# ---------------------------------------------------------------------------------------- helpers
def _sorted_list(values: torch.Tensor, width: int, sentinel: int) -> torch.Tensor:
    values = values.unique().sort().values
    return torch.cat([values, torch.full((width - values.numel(),), sentinel)]).to(torch.int32)


def make_index(batch, heads, seq_len, pattern, verticals=24, slashes=12):
    """Random (v_idx, s_idx) ``[b, Hq, ·]`` of a pattern kind; per-head entry counts vary."""
    if pattern == "full":
        return full_index(batch, heads, seq_len)
    v_rows, s_rows = [], []
    for _ in range(batch * heads):
        v = torch.randperm(seq_len)[: int(torch.randint(0, verticals + 1, ()))]
        s = torch.randperm(seq_len)[: int(torch.randint(0, slashes + 1, ()))]
        if pattern == "mixed":  # with the forced sinks and local window of §2.1
            v, s = torch.cat([torch.arange(30), v]), torch.cat([torch.arange(100), s])
        if pattern in ("slashes", "diagonal"):
            v = v[:0]
        if pattern in ("verticals", "diagonal"):
            s = s[:0]
        v_rows.append(_sorted_list(v, verticals + 30, seq_len))
        s_rows.append(_sorted_list(s, slashes + 100, seq_len))
    return (torch.stack(v_rows).view(batch, heads, -1), torch.stack(s_rows).view(batch, heads, -1))


def make_qkv(batch, seq_len, heads, kv_heads, dim, dtype):
    q = torch.randn(batch, seq_len, heads, dim, dtype=dtype)
    k = torch.randn(batch, seq_len, kv_heads, dim, dtype=dtype)
    v = torch.randn(batch, seq_len, kv_heads, dim, dtype=dtype)
    return q, k, v


def reference_with_grads(q, k, v, mask, dout, compute_dtype=None):
    """Reference out, lse and (dq, dk, dv) by autograd, computed in ``compute_dtype``."""
    dtype = compute_dtype or (torch.float64 if q.dtype == torch.float64 else torch.float32)
    inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = reference_sparse_attention(*inputs, mask, compute_dtype=dtype)
    grads = torch.autograd.grad(out, inputs, dout.to(dtype))
    return out.detach(), lse.detach(), grads


def run_step_forward(q, k, v, index, source, out, lse, causal_diag):
    block_bar_forward(
        q,
        k,
        v,
        index.blk_ptr[source],
        index.blk_col,
        index.bar_ptr[source],
        index.bar_col,
        out,
        lse,
        causal_diag=causal_diag,
        softmax_scale=q.shape[-1] ** -0.5,
    )


def run_step_backward(q, k, v, dout, lse, delta, index, source, dq, dk, dv, causal_diag, deterministic=False):
    block_bar_backward(
        q,
        k,
        v,
        dout,
        lse,
        delta,
        index.blk_ptr[source],
        index.blk_col,
        index.bar_ptr[source],
        index.bar_col,
        dq,
        dk,
        dv,
        causal_diag=causal_diag,
        softmax_scale=q.shape[-1] ** -0.5,
        deterministic=deterministic,
    )


def single_device(q, k, v, dout, index):
    """Forward + backward with the launchers at W = 1; returns out, lse, dq, dk, dv (accumulator dtype)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc)
    run_step_forward(q, k, v, index, 0, out, lse, causal_diag=True)
    delta = (out * dout.to(acc)).sum(-1).transpose(1, 2).contiguous()
    dq, dk, dv = (torch.zeros(x.shape, dtype=acc) for x in (q, k, v))
    run_step_backward(q, k, v, dout, lse, delta, index, 0, dq, dk, dv, causal_diag=True)
    return out, lse, dq, dk, dv


def max_error(ours, ref):
    return (ours.double() - ref.double()).abs().max().item()


def assert_fa_rule(name, ours, ref, lowprec, eps_rel, seed):
    """DESIGN.md §6: max|ours − ref| ≤ 2·max|lowprec − ref| + ε, with ε = eps_rel·max|ref|."""
    eps = eps_rel * ref.abs().max().item()
    err, budget = max_error(ours, ref), 2 * max_error(lowprec, ref) + eps
    assert err <= budget, f"seed={seed} {name}: max error {err:.3e} > FA budget {budget:.3e}"


def assert_rmse(name, ours, ref, seed, limit=5e-3):
    rel = (torch.linalg.vector_norm(ours.double() - ref.double()) / torch.linalg.vector_norm(ref.double())).item()
    assert rel < limit, f"seed={seed} {name}: relative RMSE {rel:.3e} >= {limit}"


def assert_all_finite(seed, **tensors):
    for name, t in tensors.items():
        assert torch.isfinite(t).all(), f"seed={seed}: {name} has non-finite entries"


# ---------------------------------------------------------------------------------------- launchers
SHAPES = [
    # batch, query blocks, Hq, Hkv, d, pattern
    (1, 3, 4, 4, 64, "mixed"),  # MHA
    (2, 4, 8, 2, 32, "mixed"),  # GQA 4:1
    (1, 3, 8, 1, 128, "mixed"),  # GQA 8:1, d = 128
    (1, 2, 5, 5, 24, "verticals"),  # odd head count, verticals only
    (2, 2, 5, 1, 17, "slashes"),  # odd heads 5:1, odd d, slashes only
    (1, 11, 2, 1, 16, "mixed"),  # 11 blocks
    (1, 4, 3, 3, 64, "full"),
    (2, 3, 2, 2, 64, "diagonal"),  # empty index: diagonal blocks only
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("batch, blocks, heads, kv_heads, dim, pattern", SHAPES)
def test_launchers_match_reference(seed, dtype, batch, blocks, heads, kv_heads, dim, pattern):
    seq_len = blocks * BLOCK
    q, k, v = make_qkv(batch, seq_len, heads, kv_heads, dim, dtype)
    dout = torch.randn(batch, seq_len, heads, dim, dtype=dtype)
    v_idx, s_idx = make_index(batch, heads, seq_len, pattern)
    mask = vertical_slash_mask(v_idx, s_idx, seq_len)
    ours = single_device(q, k, v, dout, convert_index(v_idx, s_idx, SINGLE, 0, seq_len))
    assert_all_finite(seed, **dict(zip(("out", "lse", "dq", "dk", "dv"), ours)))

    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, mask, dout, torch.float64)
    refs = (ref_out, ref_lse, *ref_grads)
    names = ("out", "lse", "dq", "dk", "dv")
    if dtype == torch.float64:
        for name, x, ref in zip(names, ours, refs):
            torch.testing.assert_close(x, ref, rtol=1e-9, atol=1e-11, msg=lambda m: f"seed={seed} {name}: {m}")
    else:
        low_out, low_lse, low_grads = reference_with_grads(q, k, v, mask, dout, torch.float32)
        # ε: d fp32 roundings (at least 32). dS = P ⊙ (dP − δ) with δ = rowsum(out ⊙ dO) cancels in rows that
        # one key dominates, and dP and δ are fp32 sums of d products in other orders than the reference's
        # (DESIGN.md §6); a wrong list entry costs 10^4 times this budget.
        for name, x, ref, low in zip(names, ours, refs, (low_out, low_lse, *low_grads)):
            assert_fa_rule(name, x, ref, low, max(dim, 32) * 2.0**-24, seed)


@pytest.mark.parametrize(
    "kind, world", [("contiguous", 2), ("striped", 2), ("contiguous", 3), ("striped", 3), ("zigzag", 2)]
)
def test_ring_of_steps_matches_reference_on_gathered_sequence(seed, kind, world):
    """Every rank merges W source steps into one (out, lse), then replays them backward; dk/dv of a
    source accumulate over all query ranks — exactly what the ring does."""
    layout = Layout(kind, world)
    batch, heads, kv_heads, dim = 2, 4, 2, 32
    seq_len = world * 2 * BLOCK
    q, k, v = make_qkv(batch, seq_len, heads, kv_heads, dim, torch.float64)
    dout = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64)
    v_idx, s_idx = make_index(batch, heads, seq_len, "mixed", verticals=40, slashes=20)
    shards = {
        name: [layout.shard(x, r) for r in range(world)] for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout))
    }
    indexes = [convert_index(v_idx, s_idx, layout, r, seq_len) for r in range(world)]

    outs, lses = [], []
    for rank, index in enumerate(indexes):
        out = torch.zeros_like(shards["q"][rank])
        lse = torch.full((batch, heads, seq_len // world), float("-inf"), dtype=torch.float64)
        for step in range(world):
            source = index.source_for_step(step)
            run_step_forward(
                shards["q"][rank],
                shards["k"][source],
                shards["v"][source],
                index,
                source,
                out,
                lse,
                causal_diag=source == rank,
            )
        outs.append(out)
        lses.append(lse)

    dqs = [torch.zeros_like(x) for x in shards["q"]]
    dks = [torch.zeros_like(x) for x in shards["k"]]
    dvs = [torch.zeros_like(x) for x in shards["v"]]
    for rank, index in enumerate(indexes):
        delta = (outs[rank] * shards["dout"][rank]).sum(-1).transpose(1, 2).contiguous()
        for step in range(world):
            source = index.source_for_step(step)
            run_step_backward(
                shards["q"][rank],
                shards["k"][source],
                shards["v"][source],
                shards["dout"][rank],
                lses[rank],
                delta,
                index,
                source,
                dqs[rank],
                dks[source],
                dvs[source],
                causal_diag=source == rank,
            )

    gathered = (
        layout.unshard(outs),
        layout.unshard(lses, dim=2),
        layout.unshard(dqs),
        layout.unshard(dks),
        layout.unshard(dvs),
    )
    mask = vertical_slash_mask(v_idx, s_idx, seq_len)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, mask, dout)
    for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), gathered, (ref_out, ref_lse, *ref_grads)):
        assert torch.isfinite(x).all(), f"seed={seed} {kind} W={world}: {name} has non-finite entries"
        torch.testing.assert_close(
            x, ref, rtol=1e-9, atol=1e-11, msg=lambda m: f"seed={seed} {kind} W={world} {name}: {m}"
        )


def test_rows_without_work_are_left_bit_identical(seed):
    """Rank 1 of a contiguous W = 2 split reading source 0 (no diagonal, no causal mask): heads whose
    lists are empty keep their buffers exactly; the others equal merge(previous, step alone)."""
    layout, batch, heads, dim = Layout("contiguous", 2), 1, 4, 32
    seq_len = 4 * BLOCK
    v_idx, s_idx = make_index(batch, heads, seq_len, "verticals", verticals=6)
    v_idx[0, 0] = seq_len  # head 0: no verticals → no work at all
    v_idx[0, 1, 0] = 7  # head 1: surely a bar in source 0
    index = convert_index(v_idx, s_idx, layout, 1, seq_len)
    q = torch.randn(batch, seq_len // 2, heads, dim, dtype=torch.float64)
    k, v = (torch.randn(batch, seq_len // 2, heads, dim, dtype=torch.float64) for _ in range(2))
    prev_out = torch.randn(batch, seq_len // 2, heads, dim, dtype=torch.float64)
    prev_lse = torch.randn(batch, heads, seq_len // 2, dtype=torch.float64)

    out, lse = prev_out.clone(), prev_lse.clone()
    run_step_forward(q, k, v, index, 0, out, lse, causal_diag=False)
    alone_out = torch.zeros_like(out)
    alone_lse = torch.full_like(lse, float("-inf"))
    run_step_forward(q, k, v, index, 0, alone_out, alone_lse, causal_diag=False)
    expected_out, expected_lse = merge_attention(prev_out, prev_lse, alone_out, alone_lse)

    assert torch.equal(out[:, :, 0], prev_out[:, :, 0]) and torch.equal(lse[:, 0], prev_lse[:, 0]), f"seed={seed}"
    assert not torch.equal(lse[:, 1], prev_lse[:, 1]), f"seed={seed}: head 1 had work but lse did not change"
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-13, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-13, msg=lambda m: f"seed={seed}: {m}")

    # a step with no work at all (rank 0 reading its future source 1) touches nothing, backward included
    index0 = convert_index(v_idx, s_idx, layout, 0, seq_len)
    out, lse = prev_out.clone(), prev_lse.clone()
    run_step_forward(q, k, v, index0, 1, out, lse, causal_diag=False)
    grads = [torch.randn_like(x) for x in (q, k, v)]
    before = [g.clone() for g in grads]
    run_step_backward(
        q, k, v, torch.randn_like(q), prev_lse, torch.randn_like(prev_lse), index0, 1, *grads, causal_diag=False
    )
    assert torch.equal(out, prev_out) and torch.equal(lse, prev_lse), f"seed={seed}"
    assert all(torch.equal(g, b) for g, b in zip(grads, before)), f"seed={seed}"


def test_chunked_rows_match_one_chunk(seed, monkeypatch):
    batch, seq_len, heads, kv_heads, dim = 2, 3 * BLOCK, 4, 2, 16
    q, k, v = make_qkv(batch, seq_len, heads, kv_heads, dim, torch.float64)
    dout = torch.randn_like(q)
    index = convert_index(*make_index(batch, heads, seq_len, "mixed"), SINGLE, 0, seq_len)
    whole = single_device(q, k, v, dout, index)
    monkeypatch.setattr(torch_backend, "SCORE_ELEMENTS_PER_CHUNK", BLOCK * 64)  # one query block per chunk
    chunked = single_device(q, k, v, dout, index)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), chunked, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=lambda m: f"seed={seed} {name}: {m}")


def test_backward_is_repeatable(seed):
    batch, seq_len, heads, kv_heads, dim = 1, 4 * BLOCK, 4, 1, 32
    q, k, v = make_qkv(batch, seq_len, heads, kv_heads, dim, torch.float32)
    dout = torch.randn_like(q)
    index = convert_index(*make_index(batch, heads, seq_len, "mixed"), SINGLE, 0, seq_len)
    first, second = single_device(q, k, v, dout, index), single_device(q, k, v, dout, index)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"seed={seed}: {name} differs between identical runs"


# ---------------------------------------------------------------------------------------- validation
def _valid_step_args():
    seq_len, heads, dim = 2 * BLOCK, 2, 8
    q, k, v = make_qkv(1, seq_len, heads, heads, dim, torch.float32)
    index = convert_index(*make_index(1, heads, seq_len, "mixed"), SINGLE, 0, seq_len)
    out = torch.zeros(q.shape)
    lse = torch.full((1, heads, seq_len), float("-inf"))
    return dict(
        q=q,
        k=k,
        v=v,
        blk_ptr=index.blk_ptr[0],
        blk_col=index.blk_col,
        bar_ptr=index.bar_ptr[0],
        bar_col=index.bar_col,
        out=out,
        lse=lse,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"].half()), "dtypes differ"),
        (lambda a: a.update(q=a["q"].int(), k=a["k"].int(), v=a["v"].int()), "q has dtype"),
        (
            lambda a: a.update(k=a["k"][:, :, :1].repeat(1, 1, 3, 1), v=a["v"][:, :, :1].repeat(1, 1, 3, 1)),
            "multiple of KV heads",
        ),
        (lambda a: a.update(q=a["q"][:, :200], out=a["out"][:, :200]), "multiple of the block size"),
        (lambda a: a.update(k=a["k"][:, :BLOCK], v=a["v"][:, :BLOCK]), "must equal q length"),
        (lambda a: a.update(blk_ptr=a["blk_ptr"].long()), "blk_ptr must be an int32"),
        (lambda a: a.update(bar_ptr=a["bar_ptr"][:, :, :2]), "bar_ptr must have shape"),
        (lambda a: a.update(blk_col=a["blk_col"] + 4), "blk_col holds sub-tile indices"),
        (lambda a: a.update(blk_col=a["blk_col"].view(-1, 2).flip(1).reshape(-1)), "sub-tile pair 2j, 2j\\+1"),
        (lambda a: a.update(blk_ptr=a["blk_ptr"].flip(-1).contiguous()), "non-decreasing"),
        (lambda a: a.update(out=a["out"].double()), "out has dtype"),
        (lambda a: a.update(out=a["out"].transpose(1, 2).contiguous().transpose(1, 2)), "out must be contiguous"),
        (lambda a: a.update(lse=a["lse"][:, :1]), "lse must have shape"),
    ],
)
def test_forward_rejects_bad_inputs(change, message):
    args = _valid_step_args()
    change(args)
    out_before = args["out"].clone()
    with pytest.raises(ValueError, match=message):
        block_bar_forward(**args, causal_diag=True, softmax_scale=0.3)
    assert torch.equal(args["out"], out_before)


def test_forward_rejects_bad_scale_and_backward_rejects_bad_buffers():
    args = _valid_step_args()
    with pytest.raises(ValueError, match="softmax_scale"):
        block_bar_forward(**args, causal_diag=True, softmax_scale=float("nan"))
    q, k, v, lse = args["q"], args["k"], args["v"], args["lse"]
    lists = (args["blk_ptr"], args["blk_col"], args["bar_ptr"], args["bar_col"])
    grads = dict(dq=torch.zeros(q.shape), dk=torch.zeros(k.shape), dv=torch.zeros(v.shape))
    for name, bad, message in (
        ("dk", torch.zeros(k.shape, dtype=torch.bfloat16), "dk has dtype"),
        ("dq", torch.zeros(2, *q.shape[1:]), "dq must have shape"),
    ):
        with pytest.raises(ValueError, match=message):
            block_bar_backward(
                q,
                k,
                v,
                torch.zeros_like(q),
                lse,
                torch.zeros_like(lse),
                *lists,
                **{**grads, name: bad},
                causal_diag=True,
                softmax_scale=0.3,
            )
    with pytest.raises(ValueError, match="dout"):
        block_bar_backward(
            q,
            k,
            v,
            torch.zeros(q.shape, dtype=torch.float16),
            lse,
            torch.zeros_like(lse),
            *lists,
            **grads,
            causal_diag=True,
            softmax_scale=0.3,
        )


# ---------------------------------------------------------------------------------------- interface
def test_sparse_attention_matches_reference_fp64(seed):
    batch, seq_len, heads, kv_heads, dim = 2, 3 * BLOCK, 4, 2, 32
    q, k, v = (x.requires_grad_() for x in make_qkv(batch, seq_len, heads, kv_heads, dim, torch.float64))
    v_idx, s_idx = make_index(batch, heads, seq_len, "mixed")
    out, lse = sparse_attention(q, k, v, convert_index(v_idx, s_idx, SINGLE, 0, seq_len), return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, vertical_slash_mask(v_idx, s_idx, seq_len), dout)
    assert out.dtype == torch.float64 and lse.shape == (batch, heads, seq_len) and not lse.requires_grad
    for name, x, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        torch.testing.assert_close(x, ref, rtol=1e-9, atol=1e-11, msg=lambda m: f"seed={seed} {name}: {m}")


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 1)])
def test_full_pattern_equals_dense_causal_sdpa(seed, heads, kv_heads):
    batch, seq_len, dim = 2, 3 * BLOCK, 64
    q, k, v = (x.requires_grad_() for x in make_qkv(batch, seq_len, heads, kv_heads, dim, torch.float64))
    out = torch_block_sparse_attention(q, k, v, *full_index(batch, heads, seq_len))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    dense = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    dense_grads = torch.autograd.grad(dense, (q, k, v), dout)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (dense, *dense_grads)):
        torch.testing.assert_close(x, ref, rtol=1e-9, atol=1e-11, msg=lambda m: f"seed={seed} {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 1, 64), (2, 2, 128)])
def test_low_precision_meets_fa_rule(seed, dtype, heads, kv_heads, dim):
    batch, seq_len = 1, 4 * BLOCK
    q, k, v = (x.requires_grad_() for x in make_qkv(batch, seq_len, heads, kv_heads, dim, dtype))
    v_idx, s_idx = make_index(batch, heads, seq_len, "mixed")
    out, lse = torch_block_sparse_attention(q, k, v, v_idx, s_idx, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.dtype == dtype and lse.dtype == torch.float32 and all(g.dtype == dtype for g in grads)

    mask = vertical_slash_mask(v_idx, s_idx, seq_len)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, mask, dout, torch.float32)
    low_out, low_lse, low_grads = reference_with_grads(q, k, v, mask, dout, dtype)
    eps_rel = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    for name, x, ref, low in zip(
        ("out", "lse", "dq", "dk", "dv"),
        (out, lse, *grads),
        (ref_out, ref_lse, *ref_grads),
        (low_out, low_lse, *low_grads),
    ):
        assert_fa_rule(name, x, ref, low, eps_rel, seed)
        assert_rmse(name, x, ref, seed)


def test_interface_backward_is_deterministic(seed):
    batch, seq_len, heads, kv_heads, dim = 1, 3 * BLOCK, 4, 2, 32
    q, k, v = (x.requires_grad_() for x in make_qkv(batch, seq_len, heads, kv_heads, dim, torch.bfloat16))
    index = convert_index(*make_index(batch, heads, seq_len, "mixed"), SINGLE, 0, seq_len)
    dout = torch.randn(batch, seq_len, heads, dim, dtype=torch.bfloat16)
    runs = [
        torch.autograd.grad(sparse_attention(q, k, v, index, deterministic=True), (q, k, v), dout) for _ in range(2)
    ]
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"seed={seed}: {name} differs between repeated backwards"


def test_interface_rejects_bad_index_and_backend(monkeypatch):
    seq_len, heads = 2 * BLOCK, 2
    q, k, v = make_qkv(1, seq_len, heads, heads, 8, torch.float32)
    v_idx, s_idx = make_index(1, heads, seq_len, "mixed")
    with pytest.raises(ValueError, match="world_size=2"):
        sparse_attention(q, k, v, convert_index(v_idx, s_idx, Layout("striped", 2), 0, seq_len))
    index = convert_index(v_idx, s_idx, SINGLE, 0, seq_len)
    with pytest.raises(ValueError, match="seq_len=256"):
        sparse_attention(q[:, :BLOCK], k[:, :BLOCK], v[:, :BLOCK], index)
    with pytest.raises(ValueError, match="unknown"):
        sparse_attention(q, k, v, index, backend="flash")
    with pytest.raises(ValueError, match="unknown"):
        get_backend("reference")
    monkeypatch.setitem(interface.BACKEND_MODULES, "triton", "mtraining_kernels.no_such_backend")
    with pytest.raises(ImportError, match="backend 'triton' is unavailable"):
        sparse_attention(q, k, v, index, backend="triton")
    assert get_backend("torch_blocksparse") is torch_backend
