"""Figures, a markdown summary and a JSONL table from the quality study's run JSONs (written by train.py).

    python examples/quality/report.py out/quality_long/runs --out docs/benchmarks --baseline dense

Writes to ``--out``, with file names starting ``--prefix`` (``quality``): ``_accuracy_heatmap.png``
(retrieval accuracy, length x needle depth, one panel per run), ``_loss_curves.png`` (training LM and
answer loss by step), ``_density.png`` (per-layer attention density by training step), ``_recall.png``
(per-layer pattern recall at the end of each length's phase), ``_stage_time.png`` (training time per
length, the attention's share, the speed-up over the baseline), ``_summary.md`` (the tables, the
targets and a recommendation of a budget per length) and ``.jsonl``: one object per (run, evaluated
length) with ``run``, ``attention``, ``budget``, ``seq_len``, ``accuracy``, ``delta_vs_dense`` and its
paired 95 % interval ``delta_ci_low``/``delta_ci_high`` (fractions, against the baseline on the same
sequences), ``lm_loss``, ``density``, ``stage_train_s`` (the training time of the phase at that length)
and more (see :func:`quality_records`).
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
SPEEDUP_TARGET = 3.0  # at the longest trained length
LEARNED_ACCURACY = 0.2  # below this the baseline has not learned the retrieval
Z95 = 1.959963984540054


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
    return run["run"] if run["attention"] == "dense" else f"{run['run']} ({run['budget']})"


def smooth(values: list[float], window: int) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    if len(values) < window or window < 2:
        return values
    kernel = np.ones(window) / window
    head = np.array([values[: i + 1].mean() for i in range(window - 1)])
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])


# ------------------------------------------------------------------------------------------ numbers
def wilson(successes: int, n: int) -> tuple[float, float]:
    """Wilson score 95 % interval of a proportion."""
    p = successes / n
    denominator = 1 + Z95**2 / n
    centre = (p + Z95**2 / (2 * n)) / denominator
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denominator
    return centre - half, centre + half


def paired_difference(ours, theirs) -> dict:
    """Accuracy difference of two runs on the same sequences (0/1 each) with its 95 % interval.

    Newcombe's square-and-add interval for paired proportions (Statistics in Medicine 17, 1998): the Wilson
    intervals (l₁, u₁) of ours and (l₂, u₂) of theirs combined with the correlation φ of the 2 x 2 table
    (a both right, b only ours, c only theirs, d neither), φ = max(ad − bc − n/2, 0) / √((a+b)(c+d)(a+c)(b+d))
    when ad > bc, else (ad − bc) / √(…), 0 when a margin is empty: Δ − √((p₁−l₁)² − 2φ(p₁−l₁)(u₂−p₂) + (u₂−p₂)²)
    … Δ + √((u₁−p₁)² − 2φ(u₁−p₁)(p₂−l₂) + (p₂−l₂)²). Unlike a normal approximation it keeps a width when
    few sequences differ."""
    ours = np.asarray(ours, dtype=bool).ravel()
    theirs = np.asarray(theirs, dtype=bool).ravel()
    if ours.size != theirs.size or ours.size == 0:
        raise ValueError(f"paired results need the same, non-zero number of sequences: {ours.size} vs {theirs.size}")
    n = ours.size
    a, b = int((ours & theirs).sum()), int((ours & ~theirs).sum())
    c, d = int((~ours & theirs).sum()), n - int((ours | theirs).sum())
    p1, p2 = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = wilson(a + b, n), wilson(a + c, n)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    if margins == 0:
        phi = 0.0
    elif a * d > b * c:
        phi = max(a * d - b * c - n / 2, 0) / math.sqrt(margins)
    else:
        phi = (a * d - b * c) / math.sqrt(margins)
    delta = p1 - p2
    below = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    above = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    return {
        "delta": delta,
        "ci_low": delta - math.sqrt(max(below, 0.0)),
        "ci_high": delta + math.sqrt(max(above, 0.0)),
        "only_run": b,
        "only_baseline": c,
        "n": n,
    }


def flat_correct(run: dict) -> dict[int, list[int]]:
    """{length: every evaluated sequence's 0/1, depth by depth} of a run."""
    evaluation = run.get("eval", {})
    return {
        n: [x for by_depth in correct for x in by_depth]
        for n, correct in zip(evaluation.get("lengths", []), evaluation.get("correct", []))
    }


def sequence_source(run: dict) -> tuple:
    """What fixes a run's evaluation sequences besides length, depth and count: the seed, the task and the
    sequences per forward (``--eval-tokens``; the sequences of one forward come from one generator)."""
    settings = run.get("settings", {})
    return settings.get("seed"), run.get("task"), settings.get("eval_tokens")


def paired_accuracy(run: dict, baseline: dict) -> dict[int, dict]:
    """Per length, :func:`paired_difference` of ``run`` against ``baseline``; only lengths both evaluated on
    the same sequences (same :func:`sequence_source`, depths and samples per depth)."""
    mine, theirs = run.get("eval", {}), baseline.get("eval", {})
    if "correct" not in mine or "correct" not in theirs or mine["depths"] != theirs["depths"]:
        return {}
    if sequence_source(run) != sequence_source(baseline):
        return {}
    samples = {n: k for n, k in zip(theirs["lengths"], theirs["samples"])}
    ours, base = flat_correct(run), flat_correct(baseline)
    return {
        n: paired_difference(ours[n], base[n])
        for n, k in zip(mine["lengths"], mine["samples"])
        if n in ours and n in base and samples.get(n) == k
    }


def mean_accuracy_by_length(run: dict) -> dict[int, float]:
    return {n: float(np.mean(values)) for n, values in flat_correct(run).items()}


def eval_losses(run: dict) -> dict[int, float]:
    evaluation = run.get("eval", {})
    return dict(zip(evaluation.get("lengths", []), evaluation.get("lm_loss", [])))


def own_phases(run: dict) -> dict[int, dict]:
    """{seq_len: the last phase of that length this run trained itself} (the shared phases excluded)."""
    return {phase["seq_len"]: phase for phase in run.get("phases", []) if phase["run"] == run["run"]}


def recall_by_length(run: dict) -> dict[int, list[float]]:
    """{seq_len: per-layer mean recall over heads of the run's own budget} (MTraining runs)."""
    return {
        entry["seq_len"]: [float(np.mean(layer["recall"])) for layer in entry["by_setting"][entry["own"]]]
        for entry in run.get("recall", [])
        if entry.get("own")
    }


def run_status(pair: dict | None) -> str | None:
    """``worse`` (more than 1 point below, or the interval entirely below 0), ``better`` (the interval
    entirely above 0) or ``matches``; None without a paired comparison."""
    if pair is None:
        return None
    if pair["delta"] < -ACCURACY_TOLERANCE or pair["ci_high"] < 0:
        return "worse"
    return "better" if pair["ci_low"] > 0 else "matches"


def not_worse_everywhere(name: str, records: list[dict], baseline_name: str) -> bool:
    """Whether run ``name`` is not worse than the baseline (:func:`run_status`) at every length the baseline
    was evaluated at (a run missing one of them is not)."""
    lengths = {r["seq_len"] for r in records if r["run"] == baseline_name}
    mine = {r["seq_len"]: r["status"] for r in records if r["run"] == name and r["status"]}
    return bool(lengths) and all(mine.get(n) not in (None, "worse") for n in lengths)


def quality_records(runs: list[dict], baseline: dict | None) -> list[dict]:
    """One record per (run, evaluated length): accuracy and its paired comparison with the baseline (fractions),
    evaluation LM loss, the training phase at that length (time, attention time, steps, mean density over
    its logged steps and layers) and its speed-up over the baseline's phase, and the recall of the run's
    own budget at the end of that phase."""
    base_phases = own_phases(baseline) if baseline else {}
    records = []
    for run in runs:
        evaluation = run.get("eval")
        if not evaluation or not evaluation.get("correct"):
            continue
        pairs = paired_accuracy(run, baseline) if baseline and run is not baseline else {}
        phases, recall = own_phases(run), recall_by_length(run)
        for index, seq_len in enumerate(evaluation["lengths"][: len(evaluation["correct"])]):
            correct = flat_correct(run)[seq_len]
            phase, base_phase = phases.get(seq_len), base_phases.get(seq_len)
            pair = pairs.get(seq_len)
            if run is baseline:
                pair = {"delta": 0.0, "ci_low": 0.0, "ci_high": 0.0, "only_run": 0, "only_baseline": 0}
            density = phase["density"] if phase else None
            # a speed-up compares phases of the same steps (not a phase that a time budget cut short)
            comparable = phase and base_phase and phase["steps"] == base_phase["steps"] and phase["train_s"] > 0
            records.append(
                {
                    "run": run["run"],
                    "attention": run["attention"],
                    "budget": phase["budget"] if phase else run["budget"],
                    "budget_setting": run["budget"],
                    "kernel": run["kernel"],
                    "seq_len": seq_len,
                    "n_sequences": len(correct),
                    "accuracy": float(np.mean(correct)),
                    "baseline": baseline["run"] if baseline else None,
                    "delta_vs_dense": pair["delta"] if pair else None,
                    "delta_ci_low": pair["ci_low"] if pair else None,
                    "delta_ci_high": pair["ci_high"] if pair else None,
                    "only_run": pair["only_run"] if pair else None,
                    "only_dense": pair["only_baseline"] if pair else None,
                    "status": "baseline" if run is baseline else run_status(pair),
                    "lm_loss": evaluation["lm_loss"][index],
                    "answer_loss": evaluation["answer_loss"][index],
                    "density": float(np.mean(density)) if density else None,
                    "density_by_layer": density,
                    "stage_steps": phase["steps"] if phase else None,
                    "stage_train_s": phase["train_s"] if phase else None,
                    "attention_s": phase["attention_s"] if phase else None,
                    "attention_fwd_s": phase["attention_fwd_s"] if phase else None,
                    "attention_bwd_s": phase["attention_bwd_s"] if phase else None,
                    "speedup_vs_dense": base_phase["train_s"] / phase["train_s"] if comparable else None,
                    "attention_speedup_vs_dense": (
                        base_phase["attention_s"] / phase["attention_s"]
                        if comparable and phase["attention_s"] > 0
                        else None
                    ),
                    "recall_mean": float(np.mean(recall[seq_len])) if seq_len in recall else None,
                    "recall_min_layer": min(recall[seq_len]) if seq_len in recall else None,
                    "parameters": run["parameters"],
                    "device_name": run["device_name"],
                    "date": run.get("date"),
                    "stopped_early": run["stopped_early"],
                }
            )
    return records


# ------------------------------------------------------------------------------------------ figures
def branch_start(runs: list[dict]) -> int:
    """The first step that a run trained itself (0 when some run trained everything)."""
    firsts = [min((p["first_step"] for p in r.get("phases", []) if p["run"] == r["run"]), default=1) for r in runs]
    return min(firsts, default=1) - 1


def draw_phase_boundaries(axis, run: dict, first_step: int = 0) -> None:
    for phase in run.get("phases", []):
        if phase["first_step"] - 1 > first_step:
            axis.axvline(phase["first_step"] - 1, color="grey", linewidth=0.6, linestyle=":")
            axis.text(
                phase["first_step"] - 1,
                1.0,
                f" {length_label(phase['seq_len'])}",
                transform=axis.get_xaxis_transform(),
                fontsize=7,
                va="top",
                color="grey",
            )


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
    for axis, title in ((lm_axis, "LM loss (all tokens)"), (answer_axis, "answer-token loss")):
        draw_phase_boundaries(axis, runs[0])
        axis.set_xlabel("step")
        axis.set_title(f"{title}, moving average of {window} steps", fontsize=9)
        axis.legend(fontsize=8)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def plot_density(runs: list[dict], path: Path) -> None:
    """Per-layer attention density against the training step, one panel per MTraining run, from the step the
    runs branched."""
    sparse = [run for run in runs if run["attention"] == "mtraining" and any("density" in r for r in run["train"])]
    if not sparse:
        return
    first = branch_start(runs)
    fig, axes = plt.subplots(1, len(sparse), figsize=(3.6 * len(sparse), 3.2), squeeze=False, sharey=True)
    for axis, run in zip(axes[0], sparse):
        logged = [r for r in run["train"] if r.get("density") and r["step"] > first]
        layers = len(logged[0]["density"]) if logged else 0
        colours = plt.cm.viridis(np.linspace(0, 0.9, max(layers, 1)))
        for layer in range(layers):
            axis.plot(
                [r["step"] for r in logged],
                [r["density"][layer] for r in logged],
                color=colours[layer],
                linewidth=0.9,
                label=f"L{layer + 1}",
            )
        draw_phase_boundaries(axis, run, first)
        axis.set_yscale("log")
        axis.set_xlabel("step")
        axis.set_title(label(run), fontsize=9)
    axes[0][0].set_ylabel("attention density (mask / causal area)")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def recall_panels(runs: list[dict]) -> list[tuple[dict, str, list[tuple[int, list[dict]]]]]:
    """(run, pattern name, [(seq_len, per-layer entries)]) per panel: a MTraining run's own budget, or each
    pattern measured on a dense run."""
    panels = []
    for run in runs:
        entries = run.get("recall", [])
        if run["attention"] == "mtraining":
            measured = [(e["seq_len"], e["by_setting"][e["own"]]) for e in entries if e.get("own")]
            if measured:
                panels.append((run, "own budget", measured))
            continue
        for name in dict.fromkeys(name for e in entries for name in e["by_setting"]):
            measured = [(e["seq_len"], e["by_setting"][name]) for e in entries if name in e["by_setting"]]
            panels.append((run, name, measured))
    return panels


def plot_recall(runs: list[dict], path: Path) -> None:
    panels = recall_panels(runs)
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False, sharey=True)
    lowest = min(float(np.mean(layer["recall"])) for _, _, measured in panels for _, ls in measured for layer in ls)
    for axis, (run, name, measured) in zip(axes[0], panels):
        colours = plt.cm.plasma(np.linspace(0, 0.85, len(measured)))
        for colour, (seq_len, layers) in zip(colours, measured):
            numbers = [layer["layer"] for layer in layers]
            axis.plot(
                numbers,
                [np.mean(layer["recall"]) for layer in layers],
                marker="o",
                markersize=3,
                color=colour,
                linewidth=1,
                label=length_label(seq_len),
            )
            axis.scatter(numbers, [min(layer["recall"]) for layer in layers], marker="_", color=colour, s=30)
        axis.axhline(RECALL_TARGET, color="tab:red", linewidth=0.8, linestyle="--")
        axis.set_xticks([layer["layer"] for layer in measured[0][1]])
        axis.set_ylim(min(lowest, RECALL_TARGET) - 0.05, 1.005)
        axis.set_xlabel("layer")
        axis.set_title(f"{run['run']}: {name}", fontsize=9)
        axis.legend(fontsize=6, title="after phase", title_fontsize=6)
    axes[0][0].set_ylabel("recall (mean over heads; bars: min)")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def plot_stage_time(records: list[dict], path: Path) -> None:
    """Training time of each length's phase per run (hatched: inside the attention modules), speed-ups on top."""
    timed = [r for r in records if r["stage_train_s"]]
    if not timed:
        return
    lengths = sorted({r["seq_len"] for r in timed})
    names = list(dict.fromkeys(r["run"] for r in timed))
    width = 0.8 / len(names)
    fig, axis = plt.subplots(figsize=(1.8 * len(lengths) + 3, 3.6))
    for offset, name in enumerate(names):
        mine = {r["seq_len"]: r for r in timed if r["run"] == name}
        x = np.array([i + offset * width for i, n in enumerate(lengths) if n in mine])
        rows = [mine[n] for n in lengths if n in mine]
        bars = axis.bar(x, [r["stage_train_s"] for r in rows], width, label=name)
        axis.bar(x, [r["attention_s"] for r in rows], width, fill=False, hatch="///", edgecolor="black", linewidth=0)
        for bar, row in zip(bars, rows):
            if row["speedup_vs_dense"] and row["status"] != "baseline":
                axis.text(
                    bar.get_x() + width / 2,
                    bar.get_height(),
                    f"{row['speedup_vs_dense']:.1f}x",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
    axis.set_xticks(np.arange(len(lengths)) + 0.4 - width / 2, [length_label(n) for n in lengths])
    axis.set_xlabel("training phase (sequence length)")
    axis.set_ylabel("training time of the phase (s)")
    axis.set_title("phase training time (hatched: attention modules), speed-up over dense", fontsize=9)
    axis.legend(fontsize=7)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------ summary
def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def points(value: float) -> str:
    return f"{value * 100:+.1f}"


def branch_note(runs: list[dict]) -> str:
    """How the runs relate: branched from one shared checkpoint (``train.py --resume``) or independent."""
    starts = {
        (run["resumed_from"][0]["path"], run["resumed_from"][0]["step"]) if run.get("resumed_from") else None
        for run in runs
    }
    if len(starts) == 1 and None not in starts:
        ((_, step),) = starts
        return (
            f" Every run continues from one shared dense checkpoint after {step} steps, so the runs differ only "
            "from there on."
        )
    return " The runs are independent (same seed, data and initial weights)."


def recommendation(records: list[dict], baseline: dict | None) -> list[str]:
    """Per evaluated length, the fastest MTraining budget whose accuracy is not worse than the baseline's there
    (:func:`run_status`), and the fastest single run that is not worse at every length."""
    if baseline is None:
        return []
    lines = []
    sparse = [r for r in records if r["attention"] == "mtraining" and r["status"]]
    for seq_len in sorted({r["seq_len"] for r in sparse}):
        here = [r for r in sparse if r["seq_len"] == seq_len]
        good = [r for r in here if r["status"] != "worse"]
        speed = lambda r: r["speedup_vs_dense"] or 0.0  # noqa: E731
        if good:
            best = max(good, key=speed)
            speedup = f"{best['speedup_vs_dense']:.2f}x faster phase" if best["speedup_vs_dense"] else "no timing"
            lines.append(
                f"{length_label(seq_len)}: **{best['budget']}** ({best['run']}; {speedup}, Δ accuracy "
                f"{points(best['delta_vs_dense'])} points, {points(best['delta_ci_low'])} … "
                f"{points(best['delta_ci_high'])})"
            )
        else:
            closest = max(here, key=lambda r: r["delta_vs_dense"])
            lines.append(
                f"{length_label(seq_len)}: no budget matched {baseline['run']}; closest {closest['run']} "
                f"({points(closest['delta_vs_dense'])} points)"
            )
    by_run: dict[str, list[dict]] = {}
    for r in sparse:
        by_run.setdefault(r["run"], []).append(r)
    everywhere = [rows for name, rows in by_run.items() if not_worse_everywhere(name, records, baseline["run"])]
    if everywhere:
        longest = lambda rows: max(rows, key=lambda r: r["seq_len"])  # noqa: E731
        rows = max(everywhere, key=lambda rows: longest(rows)["speedup_vs_dense"] or 0.0)
        last = longest(rows)
        speedup = f"{last['speedup_vs_dense']:.2f}x" if last["speedup_vs_dense"] else "n/a"
        lines.append(
            f"one setting for every length: **{rows[0]['budget_setting']}** ({rows[0]['run']}), not worse than "
            f"{baseline['run']} at any evaluated length, its {length_label(last['seq_len'])} phase {speedup} faster"
        )
    else:
        lines.append(f"no single MTraining setting is within 1 point of {baseline['run']} at every evaluated length")
    return lines


def summary(runs: list[dict], baseline_name: str, figures: dict[str, str], records: list[dict]) -> str:
    baseline = next((run for run in runs if run["run"] == baseline_name), None)
    lines = ["## Quality: dense vs MTraining on synthetic long-context retrieval", ""]
    first = runs[0]
    s = first["settings"]
    lines += [
        f"Model: Megatron-Core GPTModel, Qwen2-shaped, {first['parameters'] / 1e6:.1f}M parameters "
        f"({s['layers']} layers, hidden {s['hidden']}, {s['heads']} query heads in {s['kv_heads']} KV groups of "
        f"dim {s['head_dim']}, SwiGLU {s['ffn']}, RoPE base {s['rope_base']:.0f}, vocabulary {s['vocab']}), "
        f"trained from scratch on {first['device_name']}, CP = TP = 1, {first['precision']}." + branch_note(runs),
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
    rows = []
    for run in runs:
        tail = [r["lm_loss"] for r in run["train"][-20:]]
        mine = own_phases(run).values()
        rows.append(
            [
                run["run"],
                run["attention"],
                run["budget"],
                run["kernel"],
                f"{run['steps_done']}/{run['steps_planned']}",
                "yes" if run["stopped_early"] else "no",
                f"{sum(p['train_s'] for p in mine):.1f}",
                f"{sum(run.get('eval', {}).get('seconds', [])):.1f}",
                f"{np.mean(tail):.4f}" if tail else "n/a",
            ]
        )
    lines += table(
        [
            "run",
            "attention",
            "budget",
            "kernel",
            "steps",
            "stopped early",
            "own training (s)",
            "evaluation (s)",
            "final train LM loss",
        ],
        rows,
    )
    lines.append("")

    by_run = {}
    for record in records:
        by_run.setdefault(record["run"], {})[record["seq_len"]] = record
    lengths = sorted({r["seq_len"] for r in records})
    names = [run["run"] for run in runs if run["run"] in by_run]

    def row_of(name, cell):
        return [name, *(cell(by_run[name][n]) if n in by_run[name] else "n/a" for n in lengths)]

    header = ["run", *(length_label(n) for n in lengths)]
    if lengths:
        lines += [
            "Training time of each length's phase (s; the sum of its steps, each CUDA-synchronised), of it inside "
            "the attention modules (CUDA events around their forward and backward, index estimation included), "
            "and the phase's speed-up over the baseline:",
            "",
        ]
        lines += table(
            header,
            [
                row_of(
                    name,
                    lambda r: (
                        "n/a"
                        if r["stage_train_s"] is None
                        else f"{r['stage_train_s']:.1f} (attn {r['attention_s']:.1f}"
                        + (
                            f", {r['speedup_vs_dense']:.2f}x"
                            if r["speedup_vs_dense"] and r["status"] != "baseline"
                            else ""
                        )
                        + ")"
                    ),
                )
                for name in names
            ],
        )
        counts = {n: by_run[baseline_name][n]["n_sequences"] for n in lengths if n in by_run.get(baseline_name, {})}
        lines += [
            "",
            "Retrieval accuracy (%, exact match of all value tokens, mean over needle depths; sequences per "
            "length: " + ", ".join(f"{length_label(n)} {k}" for n, k in counts.items()) + "):",
            "",
        ]
        lines += table(header, [row_of(name, lambda r: f"{r['accuracy'] * 100:.1f}") for name in names])
        lines += [
            "",
            f"Paired on the same sequences: Δ accuracy vs {baseline_name} in points, its 95 % interval (Newcombe's "
            "paired score interval), the sequences only the baseline / only this run answered, and the verdict "
            "(worse: more than 1 point below or the interval below 0):",
            "",
        ]
        lines += table(
            header,
            [
                row_of(
                    name,
                    lambda r: (
                        "n/a"
                        if r["delta_vs_dense"] is None
                        else f"{points(r['delta_vs_dense'])} ({points(r['delta_ci_low'])} … "
                        f"{points(r['delta_ci_high'])}; {r['only_dense']} / {r['only_run']}; {r['status']})"
                    ),
                )
                for name in names
                if name != baseline_name
            ],
        )
        base = by_run.get(baseline_name, {})
        lines += ["", "Evaluation LM loss (all tokens; relative Δ vs baseline):", ""]
        lines += table(
            header,
            [
                row_of(
                    name,
                    lambda r: (
                        f"{r['lm_loss']:.4f}"
                        + (
                            f" ({(r['lm_loss'] / base[r['seq_len']]['lm_loss'] - 1) * 100:+.2f}%)"
                            if r["run"] != baseline_name and r["seq_len"] in base
                            else ""
                        )
                    ),
                )
                for name in names
            ],
        )
        lines += [
            "",
            "Attention density during each length's phase (mean over logged steps and layers; min … max over layers):",
            "",
        ]
        lines += table(
            header,
            [
                row_of(
                    name,
                    lambda r: (
                        "n/a"
                        if r["density"] is None
                        else f"{r['density']:.3f} ({min(r['density_by_layer']):.3f} … {max(r['density_by_layer']):.3f})"
                    ),
                )
                for name in names
            ],
        )
        lines.append("")

    recall_rows = []
    for run in runs:
        for entry in run.get("recall", []):
            for name, layers in entry["by_setting"].items():
                heads = np.array([value for layer in layers for value in layer["recall"]])
                density = np.mean([value for layer in layers for value in layer["density"]])
                recall_rows.append(
                    [
                        run["run"],
                        name + (" (own)" if name == entry.get("own") else ""),
                        length_label(entry["seq_len"]),
                        str(entry["step"]),
                        *(f"{np.mean(layer['recall']):.3f} / {min(layer['recall']):.3f}" for layer in layers),
                        f"{density:.3f}",
                        f"{heads.min():.3f} / {np.percentile(heads, 10):.3f} / {np.median(heads):.3f}",
                    ]
                )
    if recall_rows:
        num_layers = len(recall_rows[0]) - 6
        lines += [
            "Pattern recall at the end of each length's phase: softmax mass of all queries inside the estimated "
            "pattern, per layer mean / min over heads; last columns: mask density (mean over layers and heads) and "
            "the distribution over all (layer, head) pairs.",
            "",
        ]
        lines += table(
            [
                "run",
                "pattern",
                "length",
                "step",
                *(f"L{i + 1}" for i in range(num_layers)),
                "density",
                "min / p10 / median",
            ],
            recall_rows,
        )
        lines.append("")

    lines += ["Targets:", ""] + [f"- {line}" for line in target_checks(runs, baseline, records)] + [""]
    advice = recommendation(records, baseline)
    if advice:
        lines += [
            "Recommendation (from these runs): the fastest budget that is not worse than dense, per length:",
            "",
        ]
        lines += [f"- {line}" for line in advice] + [""]
    lines += [f"![{title}]({name})" for title, name in figures.items()]
    return "\n".join(lines) + "\n"


def target_checks(runs: list[dict], baseline: dict | None, records: list[dict]) -> list[str]:
    if baseline is None:
        return ["no baseline run: accuracy, loss and speed targets not checked"]
    checks = []
    base_acc = mean_accuracy_by_length(baseline)
    if base_acc and max(base_acc.values()) < LEARNED_ACCURACY:
        checks.append(
            f"WARNING: {baseline['run']} reaches at most {max(base_acc.values()) * 100:.1f} % retrieval "
            f"accuracy (< {LEARNED_ACCURACY * 100:.0f} %): the model has not learned the task, so the "
            "accuracy comparison says nothing"
        )
    base_loss = eval_losses(baseline)
    longest = max((r["seq_len"] for r in records if r["stage_train_s"]), default=None)
    met = []  # MTraining runs that meet both the accuracy and the speed target
    for run in runs:
        if run is baseline:
            continue
        mine = [r for r in records if r["run"] == run["run"] and r["delta_vs_dense"] is not None]
        if mine:
            worst = min(mine, key=lambda r: r["delta_vs_dense"])
            ok = not_worse_everywhere(run["run"], records, baseline["run"])
            checks.append(
                f"{run['run']}: accuracy within 1 point of {baseline['run']} at every evaluated length (paired "
                f"95 % interval not below 0): {'PASS' if ok else 'FAIL'} (worst {points(worst['delta_vs_dense'])} "
                f"points at {length_label(worst['seq_len'])}, interval {points(worst['delta_ci_low'])} … "
                f"{points(worst['delta_ci_high'])})"
            )
        loss = eval_losses(run)
        loss_gaps = {n: loss[n] / base_loss[n] - 1 for n in loss if n in base_loss}
        if loss_gaps:
            worst_n = max(loss_gaps, key=lambda n: abs(loss_gaps[n]))
            ok = all(abs(gap) <= LOSS_TOLERANCE for gap in loss_gaps.values())
            checks.append(
                f"{run['run']}: LM loss within 2% of {baseline['run']}: {'PASS' if ok else 'FAIL'} "
                f"(largest {loss_gaps[worst_n] * 100:+.2f}% at {length_label(worst_n)})"
            )
        at_longest = next((r for r in mine if r["seq_len"] == longest and r["speedup_vs_dense"]), None)
        if at_longest:
            ok = at_longest["speedup_vs_dense"] >= SPEEDUP_TARGET
            checks.append(
                f"{run['run']}: the {length_label(longest)} phase trains >= {SPEEDUP_TARGET:g}x faster than "
                f"{baseline['run']}: {'PASS' if ok else 'FAIL'} ({at_longest['speedup_vs_dense']:.2f}x)"
            )
            if run["attention"] == "mtraining" and ok and not_worse_everywhere(run["run"], records, baseline["run"]):
                met.append(run["run"])
    if longest is not None:
        checks.append(
            f"target: one MTraining setting within 1 point of {baseline['run']} at every evaluated length whose "
            f"{length_label(longest)} phase trains >= {SPEEDUP_TARGET:g}x faster: "
            + (f"MET by {', '.join(met)}" if met else "NOT MET")
        )
    for run in runs:
        for seq_len, means in recall_by_length(run).items():
            checks.append(
                f"{run['run']}: own-budget recall >= {RECALL_TARGET} in every layer at {length_label(seq_len)}: "
                f"{'PASS' if min(means) >= RECALL_TARGET else 'FAIL'} (lowest layer mean {min(means):.3f})"
            )
    counts = {r["seq_len"]: r["n_sequences"] for r in records if r["run"] == baseline["run"]}
    if counts:
        checks.append(
            "sampling: "
            + ", ".join(
                f"{length_label(n)} {k} sequences (a paired interval about ±{100 * Z95 * math.sqrt(0.1 / k):.1f} "
                "points when 10 % of them differ)"
                for n, k in sorted(counts.items())
            )
        )
    return checks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="run JSON files or folders holding them")
    parser.add_argument("--out", type=Path, required=True, help="folder of the figures, the summary and the JSONL")
    parser.add_argument("--baseline", default="dense", help="run name the others are compared with")
    parser.add_argument("--prefix", default="quality", help="start of the output file names")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window of the loss curves (steps)")
    args = parser.parse_args(argv)
    runs = load_runs(args.results)
    runs.sort(key=lambda run: (run["run"] != args.baseline, run["attention"] != "dense", run["run"]))
    baseline = next((run for run in runs if run["run"] == args.baseline), None)
    records = quality_records(runs, baseline)
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {
        "retrieval accuracy by length and depth": f"{args.prefix}_accuracy_heatmap.png",
        "loss curves": f"{args.prefix}_loss_curves.png",
        "attention density by step": f"{args.prefix}_density.png",
        "pattern recall by layer": f"{args.prefix}_recall.png",
        "training time per phase": f"{args.prefix}_stage_time.png",
    }
    plot_heatmaps(runs, args.out / figures["retrieval accuracy by length and depth"])
    plot_loss_curves(runs, args.out / figures["loss curves"], args.smooth)
    plot_density(runs, args.out / figures["attention density by step"])
    plot_recall(runs, args.out / figures["pattern recall by layer"])
    plot_stage_time(records, args.out / figures["training time per phase"])
    shown = {title: name for title, name in figures.items() if (args.out / name).exists()}
    text = summary(runs, args.baseline, shown, records)
    (args.out / f"{args.prefix}_summary.md").write_text(text)
    with open(args.out / f"{args.prefix}.jsonl", "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    print(text)


if __name__ == "__main__":
    main()
