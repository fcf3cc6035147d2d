"""tools/launch_host_time.py's refusals before any work (a folder without the kernels, a length the blocks do not
divide, no calls to time). The refusal of another Triton release is ``compile_sm90.use_tree``'s, tested there."""

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
