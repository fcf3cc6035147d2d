"""Tests of the reference semantics in mtraining_kernels.reference against independent definitions."""

import pytest
import torch
import torch.nn.functional as F

from mtraining_kernels.merge import merge_attention
from mtraining_kernels.reference import reference_sparse_attention, vertical_slash_mask
from mtraining_kernels.vertical_slash import full_index, mask_area, slash_block_hits


def _random_sorted_list(high: int, max_count: int, width: int, sentinel: int) -> torch.Tensor:
    """A random ascending list of distinct values in [0, high), padded with ``sentinel`` to ``width``."""
    count = int(torch.randint(0, max_count + 1, ()))
    values = torch.randperm(high)[:count].sort().values
    return torch.cat([values, torch.full((width - count,), sentinel)]).to(torch.int32)


def _random_index(batch, heads, seq_len, max_verticals, max_slashes):
    v_idx = torch.stack(
        [
            torch.stack([_random_sorted_list(seq_len, max_verticals, max_verticals + 2, seq_len) for _ in range(heads)])
            for _ in range(batch)
        ]
    )
    s_idx = torch.stack(
        [
            torch.stack([_random_sorted_list(seq_len, max_slashes, max_slashes + 2, seq_len) for _ in range(heads)])
            for _ in range(batch)
        ]
    )
    return v_idx, s_idx


def _brute_force_mask(verticals: list[int], slashes: list[int], seq_len: int, block: int) -> torch.Tensor:
    """DESIGN.md §2.1 written out pair by pair."""
    mask = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for i in range(seq_len):
        for j in range(i + 1):
            delta = i // block - j // block
            block_on = delta == 0 or any((delta - 1) * block < s < (delta + 1) * block for s in slashes)
            mask[i, j] = block_on or j in verticals
    return mask


@pytest.mark.parametrize("block, num_blocks, heads", [(8, 6, 3), (16, 5, 2), (128, 3, 1)])
def test_mask_matches_brute_force_definition(seed, block, num_blocks, heads):
    seq_len = block * num_blocks
    v_idx, s_idx = _random_index(2, heads, seq_len, max_verticals=6, max_slashes=5)
    mask = vertical_slash_mask(v_idx, s_idx, seq_len, block_size=block)
    for b in range(2):
        for h in range(heads):
            verticals = [x for x in v_idx[b, h].tolist() if x < seq_len]
            slashes = [x for x in s_idx[b, h].tolist() if x < seq_len]
            expected = _brute_force_mask(verticals, slashes, seq_len, block)
            assert torch.equal(mask[b, h], expected), (
                f"seed={seed} b={b} h={h} verticals={verticals} slashes={slashes}: "
                f"{int((mask[b, h] != expected).sum())} pairs differ"
            )


@pytest.mark.parametrize("block, num_blocks", [(8, 6), (16, 5), (128, 3)])
def test_mask_area_counts_the_materialised_mask(seed, block, num_blocks):
    seq_len = block * num_blocks
    v_idx, s_idx = _random_index(2, 3, seq_len, max_verticals=6, max_slashes=5)
    expected = vertical_slash_mask(v_idx, s_idx, seq_len, block_size=block).sum((-1, -2))
    assert torch.equal(mask_area(v_idx, s_idx, seq_len, block_size=block), expected), f"seed={seed}"


def test_mask_rows_are_rows_of_the_full_mask(seed):
    gen = torch.Generator().manual_seed(seed)
    seq_len = 512
    v_idx = torch.randint(0, seq_len + 1, (2, 3, 16), generator=gen).sort(-1).values.int()
    s_idx = torch.randint(0, seq_len + 1, (2, 3, 16), generator=gen).sort(-1).values.int()
    reference = vertical_slash_mask(v_idx, s_idx, seq_len)
    rows = torch.arange(100, 300)
    assert torch.equal(vertical_slash_mask(v_idx, s_idx, seq_len, rows=rows), reference[:, :, 100:300])
    assert torch.equal(vertical_slash_mask(v_idx, s_idx, seq_len, rows=rows)[..., :300], reference[:, :, 100:300, :300])


def test_slash_band_touches_one_or_two_block_distances():
    # s = a·B + t switches on distance a, and a + 1 when t > 0 (B = 128, 4 blocks, sentinel 512)
    s_idx = torch.tensor([[[128, 512], [130, 512], [127, 512], [512, 512]]], dtype=torch.int32)
    hits = slash_block_hits(s_idx, 4).tolist()[0]
    assert hits == [
        [True, True, False, False],
        [True, True, True, False],
        [True, True, False, False],
        [True, False, False, False],
    ]


@pytest.mark.parametrize("block_size", [16, 128])
def test_slash_block_hits_follow_the_band_rule(seed, block_size):
    """hit[δ] for δ ≥ 1 iff some offset s in [0, N) has (δ−1)·B < s < (δ+1)·B, hit[0] always; offsets outside
    [0, N) (sentinels, garbage) switch nothing on. Random offsets by loops, int32 and int64."""
    num_blocks = 6
    seq_len = num_blocks * block_size

    def band_hits(offsets: list[int]) -> list[bool]:
        valid = [s for s in offsets if 0 <= s < seq_len]
        return [
            delta == 0 or any((delta - 1) * block_size < s < (delta + 1) * block_size for s in valid)
            for delta in range(num_blocks)
        ]

    for dtype in (torch.int32, torch.int64):
        s_idx = torch.randint(-2 * block_size, seq_len + 2 * block_size, (2, 3, 7)).to(dtype)
        expected = [[band_hits(row) for row in sample] for sample in s_idx.tolist()]
        hits = slash_block_hits(s_idx, num_blocks, block_size)
        assert hits.is_contiguous() and hits.tolist() == expected, f"seed={seed} {dtype}: {s_idx.tolist()}"


def test_full_pattern_equals_dense_causal_sdpa(seed):
    batch, seq_len, heads, kv_heads, dim = 2, 256, 4, 2, 16
    q = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, seq_len, kv_heads, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, seq_len, kv_heads, dim, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64)
    mask = vertical_slash_mask(*full_index(batch, heads, seq_len), seq_len)
    out, lse = reference_sparse_attention(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    dense = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).transpose(1, 2)
    dense_grads = torch.autograd.grad(dense, (q, k, v), dout)
    scores = (qt @ kt.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2)) * dim**-0.5
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    dense_lse = scores.masked_fill(~causal, float("-inf")).logsumexp(-1)

    torch.testing.assert_close(out, dense, rtol=1e-10, atol=1e-12, msg=lambda m: f"seed={seed} out: {m}")
    torch.testing.assert_close(lse, dense_lse, rtol=1e-10, atol=1e-12, msg=lambda m: f"seed={seed} lse: {m}")
    for name, ours, ref in zip("qkv", grads, dense_grads):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12, msg=lambda m: f"seed={seed} d{name}: {m}")


def test_empty_rows_have_zero_output_and_finite_gradients(seed):
    batch, seq_len, heads, dim = 1, 64, 2, 8
    q = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64, requires_grad=True)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    mask = (torch.rand(batch, heads, seq_len, seq_len) < 0.3) & causal
    empty = torch.rand(batch, heads, seq_len) < 0.3
    empty[..., 0] = True
    empty[..., 1] = False
    mask[..., 1, 0] = True
    mask &= ~empty[..., None]
    empty = ~mask.any(-1)
    out, lse = reference_sparse_attention(q, k, v, mask)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    out_bh = out.transpose(1, 2)  # [b, H, N, d]
    assert torch.equal(out_bh[empty], torch.zeros_like(out_bh[empty])), f"seed={seed}"
    assert torch.equal(lse[empty], torch.full_like(lse[empty], float("-inf"))), f"seed={seed}"
    assert torch.equal(dq.transpose(1, 2)[empty], torch.zeros_like(out_bh[empty])), f"seed={seed}"
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(grad).all(), f"seed={seed}: {name} has non-finite entries"

    # non-empty rows against an independent masked softmax
    scores = (q.detach().transpose(1, 2) @ k.detach().transpose(1, 2).transpose(-1, -2)) * dim**-0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    expected = probs @ v.detach().transpose(1, 2)
    torch.testing.assert_close(
        out_bh.detach()[~empty], expected[~empty], rtol=1e-10, atol=1e-12, msg=lambda m: f"seed={seed}: {m}"
    )


@pytest.mark.parametrize("split", ["halves", "random"])
def test_merge_of_disjoint_key_sets_equals_attention_over_union(seed, split):
    batch, seq_len, heads, dim = 2, 96, 3, 8
    q = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64)
    k = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64)
    v = torch.randn(batch, seq_len, heads, dim, dtype=torch.float64)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    union = (torch.rand(batch, heads, seq_len, seq_len) < 0.5) & causal
    union[..., : seq_len // 4, :] = False  # some rows see nothing at all
    if split == "halves":
        first = (torch.arange(seq_len) < seq_len // 2).expand(seq_len, seq_len)
    else:
        first = torch.rand(batch, heads, seq_len, seq_len) < 0.5
    out0, lse0 = reference_sparse_attention(q, k, v, union & first)
    out1, lse1 = reference_sparse_attention(q, k, v, union & ~first)
    expected_out, expected_lse = reference_sparse_attention(q, k, v, union)
    assert torch.isinf(lse0).any() and torch.isfinite(lse1).any(), f"seed={seed}: no one-sided rows"

    for a, b in (((out0, lse0), (out1, lse1)), ((out1, lse1), (out0, lse0))):
        merged_out, merged_lse = merge_attention(*a, *b)
        torch.testing.assert_close(
            merged_out, expected_out, rtol=1e-10, atol=1e-12, msg=lambda m: f"seed={seed} out: {m}"
        )
        torch.testing.assert_close(
            merged_lse, expected_lse, rtol=1e-10, atol=1e-12, msg=lambda m: f"seed={seed} lse: {m}"
        )

    # rows empty on both sides keep (out0, −inf) bit for bit
    poison = torch.full_like(out0, 7.0)
    merged_out, merged_lse = merge_attention(poison, lse0, out1, lse1)
    both_empty = (torch.isinf(lse0) & torch.isinf(lse1)).transpose(1, 2)
    assert both_empty.any(), f"seed={seed}"
    assert torch.equal(merged_out[both_empty], poison[both_empty]), f"seed={seed}"
    assert torch.isinf(merged_lse.transpose(1, 2)[both_empty]).all(), f"seed={seed}"


def test_merge_ignores_whatever_an_empty_side_holds(seed):
    out0 = torch.full((1, 4, 2, 8), float("nan"))
    lse0 = torch.full((1, 2, 4), float("-inf"))
    out1 = torch.randn(1, 4, 2, 8)
    lse1 = torch.randn(1, 2, 4)
    out, lse = merge_attention(out0, lse0, out1, lse1)
    assert torch.equal(out, out1) and torch.equal(lse, lse1), f"seed={seed}"


def test_merge_weights_keep_fp32_precision_at_large_lse(seed):
    """At |lse| ~ 1e4 fp32's ulp is 1e-3: weights taken against the rounded merged lse would be off by up to
    5e-4 relative on every row (then amplified into dq); against the larger side they stay at a few ulp."""
    shape_out, shape_lse = (2, 64, 3, 16), (2, 3, 64)
    lse0 = 1e4 + 100 * torch.rand(shape_lse)
    lse1 = lse0 - 40 * torch.rand(shape_lse) * torch.where(torch.rand(shape_lse) < 0.5, 1.0, -1.0)
    out0, out1 = torch.randn(shape_out), torch.randn(shape_out)
    merged_out, merged_lse = merge_attention(out0, lse0, out1, lse1)

    w0 = torch.sigmoid(lse0.double() - lse1.double()).transpose(1, 2)[..., None]
    expected = w0 * out0.double() + (1 - w0) * out1.double()
    scale = w0 * out0.double().abs() + (1 - w0) * out1.double().abs()
    error = ((merged_out.double() - expected).abs() / scale).max().item()
    assert error < 8 * torch.finfo(torch.float32).eps, f"seed={seed}: merged out off by {error:.2e} relative"
    exact_lse = torch.logaddexp(lse0.double(), lse1.double())
    assert (merged_lse.double() - exact_lse).abs().max().item() <= 1e-3, f"seed={seed}: merged lse"
