"""The synthetic vertical-slash pattern of the balance simulation (DESIGN.md §2.3), a benchmark input.

Sink columns and a local band, every entry present, plus random distant columns and diagonals; a
benchmark picks how many distant ones to reach the density it measures at.
"""

from __future__ import annotations

import torch
from torch import Tensor


def realistic_pattern(
    seq_len: int,
    heads: int,
    batch: int = 1,
    *,
    sinks: int = 30,
    window: int = 100,
    far_slashes: int = 1000,
    far_verticals: int = 1000,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """The §2.3 simulation pattern: int32 ``v_idx [b, heads, Vmax]``, ``s_idx [b, heads, Smax]``.

    Per (b, head): verticals 0…sinks−1 plus ``far_verticals`` distinct random columns in
    [sinks, N); slashes 0…window−1 plus ``far_slashes`` distinct random offsets in [window, N).
    Lists are ascending, padded with the sentinel N to a multiple of 64. Seeded and reproducible.
    """
    if sinks + far_verticals > seq_len or window + far_slashes > seq_len:
        raise ValueError(
            f"seq_len={seq_len} is too short for sinks={sinks} + far_verticals={far_verticals} "
            f"and window={window} + far_slashes={far_slashes}"
        )
    if min(sinks, window, far_slashes, far_verticals) < 0 or heads < 1 or batch < 1:
        raise ValueError("counts must be >= 0 and heads, batch >= 1")
    generator = torch.Generator().manual_seed(seed)

    def draw(forced: int, extra: int) -> Tensor:
        width = -(-max(forced + extra, 1) // 64) * 64
        out = torch.full((batch, heads, width), seq_len, dtype=torch.int32)
        for b in range(batch):
            for h in range(heads):
                far = torch.randperm(seq_len - forced, generator=generator)[:extra] + forced
                out[b, h, : forced + extra] = torch.cat([torch.arange(forced), far.sort().values])
        return out

    return draw(sinks, far_verticals), draw(window, far_slashes)
