"""Figures and a markdown summary from the quality study's run JSONs (written by train.py).

    python examples/quality/report.py results/*.json --out docs/benchmarks --baseline dense

Writes to ``--out``: ``quality_accuracy_heatmap.png`` (retrieval accuracy, length x needle depth, one panel
per run), ``quality_loss_curves.png`` (training LM loss and answer loss by step), ``quality_recall.png``
(per-head pattern recall by layer) and ``quality_summary.md`` (tables and the targets: accuracy within
1 point of the baseline at every evaluated length, LM loss within 2 %, per-layer recall >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

ACCURACY_TOLERANCE = 0.01  # 1 point
LOSS_TOLERANCE = 0.02  # 2 %
RECALL_TARGET = 0.9
LEARNED_ACCURACY = 0.2  # below this the baseline has not learned the retrieval


def load_runs(paths: list[Path]) -> list[dict]:
    runs = []
    for path in paths:
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        runs.extend(json.loads(file.read_text()) for file in files)
    if not runs:
        raise ValueError(f"no run JSON found in {[str(p) for p in paths]}")
    return runs


def length_label(seq_len: int) -> str:
    return f"{seq_len // 1024}K" if seq_len % 1024 == 0 else str(seq_len)


def label(run: dict) -> str:
    return run["run"] if run["attention"] == "dense" else f"{run['run']} (top-P {run['top_p']:g})"


def smooth(values: list[float], window: int) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    if len(values) < window or window < 2:
        return values
    kernel = np.ones(window) / window
    head = np.array([values[: i + 1].mean() for i in range(window - 1)])
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


# ------------------------------------------------------------------------------------------ figures
def plot_heatmaps(runs: list[dict], path: Path) -> None:
    evaluated = [run for run in runs if run.get("eval", {}).get("accuracy")]
    if not evaluated:
        return
    fig, axes = plt.subplots(1, len(evaluated), figsize=(4.2 * len(evaluated) + 1, 3.2), squeeze=False)
    image = None
    for axis, run in zip(axes[0], evaluated):
        evaluation = run["eval"]
        accuracy = np.array(evaluation["accuracy"]) * 100
        image = axis.imshow(accuracy, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="lower")
        axis.set_xticks(range(len(evaluation["depths"])), [f"{d:g}" for d in evaluation["depths"]], fontsize=7)
        axis.set_yticks(range(len(accuracy)), [length_label(n) for n in evaluation["lengths"][: len(accuracy)]])
        for (i, j), value in np.ndenumerate(accuracy):
            axis.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6)
        axis.set_xlabel("needle depth")
        axis.set_title(label(run), fontsize=9)
    axes[0][0].set_ylabel("context length")
    fig.colorbar(image, ax=axes[0].tolist(), label="retrieval accuracy (%)", shrink=0.9)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def plot_loss_curves(runs: list[dict], path: Path, window: int) -> None:
    fig, (lm_axis, answer_axis) = plt.subplots(1, 2, figsize=(11, 3.6))
    for run in runs:
        records = run["train"]
        if not records:
            continue
        steps = [r["step"] for r in records]
        lm_axis.plot(steps, smooth([r["lm_loss"] for r in records], window), label=label(run), linewidth=1)
        answer_axis.plot(steps, smooth([r["answer_loss"] for r in records], window), label=label(run), linewidth=1)
    boundaries = phase_boundaries(runs[0])
    for axis, title in ((lm_axis, "LM loss (all tokens)"), (answer_axis, "answer-token loss")):
        for step, seq_len in boundaries:
            axis.axvline(step, color="grey", linewidth=0.6, linestyle=":")
            axis.text(
                step,
                1.0,
                f" {length_label(seq_len)}",
                transform=axis.get_xaxis_transform(),
                fontsize=7,
                va="top",
                color="grey",
            )
        axis.set_xlabel("step")
        axis.set_title(f"{title}, moving average of {window} steps", fontsize=9)
        axis.legend(fontsize=8)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def phase_boundaries(run: dict) -> list[tuple[int, int]]:
    """(first step, seq_len) of every phase after the first, from the run's settings."""
    boundaries, step = [], 0
    for seq_len, _, steps, _ in run["settings"]["phases"]:
        if step:
            boundaries.append((step, seq_len))
        step += steps
    return boundaries


def recall_entries(run: dict) -> list[tuple[int, str, list[dict]]]:
    """(seq_len, setting name, per-layer entries) of a run's recall measurements."""
    return [
        (entry["seq_len"], name, layers)
        for entry in run.get("recall", [])
        for name, layers in entry["by_setting"].items()
    ]


def plot_recall(runs: list[dict], path: Path) -> None:
    panels = [(run, seq_len, name, layers) for run in runs for seq_len, name, layers in recall_entries(run)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False, sharey=True)
    lowest = min(value for _, _, _, layers in panels for entry in layers for value in entry["recall"])
    for axis, (run, seq_len, name, layers) in zip(axes[0], panels):
        for entry in layers:
            heads = entry["recall"]
            axis.scatter([entry["layer"]] * len(heads), heads, s=8, alpha=0.6, color="tab:blue")
            axis.scatter([entry["layer"]], [np.mean(heads)], marker="_", s=200, color="black")
        axis.axhline(RECALL_TARGET, color="tab:red", linewidth=0.8, linestyle="--")
        axis.set_xticks([entry["layer"] for entry in layers])
        axis.set_ylim(min(lowest, RECALL_TARGET) - 0.02, 1.005)
        axis.set_xlabel("layer")
        axis.set_title(f"{run['run']}: {name} @ {length_label(seq_len)}", fontsize=9)
    axes[0][0].set_ylabel("recall (softmax mass covered)")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------ summary
def mean_accuracy_by_length(run: dict) -> dict[int, float]:
    evaluation = run.get("eval", {})
    return {n: float(np.mean(row)) for n, row in zip(evaluation.get("lengths", []), evaluation.get("accuracy", []))}


def eval_losses(run: dict) -> dict[int, float]:
    evaluation = run.get("eval", {})
    return dict(zip(evaluation.get("lengths", []), evaluation.get("lm_loss", [])))


def paired_accuracy(run: dict, baseline: dict) -> dict[int, dict]:
    """Per length, the pair-by-pair comparison of two runs on the same evaluation sequences: the accuracy
    difference (points), its 95 % confidence half-width (normal approximation over the per-sequence
    differences, each −1, 0 or 1) and how many sequences only one of the two got right. Empty when a run
    has no per-sequence record or the runs saw different sequences."""
    mine, theirs = run.get("eval", {}), baseline.get("eval", {})
    if (
        "correct" not in mine
        or "correct" not in theirs
        or mine["depths"] != theirs["depths"]
        or mine["samples"] != theirs["samples"]
    ):
        return {}
    result = {}
    for seq_len, ours in zip(mine["lengths"], mine["correct"]):
        if seq_len not in theirs["lengths"]:
            continue
        base = theirs["correct"][theirs["lengths"].index(seq_len)]
        diff = np.asarray(ours, dtype=float).ravel() - np.asarray(base, dtype=float).ravel()
        half_width = 1.96 * diff.std(ddof=1) / math.sqrt(diff.size) if diff.size > 1 else float("inf")
        result[seq_len] = {
            "delta": diff.mean() * 100,
            "half_width": half_width * 100,
            "only_run": int((diff > 0).sum()),
            "only_baseline": int((diff < 0).sum()),
            "n": diff.size,
        }
    return result


def comparison_rows(runs: list[dict], baseline: dict | None, lengths: list[int], values_of, show, delta) -> list[str]:
    """One markdown row per run: ``show(value)`` per length, with ``(delta(value, baseline value))`` for
    runs other than the baseline; "n/a" where a run has no value."""
    base = values_of(baseline) if baseline else {}
    rows = []
    for run in runs:
        values = values_of(run)
        cells = []
        for n in lengths:
            if n not in values:
                cells.append("n/a")
            elif run is baseline or n not in base:
                cells.append(show(values[n]))
            else:
                cells.append(f"{show(values[n])} ({delta(values[n], base[n])})")
        rows.append(f"| {run['run']} | " + " | ".join(cells) + " |")
    return rows


def branch_note(runs: list[dict]) -> str:
    """How the runs relate: branched from one shared checkpoint (``train.py --resume``) or independent."""
    starts = {(run["resumed_from"]["path"], run["resumed_from"]["step"]) for run in runs if run.get("resumed_from")}
    if len(starts) == 1 and all(run.get("resumed_from") for run in runs):
        ((_, step),) = starts
        return (
            f" Every run continues from one shared checkpoint after {step} dense steps (the first phase), so "
            "the runs differ only from there on."
        )
    return " The runs are independent (same seed, data and initial weights)."


def summary(runs: list[dict], baseline_name: str, figures: dict[str, str]) -> str:
    baseline = next((run for run in runs if run["run"] == baseline_name), None)
    lines = ["## Quality: dense vs MTraining on synthetic long-context retrieval", ""]
    first = runs[0]
    s = first["settings"]
    lines += [
        f"Model: Megatron-Core GPTModel, Qwen2-shaped, {first['parameters'] / 1e6:.1f}M parameters "
        f"({s['layers']} layers, hidden {s['hidden']}, {s['heads']} query heads in {s['kv_heads']} KV groups of "
        f"dim {s['head_dim']}, SwiGLU {s['ffn']}, RoPE base {s['rope_base']:.0f}, vocabulary {s['vocab']}), "
        f"trained from scratch, CP = TP = 1, {first['precision']}." + branch_note(runs),
        f"Task (examples/quality/tasks.py): {s['pairs']} key→value needles ({s['key_len']}-token keys, "
        f"{s['value_len']}-token values, {s['value_choices']} choices per value token, "
        f"{'one shared value alphabet' if s['shared_values'] else 'key-specific value tokens'}) in synthetic "
        f"'{s['filler']}' filler text, {s['queries']} queries at the end; objective = mean loss over all tokens "
        f"+ {s['answer_weight']:g} x mean loss over answer tokens. Curriculum (length x batch x steps x "
        "needles): "
        + ", ".join(f"{n}x{b}x{k}x{p or s['pairs']}" for n, b, k, p in s["phases"])
        + f"; seed {s['seed']}, AdamW lr {s['lr']:g} (warm-up {s['warmup']}, cosine to "
        f"{s['min_lr_ratio']:g}x over the last {s['decay_fraction']:g} of the steps), clip "
        f"{s['clip_grad']:g}.",
        "",
    ]
    lines += [
        "| run | attention | kernel | steps | stopped early | train time (s) | final train LM loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        tail = [r["lm_loss"] for r in run["train"][-20:]]
        final = f"{np.mean(tail):.4f}" if tail else "n/a"
        attention = "dense" if run["attention"] == "dense" else f"MTraining top-P {run['top_p']:g}"
        lines.append(
            f"| {run['run']} | {attention} | {run['kernel']} | {run['steps_done']}/{run['steps_planned']} | "
            f"{'yes' if run['stopped_early'] else 'no'} | {run.get('timing_s', {}).get('train', 'n/a')} | "
            f"{final} |"
        )
    lines.append("")

    lengths = sorted({n for run in runs for n in mean_accuracy_by_length(run)})
    if lengths:
        samples = first.get("eval", {}).get("samples", 0) * len(first.get("eval", {}).get("depths", []))
        lines += [
            f"Retrieval accuracy (exact match of all value tokens), mean over needle depths ({samples} "
            "sequences per length; Δ vs baseline in points):",
            "",
            "| run | " + " | ".join(length_label(n) for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        lines += comparison_rows(
            runs,
            baseline,
            lengths,
            mean_accuracy_by_length,
            lambda value: f"{value * 100:.1f}",
            lambda value, base: f"{(value - base) * 100:+.1f}",
        )
        paired = {run["run"]: paired_accuracy(run, baseline) for run in runs if baseline and run is not baseline}
        if any(paired.values()):
            lines += [
                "",
                "Paired on the same sequences: Δ accuracy vs baseline in points, 95 % interval, and the "
                "sequences only the baseline / only this run answered:",
                "",
                "| run | " + " | ".join(length_label(n) for n in lengths) + " |",
                "|---|" + "---|" * len(lengths),
            ]
            for name, by_length in paired.items():
                cells = [
                    f"{c['delta']:+.1f} ({c['delta'] - c['half_width']:+.1f} … "
                    f"{c['delta'] + c['half_width']:+.1f}; "
                    f"{c['only_baseline']} / {c['only_run']})"
                    if (c := by_length.get(n))
                    else "n/a"
                    for n in lengths
                ]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Evaluation LM loss (all tokens; relative Δ vs baseline):",
            "",
            "| run | " + " | ".join(length_label(n) for n in lengths) + " |",
            "|---|" + "---|" * len(lengths),
        ]
        lines += comparison_rows(
            runs,
            baseline,
            lengths,
            eval_losses,
            lambda value: f"{value:.4f}",
            lambda value, base: f"{(value / base - 1) * 100:+.2f}%",
        )
        lines.append("")

    recall_rows = [(run, seq_len, name, layers) for run in runs for seq_len, name, layers in recall_entries(run)]
    if recall_rows:
        num_layers = max(len(layers) for _, _, _, layers in recall_rows)
        lines += [
            "Pattern recall: softmax mass of all queries inside the estimated pattern, per layer mean / min over "
            "heads; last columns: mask density (mean over layers and heads) and the distribution over all "
            "(layer, head) pairs.",
            "",
            "| run | pattern | length | "
            + " | ".join(f"L{i + 1}" for i in range(num_layers))
            + " | density | min / p10 / median |",
            "|---|---|---|" + "---|" * (num_layers + 2),
        ]
        for run, seq_len, name, layers in recall_rows:
            heads = np.array([value for entry in layers for value in entry["recall"]])
            density = np.mean([value for entry in layers for value in entry["density"]])
            cells = [f"{np.mean(e['recall']):.3f} / {min(e['recall']):.3f}" for e in layers]
            lines.append(
                f"| {run['run']} | {name} | {seq_len} | "
                + " | ".join(cells)
                + f" | {density:.3f} | {heads.min():.3f} / {np.percentile(heads, 10):.3f} / "
                f"{np.median(heads):.3f} |"
            )
        lines.append("")

    lines += ["Targets:", ""] + [f"- {line}" for line in target_checks(runs, baseline)] + [""]
    lines += [f"![{title}]({name})" for title, name in figures.items()]
    return "\n".join(lines) + "\n"


def target_checks(runs: list[dict], baseline: dict | None) -> list[str]:
    if baseline is None:
        return ["no baseline run: accuracy and loss targets not checked"]
    checks = []
    base_acc = mean_accuracy_by_length(baseline)
    if base_acc and max(base_acc.values()) < LEARNED_ACCURACY:
        checks.append(
            f"WARNING: {baseline['run']} reaches at most {max(base_acc.values()) * 100:.1f} % retrieval "
            f"accuracy (< {LEARNED_ACCURACY * 100:.0f} %): the model has not learned the task, so the "
            "accuracy comparison says nothing"
        )
    base_loss = eval_losses(baseline)
    trained = sorted({phase[0] for phase in baseline["settings"]["phases"]})
    for run in runs:
        if run is baseline:
            continue
        acc = mean_accuracy_by_length(run)
        loss = eval_losses(run)
        acc_gaps = {n: acc[n] - base_acc[n] for n in trained if n in acc and n in base_acc}
        loss_gaps = {n: loss[n] / base_loss[n] - 1 for n in trained if n in loss and n in base_loss}
        if acc_gaps:
            worst = min(acc_gaps, key=acc_gaps.get)
            ok = acc_gaps[worst] >= -ACCURACY_TOLERANCE
            interval = paired_accuracy(run, baseline).get(worst)
            detail = (
                f"; paired 95 % interval {interval['delta'] - interval['half_width']:+.1f} … "
                f"{interval['delta'] + interval['half_width']:+.1f}"
                if interval
                else ""
            )
            checks.append(
                f"{run['run']}: accuracy within 1 point of {baseline['run']} at every trained length: "
                f"{'PASS' if ok else 'FAIL'} (worst {acc_gaps[worst] * 100:+.1f} points at {worst}{detail})"
            )
        if loss_gaps:
            worst = max(loss_gaps, key=lambda n: abs(loss_gaps[n]))
            ok = all(abs(gap) <= LOSS_TOLERANCE for gap in loss_gaps.values())
            checks.append(
                f"{run['run']}: LM loss within 2% of {baseline['run']}: {'PASS' if ok else 'FAIL'} "
                f"(largest {loss_gaps[worst] * 100:+.2f}% at {worst})"
            )
    for run in runs:
        for seq_len, name, layers in recall_entries(run):
            means = [float(np.mean(e["recall"])) for e in layers]
            ok = min(means) >= RECALL_TARGET
            checks.append(
                f"{run['run']}: {name} recall >= {RECALL_TARGET} in every layer at {seq_len}: "
                f"{'PASS' if ok else 'FAIL'} (lowest layer mean {min(means):.3f})"
            )
    samples = baseline.get("eval", {}).get("samples", 0) * len(baseline.get("eval", {}).get("depths", []))
    if samples:
        checks.append(
            f"sampling error: one length's accuracy is a mean over {samples} sequences; its standard error "
            f"is at most {50 / math.sqrt(samples):.1f} points (at 50 % accuracy), "
            f"less near 0 or 100 %"
        )
    return checks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="run JSON files or folders holding them")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNGs and quality_summary.md")
    parser.add_argument("--baseline", default="dense", help="run name the others are compared with")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window of the loss curves (steps)")
    args = parser.parse_args(argv)
    runs = load_runs(args.results)
    runs.sort(key=lambda run: (run["attention"] != "dense", run.get("top_p") or 0, run["run"]))
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {
        "retrieval accuracy by length and depth": "quality_accuracy_heatmap.png",
        "loss curves": "quality_loss_curves.png",
        "pattern recall by layer": "quality_recall.png",
    }
    plot_heatmaps(runs, args.out / figures["retrieval accuracy by length and depth"])
    plot_loss_curves(runs, args.out / figures["loss curves"], args.smooth)
    plot_recall(runs, args.out / figures["pattern recall by layer"])
    text = summary(runs, args.baseline, {title: name for title, name in figures.items() if (args.out / name).exists()})
    (args.out / "quality_summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
