"""The CPU quickstart (examples/quickstart.py, ``make demo``) trains and explains what it does.

One run of the demo as a user starts it (``--cpu``, a fresh ``--seed``; 2 gloo processes, CP = 2,
striped layout, top-P sparse attention through the torch_blocksparse ring, chunked loss, Megatron's
mock data) is checked for everything: the loss falls, the attention is sparse and the striped ring
balanced; the output says what runs and what density and imbalance mean before the first step, its
summary agrees with the step lines, and Megatron's Transformer Engine / Apex warnings are absent.
A run with ``--packed-documents`` trains on several documents per sequence, with sparse attention.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import signal
import subprocess
import sys

import pytest

STEPS = 6
DEMO_TIMEOUT = 900  # seconds; the demo takes about 25 s here, a loaded CI machine has needed minutes to start
LOSS_DROP = 0.5  # nats, mean of the last 3 steps below the mean of the first 3
QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.py")
STEP_LINE = re.compile(
    r"^step +(?P<step>\d+)/(?P<steps>\d+) \| loss (?P<loss>[\d.]+) \| density (?P<density>[\d.]+) "
    r"\| worker imbalance (?P<worker>[\d.]+) \| step imbalance (?P<ring_step>[\d.]+) "
    r"\| (?P<seconds>[\d.]+) s$",
    re.MULTILINE,
)
SUMMARY = re.compile(
    r"^summary: (?P<steps>\d+) steps, loss (?P<first>[\d.]+) -> (?P<last>[\d.]+), "
    r"(?P<seconds>[\d.]+) s of steps\n"
    r" +mean density (?P<density>[\d.]+): the sparse attention did (?P<percent>\d+)% of dense "
    r"attention's work\n"
    r" +worst imbalance: worker (?P<worker>[\d.]+), step (?P<ring_step>[\d.]+)$",
    re.MULTILINE,
)
PACKED_STEPS = 4
PACKED_STEP_LINE = re.compile(
    r"^step +(?P<step>\d+)/(?P<steps>\d+) \| loss (?P<loss>[\d.]+|nan|inf) \| density (?P<density>[\d.]+) "
    r"\| worker imbalance [\d.]+ \| step imbalance [\d.]+ \| documents/sequence (?P<documents>[\d.]+) "
    r"\| [\d.]+ s$",
    re.MULTILINE,
)
LIBRARY_WARNING = re.compile(r"warn|transformer.engine|apex|absl", re.IGNORECASE)


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    return quickstart


def run_demo(flags: list[str], seed: int, scratch) -> str:
    """Stdout and stderr of one CPU run of the demo, together, as a user sees them. The run must compile
    nothing with torch.compile (Megatron's fused RMSNorm and dropout-add), so its inductor cache must stay
    empty. A run past DEMO_TIMEOUT fails with every process's Python stacks (``faulthandler`` on SIGABRT),
    and no process of it outlives the test."""
    compile_cache = scratch / "torchinductor"
    demo = subprocess.Popen(
        [sys.executable, QUICKSTART, "--cpu", *flags, "--seed", str(seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the demo and its rank processes form one process group
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(compile_cache), "PYTHONFAULTHANDLER": "1"},
    )
    try:
        output, _ = demo.communicate(timeout=DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGABRT)  # each process prints its threads' stacks and exits
        output, _ = demo.communicate(timeout=60)
        pytest.fail(
            f"the demo ran past {DEMO_TIMEOUT} s (seed={seed}); its output, then where each process was:\n{output}"
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 0, f"the demo failed (seed={seed}):\n{output}"
    compiled = [path.name for path in compile_cache.rglob("*") if path.is_file()]
    assert not compiled, f"seed={seed}: the demo compiled kernels: {compiled[:5]}"
    return output


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(output, seed) of one CPU run of the demo."""
    seed = int.from_bytes(os.urandom(4), "little") % 2**31
    return run_demo(["--steps", str(STEPS)], seed, tmp_path_factory.mktemp("demo")), seed


def _steps(output: str) -> list[dict]:
    return [match.groupdict() for match in STEP_LINE.finditer(output)]


@pytest.mark.slow  # about a minute: two ranks build Megatron's model and mock data, then train
def test_quickstart_loss_falls_with_sparse_balanced_attention(demo):
    output, seed = demo
    steps = _steps(output)
    assert [int(step["step"]) for step in steps] == list(range(1, STEPS + 1)), output
    assert {int(step["steps"]) for step in steps} == {STEPS}, output
    losses = [float(step["loss"]) for step in steps]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - LOSS_DROP, f"loss did not fall: {losses} (seed={seed})"
    for step in steps:
        assert 0.05 < float(step["density"]) < 0.95, f"{step} (seed={seed})"
        assert 1.0 <= float(step["worker"]) < 1.2, f"{step} (seed={seed})"
        assert 1.0 <= float(step["ring_step"]) < 1.5, f"{step} (seed={seed})"


@pytest.mark.slow
def test_quickstart_explains_itself_before_the_first_step(demo):
    output, _ = demo
    first_step = STEP_LINE.search(output).start()
    before = output[:first_step]
    assert "a minimal training loop in 2 gloo processes: Megatron's `pretrain` needs CUDA" in before, output
    for words in (
        "2 layers, hidden 256",
        "4096 tokens split over CP = 2 ranks in the striped layout",
        "90% of the estimated attention mass",
        "density    fraction of the causal attention area computed (1.0 = dense attention)",
        "imbalance  max/mean of the ring's attention work over ranks (worker) and over ring steps (step)",
        "1.0 = perfectly balanced",
    ):
        assert words in before, f"{words!r} not before the first step:\n{output}"
    starting = before.index("starting 2 processes: importing Megatron, building the model")
    built = before.index("model built: ")
    assert starting < built, output
    assert "step 1 is the slowest" in before[built:], output
    assert "next: make test" in output[first_step:] and "docs/user_journey.md" in output[first_step:], output


@pytest.mark.slow
def test_quickstart_summary_agrees_with_the_step_lines(demo):
    output, seed = demo
    steps = _steps(output)
    summaries = list(SUMMARY.finditer(output))
    assert len(summaries) == 1, output
    summary = summaries[0]
    assert summary.start() > STEP_LINE.search(output).start(), output
    assert int(summary["steps"]) == len(steps) == STEPS, output
    assert (summary["first"], summary["last"]) == (steps[0]["loss"], steps[-1]["loss"]), output
    densities = [float(step["density"]) for step in steps]
    mean_density = float(summary["density"])
    assert abs(mean_density - sum(densities) / len(densities)) <= 1e-3, f"seed={seed}\n{output}"
    assert abs(int(summary["percent"]) - 100 * mean_density) <= 0.5 + 1e-9, output
    assert float(summary["worker"]) == max(float(step["worker"]) for step in steps), output
    assert float(summary["ring_step"]) == max(float(step["ring_step"]) for step in steps), output
    step_seconds = sum(float(step["seconds"]) for step in steps)
    assert abs(float(summary["seconds"]) - step_seconds) <= 0.05 * (STEPS + 1), output
    total = re.search(r"^finished in ([\d.]+) s, start-up included$", output, re.MULTILINE)
    assert total and float(total[1]) >= float(summary["seconds"]), output


@pytest.mark.slow
def test_quickstart_hides_library_warnings(demo):
    output, _ = demo
    assert not LIBRARY_WARNING.search(output), output


@pytest.mark.slow  # about 20 s: two ranks build the model and Megatron's GPTDataset over the documents, then train
def test_quickstart_trains_on_packed_documents(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little") % 2**31
    stdout = run_demo(["--packed-documents", "--steps", str(PACKED_STEPS)], seed, tmp_path)
    output = f"seed={seed}\n{stdout}"
    steps = [match.groupdict() for match in PACKED_STEP_LINE.finditer(stdout)]
    assert [int(step["step"]) for step in steps] == list(range(1, PACKED_STEPS + 1)), output
    opening = stdout[: PACKED_STEP_LINE.search(stdout).start()]
    assert "each document attends only within itself" in opening, output
    losses = [float(step["loss"]) for step in steps]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], f"{losses}: {output}"
    for step in steps:
        # write_packed_documents puts at least three documents, one short and one long, in every sequence
        assert float(step["documents"]) >= 3, f"{step}: {output}"
        assert 0 < float(step["density"]) <= 1, f"{step}: {output}"
    assert sum(float(step["density"]) for step in steps) / len(steps) < 1, f"the long documents stayed dense: {output}"
    assert not LIBRARY_WARNING.search(stdout), output


def test_launcher_log_gives_the_step_records(capsys):
    """The GPU path's summary reads Megatron's iteration lines and the launcher's metrics lines."""
    from megatron_mtraining.step_metrics import StepMetrics, log_step_metrics

    log_step_metrics(StepMetrics({1: 0.25, 2: 0.35}, 1.25, 1.125, 0.004), iteration=1)
    metrics_line = capsys.readouterr().out
    megatron_lines = [
        f" [timestamp] iteration {iteration:8d}/{2:8d} | consumed samples: "
        f"{iteration:12d} | elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.000000E-03 | "
        f"global batch size:     1 | lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: 1.234 | "
        for iteration, ms, loss in ((1, 2500.0, 6.25), (2, 125.0, 5.5))
    ]
    records = _quickstart().records_from_launcher_log(["noise\n", metrics_line, *megatron_lines])
    assert records == [
        {"step": 1, "seconds": 2.5, "loss": 6.25, "density": 0.3, "worker_imbalance": 1.25, "step_imbalance": 1.125}
    ], records  # iteration 2 has no metrics line: left out


def test_launcher_log_gives_the_documents_per_sequence(capsys):
    """A packed run's launcher metrics line also gives the documents per sequence (the step records keep it)."""
    from megatron_mtraining.step_metrics import StepMetrics, log_step_metrics

    log_step_metrics(StepMetrics({1: 0.5}, 1.0, 1.0, 0.0, documents_per_sequence=4.5, clamped_documents=0), 3)
    megatron_line = " iteration        3/       3 | elapsed time per iteration (ms): 250.0 | lm loss: 4.000000E+00 | "
    records = _quickstart().records_from_launcher_log([capsys.readouterr().out, megatron_line])
    assert records == [
        {
            "step": 3,
            "density": 0.5,
            "worker_imbalance": 1.0,
            "step_imbalance": 1.0,
            "documents_per_sequence": 4.5,
            "seconds": 0.25,
            "loss": 4.0,
        }
    ], records
    assert "documents/sequence 4.5 | " in _quickstart().step_line(records[0], 3)
