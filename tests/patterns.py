"""Random vertical-slash indices for tests (DESIGN.md §2.1 format: ascending, distinct, sentinel N)."""

from __future__ import annotations

import torch


def random_index(
    batch: int, heads: int, seq_len: int, n_vertical: int, n_slash: int, generator: torch.Generator, forced: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head random verticals/slashes; with ``forced`` the 30 sinks and offsets 0..99 (clipped to N)
    are included. Each head gets a random count up to the given widths, so sentinels appear too."""

    def draw(width: int, forced_values: range) -> torch.Tensor:
        rows = []
        for _ in range(batch * heads):
            count = int(torch.randint(0, width + 1, (1,), generator=generator))
            picked = torch.randperm(seq_len, generator=generator)[:count]
            if forced:
                picked = torch.cat([picked, torch.tensor(forced_values, dtype=torch.long)])
            values = picked.unique()  # sorted, distinct
            rows.append(values)
        width_out = max(1, max(len(r) for r in rows))
        out = torch.full((batch * heads, width_out), seq_len, dtype=torch.int32)
        for row, values in zip(out, rows):
            row[: len(values)] = values.to(torch.int32)
        return out.view(batch, heads, width_out)

    return (draw(n_vertical, range(min(30, seq_len))), draw(n_slash, range(min(100, seq_len))))
