"""A few forward + backward steps of one attention implementation, for a profiler to attach to (Nsight Compute).

Implementations, on the Qwen2.5-3B shape in bf16 with ``bench_attention.py``'s inputs:

* ``ours`` — our Triton sparse attention on the ``--pattern`` (``vertical_slash``: the fixed-budget pattern at
  ``--sparsity``; ``block_only``: a block-only pattern of the same mask area, ``flex_peer.block_only_pattern``;
  ``block_band``: that area as consecutive block distances, ``flex_peer.block_band_pattern``, the same work with
  the best L2 locality);
* ``flex`` — compiled FlexAttention on the block-only BlockMask of that pattern (vertical-slash is not offered:
  Flex's partial blocks make it another kernel's profile);
* ``cudnn`` — cuDNN's causal SDPA (dense, so at a quarter to a sixteenth of the sparse N for the same work).

Nothing is timed here: ``ncu`` replays the kernels it selects. The device has Nsight Compute at
``/usr/local/cuda/bin/ncu``; e.g., our block one pass's second launch with the stall reasons:
``ncu -k regex:one_pass_backward_kernel -s 1 -c 1 --section SpeedOfLight --metrics
regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio python tools/profile_step.py ours --pattern
block_only --seq-len 131072`` (docs/benchmarks.md, session 25, lists the kernels' names and what was read).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_attention import SHAPES, budget_pattern
from flex_peer import block_only_block_mask, flex_fwd_bwd, same_area_pattern
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtraining_kernels import Layout, convert_index, sparse_attention
from mtraining_kernels.layout import BLOCK_SIZE

IMPLEMENTATIONS = ("ours", "flex", "cudnn")
PATTERNS = ("vertical_slash", "block_only", "block_band")


def check_step_arguments(args: argparse.Namespace, count: str, tool: str) -> None:
    """Refuse what cannot run, naming the value, before any work: ``--seq-len``, the repetitions ``--{count}``,
    Flex's pattern, and a CUDA device for ``tool`` (``trace_steps.py`` shares these)."""
    if args.seq_len <= 0 or args.seq_len % BLOCK_SIZE:
        raise SystemExit(f"--seq-len {args.seq_len}: give a positive multiple of {BLOCK_SIZE}")
    if getattr(args, count) < 1:
        raise SystemExit(f"--{count} {getattr(args, count)}: give at least 1")
    if args.impl == "flex" and args.pattern == "vertical_slash":
        raise SystemExit(f"--impl flex --pattern {args.pattern}: Flex runs on the block patterns only")
    if not torch.cuda.is_available():
        raise SystemExit(f"{tool} needs a CUDA device")


def sparse_pattern(args, heads: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_idx, s_idx) of ``args.pattern`` for one sample."""
    generator = torch.Generator().manual_seed(args.seed)
    v_idx, s_idx, _ = budget_pattern(1, heads, args.seq_len, args.sparsity, device, generator)
    if args.pattern == "vertical_slash":
        return v_idx, s_idx
    return same_area_pattern(args.pattern, v_idx, s_idx, args.seq_len, torch.Generator().manual_seed(args.seed))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("impl", choices=IMPLEMENTATIONS)
    parser.add_argument("--pattern", default="block_only", choices=PATTERNS)
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--sparsity", type=float, default=0.95)
    parser.add_argument("--steps", type=int, default=2, help="forward + backward steps (the first compiles)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_step_arguments(args, "steps", "profile_step.py")
    heads, kv_heads, dim = SHAPES["qwen2.5-3b"]
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(args.seed)
    if args.impl == "cudnn":
        q, k, v, dout = (torch.randn(1, heads, args.seq_len, dim, generator=generator) for _ in range(4))
    else:
        q, k, v, dout = (
            torch.randn(1, args.seq_len, h, dim, generator=generator) for h in (heads, kv_heads, kv_heads, heads)
        )
    q, k, v, dout = (t.to(device, torch.bfloat16) for t in (q, k, v, dout))
    if args.impl == "flex":
        mask = block_only_block_mask(sparse_pattern(args, heads, device)[1], args.seq_len)
        for _ in range(args.steps):
            flex_fwd_bwd(q, k, v, dout, mask, dim**-0.5)
    else:
        for t in (q, k, v):
            t.requires_grad_()
        if args.impl == "ours":
            index = convert_index(*sparse_pattern(args, heads, device), Layout("contiguous", 1), 0, args.seq_len)

            def forward():
                return sparse_attention(q, k, v, index, backend="triton")
        else:

            def forward():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        for _ in range(args.steps):
            torch.autograd.grad(forward(), (q, k, v), dout)
    torch.cuda.synchronize()
    print(f"{args.impl} N={args.seq_len}: {args.steps} steps done")


if __name__ == "__main__":
    main()
