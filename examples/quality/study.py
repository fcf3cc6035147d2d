"""The quality study in resumable stages, every run one after another on one device.

    python examples/quality/study.py --stage A --out out/quality_long          # shared dense start
    python examples/quality/study.py --stage B --out out/quality_long          # the branches, 16K–64K
    python examples/quality/study.py --stage C --out out/quality_long --report-to docs/benchmarks

A *plan* (``PLANS`` by name, or a JSON file of the same keys) fixes the curriculum, the stages and the
runs. Stage A trains the run ``shared`` (dense) through the first stage's phases and writes
``<out>/shared.phase<K>.pt``; every later stage continues each run from its checkpoint of the stage
before (the first branch stage from the shared one): a middle stage ends with ``<out>/runs/<run>.phase<K>.pt``,
the last one evaluates the runs and writes the report (``report.py``: figures, ``<prefix>_summary.md`` and
``<prefix>.jsonl``) to ``--report-to``. A stage skips the runs it has already finished, so a stage that
was cut short resumes where it stopped when run again; ``--stage all`` runs every stage in turn. The
runs are calls of ``train.main`` in this process, with the plan's flags, the run's own flags and any
unknown flags of this command line (e.g. ``--device cuda:0``), in that order.

Plan keys: ``phases`` (``train.py --phases``), ``stages`` (the last phase of each stage, the last one
``len(phases)``), ``runs`` ({name: train.py flags}, e.g. ``["--attention", "mtraining", "--sparsity",
"0.95"]``), ``baseline`` (the run the others are compared with), ``flags`` (train.py flags for every run)
and ``prefix`` (of the report's file names).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report
import train

SHARED = "shared"
LONG_RECALL = ["--recall-top-p", "0.9,0.95", "--recall-sparsity", "0.95"]
PLANS = {
    # 64K–128K (issue #22): a dense start to 8K, five branches through 16K, 32K, 64K and 128K.
    "long": {
        "phases": "128x64x2400x8,512x16x400x8,2048x8x300,8192x2x150,16384x1x100,32768x1x80,65536x1x60,131072x1x40",
        "stages": [4, 7, 8],
        "runs": {
            "dense": ["--attention", "dense", *LONG_RECALL],
            "static0.95": ["--attention", "mtraining", "--sparsity", "0.95"],
            "topp0.9": ["--attention", "mtraining", "--top-p", "0.9"],
            "topp0.95": ["--attention", "mtraining", "--top-p", "0.95"],
            "schedule": ["--attention", "mtraining", "--sparsity", "0.8:16384,0.9:32768,0.95"],
        },
        "baseline": "dense",
        "flags": [
            "--eval-lengths",
            "16384,32768,65536,131072",
            "--eval-samples",
            "16,16,8,8",
            "--recall-lengths",
            "16384,32768,65536,131072",
            "--log-interval",
            "5",
        ],
        "prefix": "quality",
    },
    # The first study (2K–16K): branches after the 128-token phase, two dense kernels as the noise floor.
    "16k": {
        "phases": "128x64x2400x8,512x16x400x8,2048x8x300,8192x2x150,16384x1x150",
        "stages": [1, 5],
        "runs": {
            "dense": ["--attention", "dense"],
            "dense_triton": ["--attention", "dense", "--kernel", "triton"],
            "topp0.9": ["--attention", "mtraining", "--top-p", "0.9"],
            "topp0.95": ["--attention", "mtraining", "--top-p", "0.95"],
        },
        "baseline": "dense",
        "flags": [],
        "prefix": "quality_16k",
    },
}
PLAN_KEYS = {"phases", "stages", "runs", "baseline", "flags", "prefix"}


def load_plan(name_or_path: str) -> dict:
    """A plan by name or from a JSON file; ``ValueError`` when its keys or stages do not fit."""
    if name_or_path in PLANS:
        plan = PLANS[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ValueError(f"--plan {name_or_path!r} is neither a plan ({', '.join(PLANS)}) nor a JSON file")
        plan = json.loads(path.read_text())
    if set(plan) != PLAN_KEYS:
        raise ValueError(f"a plan has exactly the keys {sorted(PLAN_KEYS)}; got {sorted(plan)}")
    phases, stages = train.parse_phases(plan["phases"]), plan["stages"]
    if len(stages) < 2 or stages != sorted(set(stages)) or stages[0] < 1 or stages[-1] != len(phases):
        raise ValueError(
            f"stages {stages} must be ascending phase numbers, at least two, the last = {len(phases)} (the last phase)"
        )
    if plan["baseline"] not in plan["runs"] or SHARED in plan["runs"]:
        raise ValueError(
            f"the baseline {plan['baseline']!r} must be one of the runs, and no run may be named {SHARED!r}"
        )
    return plan


def stage_names(plan: dict) -> list[str]:
    return [chr(ord("A") + index) for index in range(len(plan["stages"]))]


def run_train(argv: list[str]) -> dict:
    """One train.main call; frees the model's memory afterwards (the next run builds its own)."""
    print(f"$ train.py {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    data = train.main(argv)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"[{data['run']}] {data['status']} after {time.perf_counter() - started:.0f} s in this stage", flush=True)
    return data


def run_stage(plan: dict, index: int, out: Path, runs: list[str], extra: list[str], report_to: Path | None) -> None:
    """Stage ``index`` (0 = the shared start) of ``plan`` for ``runs``; skips what is already done."""
    ends, phases = plan["stages"], ["--phases", plan["phases"]]
    common = [*phases, *plan["flags"]]
    shared_checkpoint = out / f"{SHARED}.phase{ends[0]}.pt"
    if index == 0:
        if shared_checkpoint.is_file():
            print(f"[{SHARED}] {shared_checkpoint} exists: stage A is done", flush=True)
            return
        shared = ["--run", SHARED, "--out", str(out), "--attention", "dense", "--stop-after-phase", str(ends[0])]
        run_train([*shared, *common, *extra])
        return
    last = index == len(ends) - 1
    for name in runs:
        results = out / "runs" / f"{name}.json"
        checkpoint = out / "runs" / f"{name}.phase{ends[index]}.pt"
        if (last and results.is_file() and json.loads(results.read_text())["status"] == "done") or (
            not last and checkpoint.is_file()
        ):
            print(f"[{name}] stage {stage_names(plan)[index]} is done", flush=True)
            continue
        source = shared_checkpoint if index == 1 else out / "runs" / f"{name}.phase{ends[index - 1]}.pt"
        if not source.is_file():
            raise SystemExit(
                f"[{name}] {source} is missing: run --stage {stage_names(plan)[index - 1]} first (with the same --out)"
            )
        argv = ["--run", name, "--out", str(out / "runs"), "--resume", str(source)]
        if not last:
            argv += ["--stop-after-phase", str(ends[index])]
        run_train([*argv, *plan["runs"][name], *common, *extra])
    if last and report_to is not None:
        report.main(
            [str(out / "runs"), "--out", str(report_to), "--baseline", plan["baseline"], "--prefix", plan["prefix"]]
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Unknown flags go to train.py.")
    parser.add_argument("--stage", required=True, help="a stage letter (A, B, …) or 'all'")
    parser.add_argument("--out", type=Path, required=True, help="folder of the checkpoints and run JSONs")
    parser.add_argument("--plan", default="long", help=f"{', '.join(PLANS)} or a JSON file (see the module help)")
    parser.add_argument("--runs", default=None, help="comma-separated subset of the plan's runs (default: all)")
    parser.add_argument(
        "--report-to", type=Path, default=None, help="folder of the report (default: <out>/figures); last stage only"
    )
    args, extra = parser.parse_known_args(argv)
    try:
        plan = load_plan(args.plan)
    except ValueError as error:
        parser.error(str(error))
    names = stage_names(plan)
    stage = args.stage.upper()
    if stage != "ALL" and stage not in names:
        parser.error(f"--stage {args.stage!r}: this plan has stages {', '.join(names)} (or all)")
    runs = list(plan["runs"]) if args.runs is None else args.runs.split(",")
    unknown = [name for name in runs if name not in plan["runs"]]
    if unknown:
        parser.error(f"--runs {unknown} are not runs of this plan: {', '.join(plan['runs'])}")
    report_to = args.report_to or args.out / "figures"
    for index in range(len(names)) if stage == "ALL" else [names.index(stage)]:
        started = time.perf_counter()
        run_stage(plan, index, args.out, runs, extra, report_to)
        print(f"stage {names[index]} took {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
