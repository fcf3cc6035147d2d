"""tools/compile_sm90.py's refusals before any work (a folder without the kernels, a length the blocks do not
divide, a missing folder for the machine code, a Triton release other than the one the Gluon kernel is written
for)."""

from pathlib import Path

import pytest
import triton
from tool_modules import load_tool

from mtraining_kernels.triton_backend import ONE_PASS_TRITON

compile_sm90 = load_tool("compile_sm90")
KERNELS = str(Path(__file__).resolve().parents[2] / "kernels")


def test_a_folder_without_the_kernels_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no mtraining_kernels/gluon_bwd.py"):
        compile_sm90.main(["--kernels", str(tmp_path)])


def test_a_length_that_is_not_whole_blocks_is_refused():
    with pytest.raises(SystemExit, match="--seq-len 1000: give a multiple of 128"):
        compile_sm90.main(["--kernels", KERNELS, "--seq-len", "1000"])


def test_a_missing_folder_for_the_machine_code_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--sass .*missing: no such folder"):
        compile_sm90.main(["--kernels", KERNELS, "--sass", str(tmp_path / "missing")])


@pytest.mark.skipif(
    triton.__version__.startswith(ONE_PASS_TRITON), reason="checks the refusal of another Triton release"
)
def test_another_triton_release_is_refused_naming_the_one_to_install():
    wanted = ONE_PASS_TRITON.rstrip(".")
    with pytest.raises(SystemExit, match=f"written for {wanted}: pip install"):
        compile_sm90.main(["--kernels", KERNELS])
