"""tools/kernel_ab.py's checks before any work: the trees given, and the device; and its comparison of results."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tool_modules import load_tool

kernel_ab = load_tool("kernel_ab")
kernel_ab_tree = load_tool("kernel_ab_tree")
bench_attention = load_tool("bench_attention")
KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _tree(tmp_path, name):
    package = tmp_path / name / "mtraining_kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    return tmp_path / name


def test_trees_are_named_folders_holding_the_package(tmp_path):
    base, new = _tree(tmp_path, "base"), _tree(tmp_path, "new")
    trees = kernel_ab.parse_trees([f"base={base}", f"new={new}"])
    assert list(trees) == ["base", "new"] and trees["new"] == new.resolve()


@pytest.mark.parametrize(
    "specs, offending, message",
    [
        (["base"], "'base'", "NAME=FOLDER"),
        (["=x", "b=y"], "'=x'", "NAME=FOLDER"),
        (["base={base}"], "1 tree given", "an A/B needs at least two"),
        (["base={base}", "base={base}"], "'base'", "given twice"),
        (["base={base}", "new={tmp}/missing"], "missing", "holds no mtraining_kernels package"),
    ],
)
def test_bad_trees_are_refused_naming_the_value(tmp_path, specs, offending, message):
    base = _tree(tmp_path, "base")
    with pytest.raises(SystemExit, match=message) as raised:
        kernel_ab.parse_trees([spec.format(base=base, tmp=tmp_path) for spec in specs])
    assert offending in str(raised.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_a_gpu_it_stops_before_starting_a_tree(tmp_path):
    trees = [f"base={_tree(tmp_path, 'base')}", f"new={_tree(tmp_path, 'new')}"]
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        kernel_ab.main(["--trees", *trees, "--jsonl", str(tmp_path / "rows.jsonl")])
    assert not (tmp_path / "rows.jsonl").exists()


def test_rounds_below_one_are_refused(tmp_path):
    trees = [f"base={_tree(tmp_path, 'base')}", f"new={_tree(tmp_path, 'new')}"]
    with pytest.raises(SystemExit, match="--rounds 0"):
        kernel_ab.main(["--trees", *trees, "--rounds", "0"])


def test_relative_max_difference_is_the_worst_tensor_scaled_by_its_reference():
    first = [torch.tensor([1.0, -4.0]), torch.tensor([2.0, 2.0])]
    results = [torch.tensor([1.0, -3.0]), torch.tensor([2.0, 2.5])]  # 1/4 and 0.5/2
    assert kernel_ab_tree.relative_max_difference(results, first) == pytest.approx(0.25)
    assert kernel_ab_tree.relative_max_difference(first, first) == 0.0
    with pytest.raises(ValueError):
        kernel_ab_tree.relative_max_difference(results[:1], first)


def test_the_shapes_offered_are_the_benchmarks_shapes():
    assert set(kernel_ab.SHAPE_NAMES) == set(bench_attention.SHAPES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_the_driver_runs_without_any_kernels_on_its_path(tmp_path):
    """Run as a user does (``python tools/kernel_ab.py``, no PYTHONPATH): the driver imports no tree, so it gets as
    far as its device check."""
    trees = [f"base={_tree(tmp_path, 'base')}", f"new={_tree(tmp_path, 'new')}"]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    script = Path(kernel_ab.__file__)
    done = subprocess.run(
        [sys.executable, str(script), "--trees", *trees], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode != 0 and "kernel_ab.py needs a CUDA device" in done.stderr, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tree's process would time it: this checks the plumbing")
def test_each_tree_runs_in_a_process_that_imports_that_tree(tmp_path, monkeypatch, capfd):
    """The parent starts the first tree's process with its folder first on PYTHONPATH; without a GPU that process
    stops at the device check, after checking where its mtraining_kernels came from, and the A/B stops with its
    reference."""
    copy = tmp_path / "copy"
    shutil.copytree(
        KERNELS / "mtraining_kernels", copy / "mtraining_kernels", ignore=shutil.ignore_patterns("__pycache__")
    )
    monkeypatch.setattr(kernel_ab.torch.cuda, "is_available", lambda: True)  # the parent's check only
    trees = [f"copy={copy}", f"repo={KERNELS}"]
    with pytest.raises(SystemExit, match="tree 'copy', round 0: exited with status 1; it is the reference"):
        kernel_ab.main(["--trees", *trees, "--jsonl", str(tmp_path / "rows.jsonl")])
    assert (
        f"tree 'copy' (mtraining_kernels from {copy.resolve()}): kernel_ab.py needs a CUDA device"
        in capfd.readouterr().err
    )


def test_a_tree_process_that_fails_or_hangs_is_reported_not_fatal():
    quick = [sys.executable, "-c", "pass"]
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    hanging = [sys.executable, "-c", "import time; time.sleep(30)"]
    env = dict(os.environ)
    assert kernel_ab.run_tree_process(quick, env, None) is None
    assert kernel_ab.run_tree_process(failing, env, None) == "exited with status 3"
    assert "stopped after 0.5 s" in kernel_ab.run_tree_process(hanging, env, 0.5)


def test_a_tree_timeout_that_is_not_positive_is_refused(tmp_path):
    trees = [f"base={_tree(tmp_path, 'base')}", f"new={_tree(tmp_path, 'new')}"]
    with pytest.raises(SystemExit, match="--tree-timeout 0: give a positive number"):
        kernel_ab.main(["--trees", *trees, "--tree-timeout", "0"])


def test_the_trees_after_one_that_did_not_finish_still_run(tmp_path, monkeypatch):
    trees = [f"{name}={_tree(tmp_path, name)}" for name in ("base", "broken", "new")]
    ran = []

    def fake_run(command, env, timeout):
        name = command[command.index("--tree") + 1]
        ran.append((name, timeout))
        return "exited with status 2" if name == "broken" else None

    monkeypatch.setattr(kernel_ab.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_ab, "run_tree_process", fake_run)
    with pytest.raises(SystemExit, match=r"did not finish: 'broken' \(round 0: exited with status 2\)$"):
        kernel_ab.main(["--trees", *trees, "--tree-timeout", "90"])
    assert ran == [("base", 90.0), ("broken", 90.0), ("new", 90.0)]
