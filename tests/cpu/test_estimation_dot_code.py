"""Every pass of the estimation kernels computes its logits with the same tensor-core instructions on Hopper
(DESIGN.md §2.2, bit identity item 1): compiled for sm_90 on the CPU (Triton ships ptxas), the PTX of every
pass, the one that stores the logits included, holds the same ``wgmma`` sequence, so a logit has one value
everywhere; each pass carries its own name in profiles. The check runs in a fresh process, away from the
interpreter flag of the other Triton tests."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mtraining_kernels import estimation, triton_estimation as kernels

pointers_fp32 = {"Q", "K", "LOGITS", "ROW_MAX", "TILE_MAX", "CONSTANTS", "MASS_SCALE"}


def compiled_pass(kernel, constants, dtype, max_registers):  # (the kernel's name, its wgmma lines, registers blanked)
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.isupper():
            signature[name] = "*fp32" if name in pointers_fp32 else "*i64"
        else:
            signature[name] = "fp32" if name == "scale" else "i64"
    signature["Q"] = signature["K"] = "*" + dtype
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=kernels.NUM_WARPS, enable_fp_fusion=False, maxnreg=max_registers),
    )
    return compiled.name, [re.sub(r"%\w+", "R", l.strip()) for l in compiled.asm["ptx"].splitlines() if "wgmma" in l]


shape = dict(HEAD_DIM=128, DIM_PAD=128, IEEE=False, BLOCK=kernels.KEYS_PER_TILE)
coefficients = len(estimation._fixed_point_rules().exp2_coefficients)  # as launched
passes = {  # (pass, top-P, consecutive keys): the name the pass carries in profiles
    (kernels._STORED_LOGITS, False, False): "estimation_stored_logits",
    (kernels._ROW_MAXIMA, False, False): "estimation_row_maxima",
    (kernels._ROW_SUMS, False, False): "estimation_row_sums",
    (kernels._SCORES, False, False): "estimation_scores_static_slashes",
    (kernels._SCORES, True, False): "estimation_scores_top_p_slashes",
    (kernels._SCORES, False, True): "estimation_scores_static_slashes",
    (kernels._SCORES, True, True): "estimation_scores_top_p_slashes",
}
for dtype in ("bf16", "fp16"):
    sequences = {}
    for (pass_number, top_p, consecutive), expected_name in passes.items():
        flags = dict(TOP_P=top_p, SLASHES=True, CONSECUTIVE=consecutive)
        tiles = kernels._TILES_PER_PROGRAM.get(pass_number.value, 1)  # key tiles per program, as launched
        max_registers = kernels._MAX_REGISTERS.get((pass_number.value, top_p))  # as launched
        constants = dict(PASS=pass_number, FROM_QK=True, NUM_COEFFICIENTS=coefficients, TILES=tiles, **flags, **shape)
        name, lines = compiled_pass(kernels._key_tile_kernel, constants, dtype, max_registers)
        sequences[(int(pass_number), top_p, consecutive)] = lines
        assert name == expected_name, f"{dtype}: pass {int(pass_number)} is named {name}, not {expected_name}"
    stored = sequences[(int(kernels._STORED_LOGITS), False, False)]
    assert any("mma_async" in line for line in stored), f"{dtype}: no wgmma in the PTX"
    for key, lines in sequences.items():
        assert lines == stored, f"{dtype}: pass {key} issues other tensor-core instructions than the stored logits"
print("same wgmma sequence in every pass")
"""


def test_every_pass_issues_the_same_tensor_core_instructions():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same wgmma sequence in every pass" in done.stdout
