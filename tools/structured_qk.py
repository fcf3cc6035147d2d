"""Post-RoPE queries and keys whose attention has a vertical-slash structure, for benchmarks.

On random q/k attention is nearly uniform, so the top-P estimator (rightly) selects almost every entry.
Trained heads concentrate their mass instead; :func:`structured_qk` builds inputs from the three
ingredients the vertical-slash pattern describes (DESIGN.md §2.1), plus unit Gaussian noise in every
dimension (random logits of standard deviation ≈ 1 after the 1/√d scale):

* a **local band**: every key head carries one content vector on the RoPE pairs ``BAND_PAIRS`` (rotation
  periods of ≈ 12 to 28,000 tokens), and every query head a scaled copy, so the logit of offset δ is a
  sum of cos(θ_f·δ) terms: its peak at δ = 0 falls to 34 % by δ = 100, 20 % by 1000 and to ±10 %
  beyond 3000 (a sharp local band on a long recency tail);
* a **distant slash**: a second copy, in the key rotated back by a per-head offset δ₀ ∈ [256, N/4], so the
  same bump sits at offset δ₀ (a head that attends a fixed distance back);
* **vertical columns**: the 4 first tokens (sinks, logit ≈ +14) and N/2048 random "hub" tokens (≈ +10)
  carry a component on the slowest pair (its rotation is < 1 rad over 512K tokens), which every query
  carries too.

Peak heights vary per head (query scale 0.8–1.6: band peaks ≈ 9–18), so the heads range from almost
purely local to diffuse. The amplitudes are chosen so that top-P 0.9 selects a pattern of ≈ 11 % density
at 128K (8 heads, seed 0; 0.95: ≈ 27 %; random q/k: ≈ 90 % at 32K, the cap): sparse, but neither
trivially local nor uniform. The construction is a benchmark input, not a model of any particular network:
what it provides is that the pattern the estimator selects has a realistic *shape* (band, a few
diagonals, a few columns), so its density and the cost of estimating it can be measured.
"""

from __future__ import annotations

import math

import torch

BAND_PAIRS = range(3, 40)  # RoPE pairs carrying the band (θ_f from 0.52 to 2.2e-4 at base 1e6, d = 128)
BAND_AMPLITUDE = 1.9  # per pair, in keys; queries carry it times their head's scale
SINKS, HUB_EVERY = 4, 2048
SINK_LOGIT, HUB_LOGIT = 14.0, 10.0
COLUMN_QUERY = 9.0  # every query's slow-pair component; keys carry logit·√d / COLUMN_QUERY there


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """``x [..., n, d]`` rotated at ``positions [n]`` (rotate-half convention: pair f = dims f, f + d/2)."""
    half = x.shape[-1] // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / x.shape[-1])
    angle = positions.to(x.device, torch.float64)[:, None] * theta
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], -1)


def structured_qk(
    batch: int,
    seq_len: int,
    q_heads: int,
    kv_heads: int,
    dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    rope_base: float = 1e6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q ``[b, N, Hq, d]``, k ``[b, N, Hkv, d]``) float32 on ``device``, post-RoPE, in global order.

    Random draws come from ``generator`` (a CPU generator; the same seed gives the same tensors on any
    device). Query head h reads key head h // (Hq / Hkv), as in GQA.
    """
    if q_heads % kv_heads or dim % 2 or dim // 2 <= max(BAND_PAIRS) or seq_len < 4 * 256:
        raise ValueError(
            f"q_heads={q_heads}, kv_heads={kv_heads}, dim={dim}, seq_len={seq_len}: need Hq a "
            f"multiple of Hkv, an even d > {2 * max(BAND_PAIRS)} and N >= 1024"
        )
    half = dim // 2
    slow_pair = half - 1
    positions = torch.arange(seq_len)
    band = torch.zeros(dim)
    band[list(BAND_PAIRS)] = BAND_AMPLITUDE

    key_content = torch.zeros(kv_heads, seq_len, dim)
    for head in range(kv_heads):
        offset = int(torch.randint(256, seq_len // 4 + 1, (1,), generator=generator))
        distant = rope(band[None], torch.tensor([offset]), rope_base)[0]
        key_content[head] = band + distant
        hubs = torch.randperm(seq_len - SINKS, generator=generator)[: seq_len // HUB_EVERY] + SINKS
        key_content[head, :SINKS, slow_pair] = SINK_LOGIT * math.sqrt(dim) / COLUMN_QUERY
        key_content[head, hubs, slow_pair] = HUB_LOGIT * math.sqrt(dim) / COLUMN_QUERY
    scale = 0.8 + 0.8 * torch.rand(q_heads, generator=generator)
    query_content = scale[:, None] * band
    query_content[:, slow_pair] = COLUMN_QUERY

    k = torch.empty(batch, seq_len, kv_heads, dim, device=device)
    q = torch.empty(batch, seq_len, q_heads, dim, device=device)
    for sample in range(batch):
        for head in range(kv_heads):
            noise = torch.randn(seq_len, dim, generator=generator)
            k[sample, :, head] = rope((key_content[head] + noise).to(device), positions, rope_base)
        for head in range(q_heads):
            noise = torch.randn(seq_len, dim, generator=generator)
            q[sample, :, head] = rope((query_content[head] + noise).to(device), positions, rope_base)
    return q, k
