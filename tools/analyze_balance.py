"""Ring load balance of the contiguous, zigzag, striped and skewed layouts for a realistic sparse pattern.

Prints worker-level and step-level max/mean cost and the ring critical path over the ideal
(DESIGN.md §2.3), and draws one rank × step cost heatmap per layout into a PNG::

    python tools/analyze_balance.py --seq-len 524288 --world-size 32 --heads 16 --out balance.png

With ``--mixture`` the sequence is a packed document mixture (PACKED.md) with the realistic pattern
per document, counted by the §2.7 conversion rule::

    python tools/analyze_balance.py --seq-len 524288 --world-size 32 --heads 16 --mixture prolong

``--document-orders K`` also packs the same documents in K random orders (each document keeping its own
pattern) and prints the best, median and worst of each layout: how much of the imbalance is where the
documents land, which a layout that knows the documents could choose.

With ``--mixture`` the table also has ``skewed planned``: the skewed layout with turns planned from the document
lengths and the far counts alone (``megatron_mtraining.turn_plan``), never from the pattern it is scored on.
"""

from __future__ import annotations

import argparse

import torch
from document_mixtures import MIXTURES, realistic_document_index, reorder_documents
from realistic_pattern import realistic_pattern

from megatron_mtraining.balance import BalanceReport, balance_report, document_balance_report
from megatron_mtraining.turn_plan import plan_turns
from mtraining_kernels.layout import BLOCK_SIZE, LAYOUT_KINDS, Layout


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=512 * 1024, help="global sequence length N")
    parser.add_argument("--world-size", type=int, default=32, help="context-parallel size W")
    parser.add_argument("--heads", type=int, default=16, help="query heads, each with its own random pattern")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random pattern")
    parser.add_argument("--granularity", type=int, default=128, help="striped layout stripe length")
    parser.add_argument("--far-slashes", type=int, default=1000, help="random slashes beyond the window")
    parser.add_argument("--far-verticals", type=int, default=1000, help="random verticals beyond the sinks")
    parser.add_argument(
        "--mixture",
        choices=("none", "prolong", "uniform4k", "single"),
        default="none",
        help="packed documents: none (one unpacked sequence), prolong (half the tokens from documents >= 64K, the "
        "rest 1K-32K), uniform4k (all 4K documents) or single (one document, counted as packed)",
    )
    parser.add_argument(
        "--min-sparse-length",
        type=int,
        default=4096,
        help="documents shorter than this are dense (default 4096 for this analysis); with --mixture only",
    )
    parser.add_argument(
        "--document-orders",
        type=int,
        default=0,
        help="with --mixture: also pack the documents in this many random orders (seeded) and summarise",
    )
    parser.add_argument("--out", default=None, help="PNG path for the rank × step heatmaps (none: no plot)")
    return parser.parse_args(argv)


def format_table(reports: dict[str, BalanceReport]) -> str:
    lines = [f"{'layout':<16}{'worker max/mean':>17}{'step max/mean':>15}{'critical path/ideal':>21}"]
    for kind, report in reports.items():
        lines.append(
            f"{kind:<16}{report.worker_imbalance:>17.4f}{report.step_imbalance:>15.4f}"
            f"{report.critical_path_ratio:>21.4f}"
        )
    return "\n".join(lines)


def plot_heatmaps(reports: dict[str, BalanceReport], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 4.4), constrained_layout=True)
    top = max(float(report.cost.max()) for report in reports.values())
    for axis, (kind, report) in zip(axes, reports.items()):
        image = axis.imshow(report.cost.numpy(), cmap="viridis", vmin=0, vmax=top, aspect="auto")
        axis.set_title(f"{kind}\nworker {report.worker_imbalance:.3f}, critical path {report.critical_path_ratio:.3f}")
        axis.set_xlabel("ring step t")
        axis.set_ylabel("query rank r")
    fig.colorbar(image, ax=axes, label="cost (blocks + bars/128)")
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mixture_index(args: argparse.Namespace):
    """The ``--mixture`` documents of ``--seed`` and their realistic per-document index."""
    documents = MIXTURES[args.mixture](args.seq_len, args.seed)
    doc_index = realistic_document_index(
        documents,
        args.heads,
        min_sparse_length=args.min_sparse_length,
        far_slashes=args.far_slashes,
        far_verticals=args.far_verticals,
        seed=args.seed,
    )
    return documents, doc_index


def planned_skewed_layout(args: argparse.Namespace, documents) -> Layout:
    """The skewed layout with turns planned for ``documents``, each document's far counts as
    ``realistic_document_index`` draws them (round(far · L / N))."""
    lengths = documents.lengths
    far_verticals = (args.far_verticals * lengths / args.seq_len).round().long()
    far_slashes = (args.far_slashes * lengths / args.seq_len).round().long()
    turns = plan_turns(
        documents,
        args.world_size,
        far_verticals=far_verticals,
        far_slashes=far_slashes,
        min_sparse_length=args.min_sparse_length,
    )
    return Layout("skewed", args.world_size, turns=turns)


def reports_and_title(args: argparse.Namespace) -> tuple[dict[str, BalanceReport], str]:
    """One report per layout kind, and the title naming the pattern (and the mixture)."""
    names = {kind: f"{kind} g={args.granularity}" for kind in ("striped", "skewed")}
    layouts = {names.get(kind, kind): Layout(kind, args.world_size, args.granularity) for kind in LAYOUT_KINDS}
    title = (
        f"N={args.seq_len}, W={args.world_size}, heads={args.heads}, seed={args.seed}, "
        f"{args.far_slashes} far slashes, {args.far_verticals} far verticals"
    )
    if args.mixture == "none":
        v_idx, s_idx = realistic_pattern(
            args.seq_len, args.heads, far_slashes=args.far_slashes, far_verticals=args.far_verticals, seed=args.seed
        )
        return {name: balance_report(v_idx, s_idx, layout, args.seq_len) for name, layout in layouts.items()}, title
    documents, doc_index = mixture_index(args)
    sparse_tokens = int(documents.lengths[doc_index.sparse].sum())
    title += (
        f" (per N), mixture {args.mixture}: {int(documents.num_documents.sum())} documents, "
        f"{int(doc_index.sparse.sum())} sparse (>= {args.min_sparse_length} tokens, {sparse_tokens} tokens)"
    )
    if args.granularity == BLOCK_SIZE:
        layouts["skewed planned"] = planned_skewed_layout(args, documents)
    return {name: document_balance_report(doc_index, layout) for name, layout in layouts.items()}, title


def document_order_spread(args: argparse.Namespace) -> str:
    """Best / median / worst worker, step and critical-path ratios of the striped and skewed layouts over
    ``--document-orders`` random orders of sample 0's documents, patterns fixed per document."""
    documents, doc_index = mixture_index(args)
    count = int(documents.num_documents[0])
    generator = torch.Generator().manual_seed(args.seed)
    orders = [torch.randperm(count, generator=generator).tolist() for _ in range(args.document_orders)]
    lines = [f"{args.document_orders} random orders of the {count} documents: best / median / worst"]
    for kind in ("striped", "skewed"):
        layout = Layout(kind, args.world_size, args.granularity)
        reports = [document_balance_report(reorder_documents(doc_index, 0, order), layout) for order in orders]
        for metric in ("worker_imbalance", "step_imbalance", "critical_path_ratio"):
            values = sorted(getattr(report, metric) for report in reports)
            best, median, worst = values[0], values[len(values) // 2], values[-1]
            lines.append(f"{kind:<8}{metric:<21}{best:.4f} / {median:.4f} / {worst:.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    reports, title = reports_and_title(args)
    print(title)
    print(format_table(reports))
    if args.document_orders:
        if args.mixture == "none":
            raise SystemExit("--document-orders needs --mixture (the documents to reorder)")
        print(document_order_spread(args))
    if args.out:
        plot_heatmaps(reports, title, args.out)
        print(f"heatmaps written to {args.out}")


if __name__ == "__main__":
    main()
