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


def _sass(*instructions: str) -> str:
    """cuobjdump -sass lines, one instruction per 16 bytes from address 0."""
    return "\n".join(
        f"        /*{16 * n:04x}*/                   {text} ;          /* 0x0000000000000000 */"
        for n, text in enumerate(instructions)
    )


def test_the_mma_loop_is_the_innermost_loop_around_the_first_warpgroup_mma():
    sass = _sass(
        "BAR.SYNC.DEFER_BLOCKING 0x1",  # 0x00: before the loops
        "MOV R1, R2",  # 0x10: the outer loop starts
        "BAR.SYNC.DEFER_BLOCKING 0x0, 0x100",  # 0x20: the inner loop starts
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R8+URZ+0x10], R13",
        "@!P1 BRA 0x100",  # 0x40: to the out-of-line retry
        "HGMMA.64x64x16.F32.BF16 R184, gdesc[UR52], RZ, !UPT",
        "@P2 HGMMA.64x64x16.F32.BF16 R184, gdesc[UR12], R184, gsb0",
        "STL.64 [R1+0x8], R20",
        "LDL R21, [R1+0x10]",
        "@P3 LDL.64 R22, [R1+0x18]",
        "BAR.SYNC.DEFER_BLOCKING 0x0, 0x100",
        "@P1 BRA 0x20",  # 0xb0: the inner loop's back branch
        "BAR.SYNC.DEFER_BLOCKING 0x0, 0x100",  # in the outer loop only
        "STL [R1+0x20], R30",
        "@P0 BRA 0x10",  # 0xe0: the outer loop's back branch
        "EXIT",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R8+URZ+0x10], R13",  # 0x100: the retry, back into the inner loop
        "BRA 0x40",
    )
    loop = compile_sm90.mma_loop(sass)
    assert (loop.barriers, loop.mmas, loop.spill_stores, loop.spill_loads) == (2, 2, 1, 2)


def test_code_without_a_warpgroup_mma_in_a_loop_has_no_mma_loop():
    assert compile_sm90.mma_loop(_sass("BAR.SYNC.DEFER_BLOCKING 0x1", "@P0 BRA 0x0", "EXIT")) is None
    assert compile_sm90.mma_loop(_sass("HGMMA.64x64x16.F32.BF16 R1, gdesc[UR4], RZ, !UPT", "EXIT")) is None


def test_register_steps_list_each_partitions_setmaxnreg_once():
    ptx = "\n".join(
        [
            "\tsetmaxnreg.dec.sync.aligned.u32 \t24;",
            "\tsetmaxnreg.inc.sync.aligned.u32 \t240;",
            "\tsetmaxnreg.dec.sync.aligned.u32 \t24;",
            "\tsetmaxnreg.inc.sync.aligned.u32 \t256;",
            "\tsetmaxnreg.dec.sync.aligned.u32 \t240;",
        ]
    )
    assert compile_sm90.register_steps(ptx) == "setmaxnreg per thread: up to 240, 256; down to 24, 240"
    assert compile_sm90.register_steps("\tsetmaxnreg.inc.sync.aligned.u32 \t232;") == (
        "setmaxnreg per thread: up to 232; down to none"
    )
    assert compile_sm90.register_steps("\tmov.u32 %r1, 0;") is None
