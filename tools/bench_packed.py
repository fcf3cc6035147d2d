"""Single-GPU benchmark of packed documents (PACKED.md): our sparse packed attention against the dense
document-causal baselines, on the mixtures of ``document_mixtures.MIXTURES``.

Causal, one GPU, one sample of N tokens, bf16, ``[1, N, H, d]``. For every N and mixture it times, in one run:

* ``mtraining_packed`` — ``sparse_attention(..., backend="triton")`` on the per-document index: every document of
  at least ``--min-sparse-length`` tokens its own pattern, shorter ones dense. ``--pattern budget`` (default):
  ``document_mixtures.budget_document_index``, the attention benchmark's pattern at ``--sparsity`` (0.95, the
  headline budget) per document; ``--pattern realistic``: ``document_mixtures.realistic_document_index``, the
  §2.3 balance-simulation pattern (``--far-slashes`` random distant diagonals at N, so far denser in blocks:
  about 0.4 of the document-causal work at 512K);
* ``mtraining_packed_dense`` — our kernels with every document dense (the document-causal mask);
* ``flex_document_causal`` — ``torch.compile(flex_attention)`` on the same document-causal mask
  (``flex_peer.document_causal_block_mask``), the fastest dense document-causal kernel on this device (no
  flash-attn varlen here); its out/dq/dk/dv are cross-checked against ``mtraining_packed_dense`` before timing
  (relative RMSE ≤ ``FLEX_REL_RMSE``, else SystemExit);
* ``mtraining_unpacked`` — for the one-document mixture only: the same pattern through the unpacked path
  (``convert_index``), which the packed path should match within a few per cent;
* ``sdpa_cudnn`` — plain causal SDPA over the whole sequence (not the same mask: the cost of ignoring the
  documents), N ≤ ``--cudnn-max-len``.

``index_ms`` of the packed rows is the conversion (``convert_document_index`` with the by-key view) plus, for
``mtraining_packed``, the per-document estimation (``estimate_document_index`` with a static budget of the
pattern's sizes, on these random q/k); Flex's is its BlockMask construction. ``density`` is the listed ring
work over that of every document dense (``attention_stats.document_work_density``).

Writes one JSON object per (mixture, N, implementation) to ``--jsonl`` (appending) and a markdown table with
the speed-ups over Flex's document-causal kernel to ``--table``.
Example: ``python tools/bench_packed.py --seq-lens 131072 524288 --mixtures prolong uniform4k single``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
from bench_attention import FLEX_REL_RMSE, SHAPES, grads_of, measure, median_ms, profile_index, time_sdpa
from document_mixtures import MIXTURES, budget_document_index, realistic_document_index
from flex_peer import document_causal_block_mask, flex_forward, flex_fwd_bwd, heads_first
from provenance import git_commit
from torch.nn.attention import SDPBackend

from megatron_mtraining.attention_stats import document_work_density
from mtraining_kernels import Layout, convert_index, sparse_attention
from mtraining_kernels.budget import StaticBudget
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import DocumentIndex, estimate_document_index
from mtraining_kernels.documents import Documents

SINGLE = Layout("contiguous", 1)


def to_device(index: DocumentIndex, device: torch.device) -> DocumentIndex:
    documents = Documents(index.documents.starts.to(device), index.documents.seq_len)
    return DocumentIndex(documents, *(x.to(device) for x in (index.sparse, index.v_idx, index.s_idx)))


def ours(q, k, v, lists, backend: str):
    return lambda: sparse_attention(q, k, v, lists, backend=backend)


def relative_rmse(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def flex_check(q, k, v, dout, dense_lists, block_mask, scale: float, backend: str, title: str) -> dict:
    """Flex's document-causal out/dq/dk/dv against ours with every document dense: relative RMSE per tensor."""
    out = sparse_attention(q, k, v, dense_lists, softmax_scale=scale, backend=backend)
    mine = (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))
    theirs = flex_fwd_bwd(q, k, v, dout, block_mask, scale)
    errors = {name: relative_rmse(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), theirs, mine)}
    worst = max(errors, key=errors.get)
    if not errors[worst] <= FLEX_REL_RMSE:
        raise SystemExit(
            f"Flex cross-check failed, {title}: {worst} relative RMSE {errors[worst]:.3e} > {FLEX_REL_RMSE}"
        )
    return errors


def conversion_step(doc_index: DocumentIndex):
    """The conversion of ``doc_index`` to the single device's lists (the block lists by key included), as a call."""
    return lambda: convert_document_index(doc_index, SINGLE, 0)


def estimation_step(q, k, index: DocumentIndex, min_sparse_length: int):
    """The per-document estimation of a static budget as wide as the pattern's lists, on these q/k, as a call."""
    budget = StaticBudget(int(index.v_idx.shape[-1]), int(index.s_idx.shape[-1]))
    return lambda: estimate_document_index(q, k, index.documents, budget, min_sparse_length=min_sparse_length)


def document_pattern(documents: Documents, heads: int, args: argparse.Namespace, device) -> DocumentIndex:
    """The per-document index of ``--pattern`` (on the CPU)."""
    if args.pattern == "budget":
        return budget_document_index(
            documents,
            heads,
            sparsity=args.sparsity,
            min_sparse_length=args.min_sparse_length,
            seed=args.seed,
            device=device,
        )
    return realistic_document_index(
        documents,
        heads,
        min_sparse_length=args.min_sparse_length,
        far_slashes=args.far_slashes,
        far_verticals=args.far_verticals,
        seed=args.seed,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 524288])
    parser.add_argument("--mixtures", nargs="+", default=list(MIXTURES), choices=list(MIXTURES))
    parser.add_argument("--shape", default="qwen2.5-3b", choices=list(SHAPES))
    parser.add_argument("--min-sparse-length", type=int, default=4096)
    parser.add_argument("--pattern", default="budget", choices=("budget", "realistic"))
    parser.add_argument("--sparsity", type=float, default=0.95, help="budget pattern: each document's mask sparsity")
    parser.add_argument("--far-slashes", type=int, default=1000, help="§2.3 pattern: distant slashes at N tokens")
    parser.add_argument("--far-verticals", type=int, default=1000, help="§2.3 pattern: distant verticals at N")
    parser.add_argument("--cudnn-max-len", type=int, default=524288)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", default="docs/benchmarks/packed.jsonl")
    parser.add_argument("--table", default="docs/benchmarks/packed.md")
    parser.add_argument("--commit", default=None, help="recorded commit (default: the checkout's, +dirty if changed)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print the kernel times and host waits of each sparse mixture's index steps (torch.profiler)",
    )
    parser.add_argument("--report-only", action="store_true", help="rebuild --table from the latest run in --jsonl")
    parser.add_argument(
        "--backend",
        default="triton",
        choices=("triton", "torch_blocksparse"),
        help="our kernels (torch_blocksparse: the CPU smoke test of this script, timings meaningless)",
    )
    args = parser.parse_args(argv)
    if args.report_only:
        with open(args.jsonl) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        write_table([r for r in rows if r["date"] == rows[-1]["date"]], args.table)
        return
    if args.backend == "triton" and not torch.cuda.is_available():
        raise SystemExit("bench_packed.py needs a CUDA device (or --backend torch_blocksparse for a CPU smoke run)")

    device = torch.device("cuda" if args.backend == "triton" else "cpu")
    heads, kv_heads, dim = SHAPES[args.shape]
    scale = dim**-0.5
    base = {
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "commit": args.commit or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "shape": args.shape,
        "heads_q": heads,
        "heads_kv": kv_heads,
        "head_dim": dim,
        "min_sparse_length": args.min_sparse_length,
        "backend": args.backend,
        "pattern": args.pattern,
        **({"target_sparsity": args.sparsity} if args.pattern == "budget" else {}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
    rows = []

    def record(**fields) -> None:
        row = {**base, **fields}
        rows.append(row)
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{row['mixture']:9s} N={row['seq_len']:7d} {row['impl']:22s} density={row['density']:.4f} "
            f"fwd={row['fwd_ms']:9.2f} bwd={row['bwd_ms']:9.2f} index={row.get('index_ms', 0.0):7.2f} ms",
            flush=True,
        )

    for seq_len in args.seq_lens:
        gen = torch.Generator().manual_seed(args.seed)
        q, k, v, dout = (
            torch.randn(1, seq_len, h, dim, generator=gen).to(device, torch.bfloat16)
            for h in (heads, kv_heads, kv_heads, heads)
        )
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        inputs = (q, k, v)
        if seq_len <= args.cudnn_max_len and device.type == "cuda":
            fwd_ms, bwd_ms = time_sdpa(SDPBackend.CUDNN_ATTENTION, q.detach(), k.detach(), v.detach(), dout, 1, 2)
            for mixture in args.mixtures:
                record(mixture=mixture, seq_len=seq_len, impl="sdpa_cudnn", density=1.0, fwd_ms=fwd_ms, bwd_ms=bwd_ms)
        for mixture in args.mixtures:
            torch.cuda.empty_cache()
            documents = MIXTURES[mixture](seq_len, args.seed)
            index = to_device(document_pattern(documents, heads, args, device), device)
            common = dict(mixture=mixture, seq_len=seq_len, documents=int(documents.num_documents[0]))
            dense = DocumentIndex.dense(index.documents, index.num_heads)
            for impl, doc_index in (("mtraining_packed", index), ("mtraining_packed_dense", dense)):
                lists = convert_document_index(doc_index, SINGLE, 0)
                conversion = conversion_step(doc_index)
                convert = median_ms(conversion, 3)
                estimate = 0.0
                if doc_index is index:
                    estimation = estimation_step(q.detach(), k.detach(), index, args.min_sparse_length)
                    if args.profile:
                        steps = {"conversion": conversion, "per-document estimation": estimation}
                        profile_index(steps, f"{mixture} N={seq_len}, {common['documents']} documents")
                    estimate = median_ms(estimation, 3)
                forward = ours(q, k, v, lists, args.backend)
                fwd_ms, bwd_ms = measure(forward, grads_of(inputs, dout), args.warmup, args.reps)
                record(
                    impl=impl,
                    density=document_work_density(doc_index, SINGLE),
                    fwd_ms=fwd_ms,
                    bwd_ms=bwd_ms,
                    convert_ms=convert,
                    estimate_ms=estimate,
                    index_ms=convert + estimate,
                    **common,
                )
            block_mask = document_causal_block_mask(index.documents.doc_id)
            dense_lists = convert_document_index(dense, SINGLE, 0)
            check = flex_check(q, k, v, dout, dense_lists, block_mask, scale, args.backend, f"{mixture} N={seq_len}")
            mask_ms = median_ms(lambda: document_causal_block_mask(index.documents.doc_id), 3)
            qh, kh, vh = (heads_first(x).requires_grad_() for x in inputs)
            fwd_ms, bwd_ms = measure(
                lambda: flex_forward(qh, kh, vh, block_mask, scale),
                grads_of((qh, kh, vh), heads_first(dout)),
                args.warmup,
                args.reps,
            )
            record(
                impl="flex_document_causal",
                density=1.0,
                fwd_ms=fwd_ms,
                bwd_ms=bwd_ms,
                index_ms=mask_ms,
                flex_check=check,
                **common,
            )
            if mixture == "single":
                unpacked = convert_index(index.v_idx[:, 0], index.s_idx[:, 0], SINGLE, 0, seq_len)
                forward = ours(q, k, v, unpacked, args.backend)
                fwd_ms, bwd_ms = measure(forward, grads_of(inputs, dout), args.warmup, args.reps)
                record(
                    impl="mtraining_unpacked",
                    density=document_work_density(index, SINGLE),
                    fwd_ms=fwd_ms,
                    bwd_ms=bwd_ms,
                    **common,
                )
    write_table(rows, args.table)


def pattern_name(row: dict) -> str:
    """``budget 0.95`` or ``realistic`` (rows from before ``--pattern``: ``realistic``)."""
    if row.get("pattern", "realistic") == "budget":
        return f"budget {row['target_sparsity']:.2f}"
    return "realistic"


def write_table(rows: list[dict], path: str) -> None:
    """Markdown: per (mixture, N), every implementation's ms and its speed-up over Flex's document-causal kernel
    (and, for ``mtraining_packed`` on one document, its time over the unpacked path's)."""
    if not rows:
        return
    head = rows[0]
    lines = [
        f"GPU {head['gpu']}, torch {head['torch']}, commit {head['commit']}, {head['date']}; {head['shape']}, bf16, "
        f"one sample, documents of ≥ {head['min_sparse_length']} tokens sparse ({pattern_name(head)} pattern); ms are "
        "medians of CUDA-event timings.",
        "",
        "| mixture | N | documents | impl | density | fwd ms | bwd ms | fwd+bwd ms | index ms | × Flex document-causal "
        "(fwd/bwd/all) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peer = next(
            (
                r
                for r in rows
                if r["impl"] == "flex_document_causal"
                and r["mixture"] == row["mixture"]
                and r["seq_len"] == row["seq_len"]
            ),
            None,
        )
        ratio = "–"
        if peer and row is not peer:
            fwd, bwd = peer["fwd_ms"] / row["fwd_ms"], peer["bwd_ms"] / row["bwd_ms"]
            total = (peer["fwd_ms"] + peer["bwd_ms"]) / (row["fwd_ms"] + row["bwd_ms"])
            ratio = f"{fwd:.2f}/{bwd:.2f}/{total:.2f}"
        cells = [
            row["mixture"],
            row["seq_len"],
            row.get("documents", "–"),
            row["impl"],
            f"{row['density']:.4f}",
            f"{row['fwd_ms']:.2f}",
            f"{row['bwd_ms']:.2f}",
            f"{row['fwd_ms'] + row['bwd_ms']:.2f}",
            f"{row.get('index_ms', 0.0):.2f}",
            ratio,
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
