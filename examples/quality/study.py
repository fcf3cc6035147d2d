"""The quality study in resumable stages, every run one after another on one device.

    export PYTHONPATH=$PWD:$PWD/kernels                                          # from the repository root
    python examples/quality/study.py --stage all --check --out out/quality_long  # every run's checks, no training
    python examples/quality/study.py --stage A --out out/quality_long            # shared dense start
    python examples/quality/study.py --stage B --out out/quality_long            # the branches, 16K–64K
    python examples/quality/study.py --stage C --out out/quality_long --report-to docs/benchmarks

A *plan* (``PLANS`` by name, or a JSON file of the same keys) fixes the curriculum, the stages and the
runs. Stage A trains the run ``shared`` (dense) through the first stage's phases and writes
``<out>/shared.phase<K>.pt``; every later stage continues each run from its checkpoint of the stage
before (the first branch stage from the shared one): a middle stage ends with ``<out>/runs/<run>.phase<K>.pt``,
the last one evaluates the runs and writes the report (``report.py``: figures, ``<prefix>_summary.md`` and
``<prefix>.jsonl``) to ``--report-to``. A stage skips the runs it has already finished, so a stage that
was cut short resumes at the run it stopped in when run again (that run starts the stage again from its
checkpoint); ``--stage all`` runs every stage in turn, ``--check`` only checks them. The runs are calls
of ``train.main`` in this process, with the plan's flags, the run's own flags and any unknown flags of
this command line (e.g. ``--device cuda:0``), in that order.

Plan keys: ``phases`` (``train.py --phases``), ``stages`` (the last phase of each stage, the last one
``len(phases)``), ``runs`` ({name: train.py flags}, e.g. ``["--attention", "mtraining", "--sparsity",
"0.95"]``), ``baseline`` (the run the others are compared with), ``flags`` (train.py flags for every run)
and ``prefix`` (of the report's file names).
"""

from __future__ import annotations

import argparse
import dataclasses
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
LONG_PHASES = "128x64x2400x8,512x16x400x8,2048x8x300,8192x2x150,16384x1x100,32768x1x80,65536x1x60,131072x1x40"
LONG_FLAGS = [
    "--eval-lengths",
    "16384,32768,65536,131072",
    "--eval-samples",
    "16,16,8,8",
    "--recall-lengths",
    "16384,32768,65536,131072",
    "--log-interval",
    "5",
]
DENSE_LONG = ["--attention", "dense", *LONG_RECALL]
TOP_P_09 = ["--attention", "mtraining", "--top-p", "0.9"]
PLANS = {
    # 64K–128K: a dense start to 8K, five branches through 16K, 32K, 64K and 128K.
    "long": {
        "phases": LONG_PHASES,
        "stages": [4, 7, 8],
        "runs": {
            "dense": DENSE_LONG,
            "static0.95": ["--attention", "mtraining", "--sparsity", "0.95"],
            "topp0.9": TOP_P_09,
            "topp0.95": ["--attention", "mtraining", "--top-p", "0.95"],
            "schedule": ["--attention", "mtraining", "--sparsity", "0.8:16384,0.9:32768,0.95"],
        },
        "baseline": "dense",
        "flags": LONG_FLAGS,
        "prefix": "quality",
    },
    # The same curriculum, top-P 0.9 with a smaller per-head cap, over block diagonals, and both: in plan long
    # its near-dense layer 1 set the 128K time. Its own dense run and top-P 0.9 again (plan long's, seed for seed).
    "long_cap": {
        "phases": LONG_PHASES,
        "stages": [4, 7, 8],
        "runs": {
            "dense": DENSE_LONG,
            "topp0.9": TOP_P_09,
            "topp0.9_cap256": [*TOP_P_09, "--cap", "256"],
            "topp0.9_blocks": [*TOP_P_09, "--block-slashes"],
            "topp0.9_blocks_cap128": [*TOP_P_09, "--block-slashes", "--cap", "128"],
        },
        "baseline": "dense",
        "flags": LONG_FLAGS,
        "prefix": "quality_cap",
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
    print(f"[{data['run']}] {data['status']} after {time.perf_counter() - started:.0f} s", flush=True)
    return data


@dataclasses.dataclass(frozen=True)
class StageRun:
    """One run's part of a stage: its train.py flags, the checkpoint it continues (None for the shared start)
    and the step that checkpoint ends at, and the file whose presence means this part is done (for the last
    stage, the run JSON marked ``done``)."""

    name: str
    flags: list[str]
    resume: Path | None
    start_step: int
    done_file: Path
    last: bool

    def argv(self) -> list[str]:
        return self.flags if self.resume is None else [*self.flags, "--resume", str(self.resume)]

    def done(self) -> bool:
        if not self.done_file.is_file():
            return False
        return not self.last or json.loads(self.done_file.read_text())["status"] == "done"


def stage_runs(plan: dict, index: int, out: Path, runs: list[str], extra: list[str]) -> list[StageRun]:
    """The runs of stage ``index`` (0 = the shared start, ``SHARED`` only; later stages: ``runs``), in order."""
    ends, common = plan["stages"], ["--phases", plan["phases"], *plan["flags"]]
    if index == 0:
        shared = ["--run", SHARED, "--out", str(out), "--attention", "dense", "--stop-after-phase", str(ends[0])]
        return [StageRun(SHARED, [*shared, *common, *extra], None, 0, out / f"{SHARED}.phase{ends[0]}.pt", False)]
    last = index == len(ends) - 1
    start_step = sum(phase[2] for phase in train.parse_phases(plan["phases"])[: ends[index - 1]])
    jobs = []
    for name in runs:
        source = out / f"{SHARED}.phase{ends[0]}.pt"
        if index > 1:
            source = out / "runs" / f"{name}.phase{ends[index - 1]}.pt"
        flags = ["--run", name, "--out", str(out / "runs")]
        if not last:
            flags += ["--stop-after-phase", str(ends[index])]
        done = out / "runs" / (f"{name}.json" if last else f"{name}.phase{ends[index]}.pt")
        jobs.append(StageRun(name, [*flags, *plan["runs"][name], *common, *extra], source, start_step, done, last))
    return jobs


def run_stage(plan: dict, index: int, out: Path, runs: list[str], extra: list[str], report_to: Path) -> None:
    """Stage ``index`` of ``plan`` for ``runs``; skips the runs that finished it. A run cut short starts the stage
    again from its checkpoint (its JSON is rewritten from that checkpoint's records, so nothing is counted
    twice). The last stage ends with the report."""
    names = stage_names(plan)
    for job in stage_runs(plan, index, out, runs, extra):
        if job.done():
            print(f"[{job.name}] stage {names[index]} is done", flush=True)
            continue
        if job.resume is not None and not job.resume.is_file():
            raise SystemExit(
                f"[{job.name}] {job.resume} is missing: run --stage {names[index - 1]} first (with the same --out)"
            )
        run_train(job.argv())
    if index == len(plan["stages"]) - 1:
        report.main(
            [str(out / "runs"), "--out", str(report_to), "--baseline", plan["baseline"], "--prefix", plan["prefix"]]
        )


def check_stage(plan: dict, index: int, out: Path, runs: list[str], extra: list[str]) -> list[str]:
    """train.py's checks of every run of stage ``index`` (flags; task and budget at every length it trains,
    evaluates or measures recall at from its start), without training; returns the failures."""
    failures = []
    for job in stage_runs(plan, index, out, runs, extra):
        try:
            train.check(job.flags, job.start_step)
        except ValueError as error:
            failures.append(f"[{job.name}] stage {stage_names(plan)[index]}: {error}")
    return failures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="Unknown flags go to train.py.")
    parser.add_argument("--stage", required=True, help="a stage letter (A, B, …) or 'all'")
    parser.add_argument("--out", type=Path, required=True, help="folder of the checkpoints and run JSONs")
    parser.add_argument("--plan", default="long", help=f"{', '.join(PLANS)} or a JSON file (see the module help)")
    parser.add_argument("--runs", default=None, help="comma-separated subset of the plan's runs (default: all)")
    parser.add_argument(
        "--report-to", type=Path, default=None, help="folder of the report (default: <out>/figures); last stage only"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check every run of the stage(s) as train.py would before training (flags, task and budget at "
        "every length), train nothing, and exit",
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
    stages = range(len(names)) if stage == "ALL" else [names.index(stage)]
    if args.check:
        failures = [failure for index in stages for failure in check_stage(plan, index, args.out, runs, extra)]
        if failures:
            raise SystemExit("\n".join(failures))
        print(f"stages {', '.join(names[index] for index in stages)}: every run passes train.py's checks", flush=True)
        return
    for index in stages:
        started = time.perf_counter()
        run_stage(plan, index, args.out, runs, extra, report_to)
        print(f"stage {names[index]} took {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
