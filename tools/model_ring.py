"""Evaluate the analytic ring model (tools/ring_model.py): flat vs hierarchical sparse ring.

For each N and each way to write W = O·L (O nodes of L GPUs), one attention layer's forward + backward
time on the flat ring (paced by its inter-node hops) and on the hierarchical ring, from a measured
compute rate and measured intra-node bandwidth, with the inter-node link ``--slowdown`` times slower:

    python tools/model_ring.py --worlds 4 8 --seq-lens 262144 524288 1048576 --slowdown 10

Defaults are the measurements of docs/benchmarks.md: 270 TFLOP/s of actually computed sparse work, 338
GB/s one way over NVLink; Qwen2.5-3B attention (16 / 2 heads, d = 128), 5 % density, bf16 K/V, fp32
gradient wire. Prints a markdown table; "saving" is the hierarchical ring's time less than the flat one's.
"""

from __future__ import annotations

import argparse

from ring_model import attention_cell_costs, flat_ring, hierarchical_ring


def factorizations(world: int) -> list[tuple[int, int]]:
    """(inner L, outer O) with L·O = world and both ≥ 2."""
    return [(inner, world // inner) for inner in range(2, world) if world % inner == 0]


def model_rows(options: argparse.Namespace) -> list[dict]:
    rows = []
    for world in options.worlds:
        for seq_len in options.seq_lens:
            for inner, outer in factorizations(world):
                costs = attention_cell_costs(
                    seq_len,
                    world,
                    options.heads,
                    options.kv_heads,
                    options.head_dim,
                    options.density,
                    options.tflops,
                    options.inner_gbps * 1e9,
                    options.inner_gbps * 1e9 / options.slowdown,
                    latency_s=options.latency_us * 1e-6,
                )
                flat, hierarchical = flat_ring(costs, world, inner), hierarchical_ring(costs, inner, outer)
                rows.append(
                    {
                        "world": world,
                        "seq_len": seq_len,
                        "inner": inner,
                        "outer": outer,
                        "compute_ms": world * (costs.compute_fwd_s + costs.compute_bwd_s) * 1e3,
                        "flat_ms": flat.total_s * 1e3,
                        "hierarchical_ms": hierarchical.total_s * 1e3,
                        "saving": 1 - hierarchical.total_s / flat.total_s,
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.05, help="computed fraction of the causal area")
    parser.add_argument("--tflops", type=float, default=270.0, help="actually computed TFLOP/s of the sparse kernels")
    parser.add_argument("--inner-gbps", type=float, default=338.0, help="intra-node bandwidth, GB/s one way")
    parser.add_argument("--slowdown", type=float, default=10.0, help="inter-node link this many times slower")
    parser.add_argument("--latency-us", type=float, default=0.0, help="per-message latency")
    options = parser.parse_args(argv)
    for name in ("density", "tflops", "inner_gbps", "slowdown"):
        if not getattr(options, name) > 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(options, name)} must be > 0")
    rows = model_rows(options)
    if not rows:
        parser.error(f"--worlds {options.worlds}: no world size has an inner x outer split with both >= 2")
    print(
        "| W | N | nodes x GPUs | compute ms | flat ring ms | hierarchical ms | saving |\n|---|---|---|---|---|---|---|"
    )
    for row in rows:
        print(
            f"| {row['world']} | {row['seq_len'] // 1024}K | {row['outer']} x {row['inner']} | "
            f"{row['compute_ms']:.2f} | {row['flat_ms']:.2f} | {row['hierarchical_ms']:.2f} | {row['saving']:.0%} |"
        )
    return rows


if __name__ == "__main__":
    main()
