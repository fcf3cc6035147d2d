"""tools/launch_host_time.py's refusals before any work (a folder without the kernels, a length the blocks do not
divide, no calls to time), and its timing of the estimation against the stand-in driver (in a fresh process: it
replaces Triton's driver and launcher). The refusal of another Triton release is ``compile_sm90.use_tree``'s,
tested there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tool_modules import load_tool

launch_host_time = load_tool("launch_host_time")
KERNELS = str(Path(__file__).resolve().parents[2] / "kernels")


def test_a_folder_without_the_kernels_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no mtraining_kernels/gluon_fwd.py"):
        launch_host_time.main(["--kernels", str(tmp_path)])


@pytest.mark.parametrize("seq_len", ["1000", "0"])
def test_a_length_that_is_not_whole_blocks_is_refused(seq_len):
    with pytest.raises(SystemExit, match=f"--seq-len {seq_len}: give a positive multiple of 128"):
        launch_host_time.main(["--kernels", KERNELS, "--seq-len", seq_len])


def test_no_calls_to_time_is_refused():
    with pytest.raises(SystemExit, match="--calls 0 --batches 5: give at least 1 of each"):
        launch_host_time.main(["--kernels", KERNELS, "--calls", "0"])


ESTIMATION_SCRIPT = r"""
import sys
sys.path[:0] = [{tools!r}, {kernels!r}]
import importlib
from compile_sm90 import StandInDriver
from triton.compiler.compiler import CompiledKernel
from triton.runtime import driver
import launch_host_time

driver.set_active(StandInDriver())
CompiledKernel._init_handles = lambda self: None
CompiledKernel.run = staticmethod(lambda *args, **kwargs: None)
per_call, until_scores = launch_host_time.estimation_microseconds(
    importlib.import_module("mtraining_kernels.estimation"), calls=3, batches=1
)
assert per_call > 0 and until_scores > 0, (until_scores, per_call)  # a launch was seen inside the call
print("estimation timed")
"""


def test_the_estimation_is_timed_up_to_its_scores_pass():
    """The static estimation compiles for sm_90 against the stand-in driver and runs with the launcher a no-op; its
    scores pass is launched inside the call (the instrumented launcher saw it)."""
    tools = str(Path(__file__).resolve().parents[2] / "tools")
    script = ESTIMATION_SCRIPT.format(tools=tools, kernels=KERNELS)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "estimation timed" in done.stdout
