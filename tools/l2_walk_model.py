"""L2 reuse of the Hopper one-pass backward's walk over the block tiles, in a cache model (CPU, no GPU).

``gluon_bwd``'s one pass gives each program one 128-key block and some query heads of a GQA group; the program
walks its heads' key-major lists one after another, and each step reads one (query head, query block) tile: q and
dO, and adds into dq's fp32 rows (128 KB in all). The model runs the programs in launch order (grid (nb, Hkv·G/M),
key blocks fastest) on ``--multiprocessors`` slots, one program per slot, every busy slot taking one step per tick,
and counts the steps whose tile is among the ``--capacity`` tiles used last (LRU; an H100's 50 MB of L2 holds about
390 such tiles). It prints the hit rate for each ``--heads-per-program`` M on the real lists of a pattern
(``bench_attention``'s vertical-slash pattern at ``--sparsity``, a block-only pattern of the same area, that area as
consecutive block distances (``block_band``), or the dense mode's every causal block):

    python tools/l2_walk_model.py --pattern block_only --seq-len 131072 --heads-per-program 8 2

Steps are equal in time here, the bars are left out, and the k/v, lse and delta reads are not counted, so its rates
rank walks rather than predict Nsight Compute's (docs/benchmarks.md, session 35, compares the two and what fewer
heads per program bought).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Iterator

import torch
from bench_attention import budget_pattern
from flex_peer import same_area_pattern

from mtraining_kernels import Layout, convert_index
from mtraining_kernels.layout import BLOCK_SIZE
from mtraining_kernels.vertical_slash import full_index

PATTERNS = ("vertical_slash", "block_only", "block_band", "dense")


def hit_rate(walks: Iterator[list], slots: int, capacity: int) -> float:
    """Share of the steps whose tile was among the ``capacity`` used last, the ``walks`` (each a program's tiles
    in order) taken in turn by ``slots`` slots that each take one step per tick."""
    cache: OrderedDict = OrderedDict()
    hits = steps = 0
    running = [iter(walk) for walk in (next(walks, None) for _ in range(slots)) if walk is not None]
    while running:
        for slot, walk in enumerate(running):
            tile = next(walk, None)
            while tile is None:  # the program is done: the slot takes the next one
                follower = next(walks, None)
                if follower is None:
                    break
                walk = running[slot] = iter(follower)
                tile = next(walk, None)
            if tile is None:
                running[slot] = None
                continue
            steps += 1
            if tile in cache:
                hits += 1
                cache.move_to_end(tile)
            else:
                cache[tile] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
        running = [walk for walk in running if walk is not None]
    return hits / max(steps, 1)


def program_walks(key_ptr: torch.Tensor, key_qblock: torch.Tensor, kv_heads: int, members: int) -> Iterator[list]:
    """Each program's (query head, query block) tiles in launch order: key_ptr int32 ``[Hq, nb+1]`` and key_qblock
    (one sample's key-major lists), ``members`` query heads per program."""
    heads, num_blocks = key_ptr.shape[0], key_ptr.shape[1] - 1
    group = heads // kv_heads
    pointers, qblocks = key_ptr.tolist(), key_qblock.tolist()
    for part in range(heads // members):
        first_head = part // (group // members) * group + part % (group // members) * members
        for key_block in range(num_blocks):
            yield [
                (head, qblock)
                for head in range(first_head, first_head + members)
                for qblock in qblocks[pointers[head][key_block] : pointers[head][key_block + 1]]
            ]


def pattern_lists(pattern: str, seq_len: int, heads: int, sparsity: float, seed: int):
    """(key_ptr ``[Hq, nb+1]``, key_qblock) of one sample's ``pattern``."""
    generator = torch.Generator().manual_seed(seed)
    if pattern == "dense":
        v_idx, s_idx = full_index(1, heads, seq_len)
    else:
        v_idx, s_idx, _ = budget_pattern(1, heads, seq_len, sparsity, "cpu", generator)
        if pattern != "vertical_slash":
            v_idx, s_idx = same_area_pattern(pattern, v_idx, s_idx, seq_len, generator)
    key_lists = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, seq_len).key_lists(0)
    return key_lists.ptr[0], key_lists.qblock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pattern", default="block_only", choices=PATTERNS)
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--sparsity", type=float, default=0.95)
    parser.add_argument("--heads", type=int, default=16, help="query heads (Qwen2.5-3B: 16)")
    parser.add_argument("--kv-heads", type=int, default=2, help="KV heads (Qwen2.5-3B: 2)")
    parser.add_argument("--heads-per-program", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--capacity", type=int, default=350, help="tiles the cache holds")
    parser.add_argument("--multiprocessors", type=int, default=132, help="programs running at once")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.seq_len <= 0 or args.seq_len % BLOCK_SIZE:
        raise SystemExit(f"--seq-len {args.seq_len}: give a positive multiple of {BLOCK_SIZE}")
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} --kv-heads {args.kv_heads}: give query heads a multiple of KV heads")
    group = args.heads // args.kv_heads
    for members in args.heads_per_program:
        if members < 1 or group % members:
            raise SystemExit(f"--heads-per-program {members}: give divisors of the group size {group}")
    if args.capacity < 1 or args.multiprocessors < 1:
        raise SystemExit(f"--capacity {args.capacity} --multiprocessors {args.multiprocessors}: give at least 1")
    key_ptr, key_qblock = pattern_lists(args.pattern, args.seq_len, args.heads, args.sparsity, args.seed)
    print(f"{args.pattern} N={args.seq_len}, {args.capacity} tiles, {args.multiprocessors} programs at once")
    for members in args.heads_per_program:
        walks = program_walks(key_ptr, key_qblock, args.kv_heads, members)
        rate = hit_rate(walks, args.multiprocessors, args.capacity)
        print(f"  {members} heads per program: hit rate {rate:.3f}", flush=True)


if __name__ == "__main__":
    main()
