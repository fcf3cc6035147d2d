"""The benchmark's structured q/k (tools/structured_qk.py): determinism, the planted structure, and that the
top-P estimator finds a sparse pattern on them where random q/k give a dense one."""

import math

import pytest
import torch
from tool_modules import load_tool

from mtraining_kernels.budget import TopPBudget
from mtraining_kernels.estimation import estimate_vertical_slash

mask_density = load_tool("bench_attention").mask_density
structured_qk_tool = load_tool("structured_qk")
structured_qk = structured_qk_tool.structured_qk
HUB_EVERY, HUB_LOGIT = structured_qk_tool.HUB_EVERY, structured_qk_tool.HUB_LOGIT
SINK_LOGIT, SINKS = structured_qk_tool.SINK_LOGIT, structured_qk_tool.SINKS


def draw(seed, seq_len=8192, q_heads=4, kv_heads=2, dim=128):
    return structured_qk(1, seq_len, q_heads, kv_heads, dim, generator=torch.Generator().manual_seed(seed))


def last_rows_logits(q, k, head, rows=64):
    """Logits ``[rows, N]`` of the last ``rows`` queries of query head ``head``, unmasked."""
    group = q.shape[2] // k.shape[2]
    return q[0, -rows:, head] @ k[0, :, head // group].T / math.sqrt(q.shape[-1])


def test_same_seed_same_tensors_and_shapes(seed):
    q, k = draw(seed)
    again_q, again_k = draw(seed)
    assert q.shape == (1, 8192, 4, 128) and k.shape == (1, 8192, 2, 128) and q.dtype == torch.float32
    assert torch.equal(q, again_q) and torch.equal(k, again_k)
    assert not torch.equal(q, draw(seed + 1)[0])


def test_planted_columns_and_band(seed):
    """The slowest RoPE pair carries the columns: its share of the logit (mean over the 64 last rows) is the
    planted logit on sinks and hubs and about 0 elsewhere, up to the key noise on that pair (σ = 9/√d ≈ 0.8;
    the bounds are 5–6 σ). The band lifts the first offsets above the far
    ones (δ ≥ 4000, where all but the slowest band pairs have turned many times)."""
    q, k = draw(seed)
    seq_len, dim = q.shape[1], q.shape[-1]
    pair = [dim // 2 - 1, dim - 1]
    for head in range(4):
        k_pair = k[0, :, head // 2][:, pair]
        column = (q[0, -64:, head][:, pair] @ k_pair.T / math.sqrt(dim)).mean(0)  # [N]
        hubs = (k_pair[SINKS:].norm(dim=-1) >= 8).nonzero().flatten() + SINKS  # noise alone: < 8
        plain = torch.ones(seq_len, dtype=torch.bool)
        plain[:SINKS] = plain[hubs] = False
        assert len(hubs) == seq_len // HUB_EVERY, f"seed={seed}: {len(hubs)} hubs"
        assert (column[:SINKS] - SINK_LOGIT).abs().max() < 4, f"seed={seed} head {head}: {column[:SINKS]}"
        assert (column[hubs] - HUB_LOGIT).abs().max() < 4, f"seed={seed} head {head}: {column[hubs]}"
        assert column[plain].abs().max() < 5, f"seed={seed} head {head}: plain {column[plain].abs().max():.1f}"
        mean = last_rows_logits(q, k, head).mean(0)
        band = float(mean[-3:].mean() - mean[: seq_len - 4000][plain[: seq_len - 4000]].mean())
        assert band > 5, f"seed={seed} head {head}: band +{band:.1f}"


@pytest.mark.parametrize("p", [0.9, 0.95])
def test_top_p_pattern_is_sparse_on_structured_and_dense_on_random_inputs(seed, p):
    seq_len = 16384
    q, k = draw(seed, seq_len)
    index = estimate_vertical_slash(q.bfloat16(), k.bfloat16(), TopPBudget(p))
    structured = mask_density(index.v_idx, index.s_idx, seq_len)
    generator = torch.Generator().manual_seed(seed)
    q_random, k_random = (torch.randn(t.shape, generator=generator).bfloat16() for t in (q, k))
    random_index = estimate_vertical_slash(q_random, k_random, TopPBudget(p))
    random = mask_density(random_index.v_idx, random_index.s_idx, seq_len)
    assert structured < (0.4 if p == 0.9 else 0.7) and random > 0.8, (
        f"seed={seed} p={p}: density {structured:.3f} vs random {random:.3f}"
    )


@pytest.mark.parametrize("shape", [(4, 3, 128), (4, 2, 127), (4, 2, 64)])
def test_bad_shapes_are_refused(shape):
    q_heads, kv_heads, dim = shape
    with pytest.raises(ValueError, match=f"q_heads={q_heads}, kv_heads={kv_heads}, dim={dim}"):
        structured_qk(1, 4096, q_heads, kv_heads, dim, generator=torch.Generator())
