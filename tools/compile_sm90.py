"""Compile a kernels tree's Gluon kernels for Hopper (sm_90a) on a machine without a GPU.

Prints, per launch of ``gluon_bwd.one_pass_backward`` (the block tiles; the bars too where the tree has them),
the shared memory, ptxas's registers, spills and stack, the register counts the warp-specialised partitions step
to, and the thread barriers, warpgroup MMAs and spill instructions per iteration of the MMA loop (one slice of the
one pass), for each variant the tree's one pass has (the default mode and dk/dv alone, ``dq=None``, for the
deterministic mode, each without and with packed documents), then the same for ``gluon_fwd.block_forward`` where
the tree has it: what a kernel change costs before a GPU can time it. Two trees whose machine code (``--sass``) is
the same differ in nothing a GPU would see.
The tree's Gluon is written for one Triton release (``triton_backend.ONE_PASS_TRITON``); put that release first
on ``PYTHONPATH`` (``pip install --target /tmp/triton36 triton==3.6.0 --no-deps``). No CUDA driver is needed:
Triton compiles against a stand-in driver that reports an sm_90 target, and nothing is launched.
Example: ``PYTHONPATH=/tmp/triton36 python tools/compile_sm90.py --kernels .ab/base/kernels``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

HOPPER = GPUTarget("cuda", 90, 32)
H100_MULTIPROCESSORS = 132  # the persistent forward's programs (a launch argument, not compiled in)


class StandInDriver:
    """What Triton's JIT asks of the active driver to compile, for a GPU that is not there."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return HOPPER

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class CompileOnly:
    """Stands for a ``@gluon.jit`` kernel: ``kernel[grid](...)`` compiles (``warmup``) and keeps the result."""

    def __init__(self, kernel, compiled: list | None = None):
        self.kernel = kernel
        self.compiled = [] if compiled is None else compiled  # shared by the stand-ins of one module's kernels

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled.append(self.kernel.warmup(*args, grid=grid, **kwargs))

        return launch


SETMAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")  # a partition's register step
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")  # "/*28e0*/   HGMMA.64x64x16… ;" → address, instruction


class MmaLoop(NamedTuple):
    """What one iteration of the MMA loop executes, counted in its machine code."""

    barriers: int  # BAR.SYNC: partition-wide thread barriers (not mbarrier waits)
    mmas: int  # HGMMA: warpgroup matrix multiply-accumulates
    spill_stores: int  # STL: stores to local memory (register spills)
    spill_loads: int  # LDL: loads from local memory


def mma_loop(sass: str) -> MmaLoop | None:
    """The counts of the innermost loop that holds the kernel's first ``HGMMA``: the smallest range from a
    backward branch's target to the branch that contains it (a slice of the one pass, an iteration of the
    forward's block loop); None without one. Spills there cost every iteration, unlike ptxas's totals."""
    code = [(int(address, 16), text) for address, text in SASS_LINE.findall(sass)]
    is_mma = [re.search(r"(^|\s)HGMMA\.", text) is not None for _, text in code]  # predicated ones too
    first_mma = next((address for (address, _), mma in zip(code, is_mma) if mma), None)
    if first_mma is None:
        return None
    loops = []
    for address, text in code:
        branch = re.search(r"\bBRA (0x[0-9a-f]+)$", text)
        if branch and int(branch.group(1), 16) <= first_mma <= address:
            loops.append((int(branch.group(1), 16), address))
    if not loops:
        return None
    start, end = min(loops, key=lambda loop: loop[1] - loop[0])
    body = [(text, mma) for (address, text), mma in zip(code, is_mma) if start <= address <= end]

    def count(opcode: str) -> int:
        return sum(re.search(rf"(^|\s){opcode}\b", text) is not None for text, _ in body)

    return MmaLoop(count("BAR.SYNC"), sum(mma for _, mma in body), count("STL"), count("LDL"))


def register_steps(ptx: str) -> str | None:
    """The per-thread register counts that the warp-specialised partitions step up and down to (the PTX's
    ``setmaxnreg``: the MMA partitions' budget, next to the launch's ``.maxnreg``), or None without any."""
    steps = {"inc": set(), "dec": set()}
    for direction, count in SETMAXNREG.findall(ptx):
        steps[direction].add(int(count))
    if not any(steps.values()):
        return None
    up, down = (", ".join(str(count) for count in sorted(steps[d])) or "none" for d in ("inc", "dec"))
    return f"setmaxnreg per thread: up to {up}; down to {down}"


def ptxas_report(ptx: str, sass: Path | None = None) -> str:
    """ptxas -v's lines on registers, spills and stack for ``ptx`` (sm_90a), and the counts of its MMA loop
    (:func:`mma_loop`, from ``cuobjdump -sass``); with ``sass``, the machine code is written there, to find
    which values spill and where the barriers sit."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        source.write_text(ptx)
        log = subprocess.run(
            [str(tools / "ptxas"), "-v", "--gpu-name", "sm_90a", str(source), "-o", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        )
        dump = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True)
        if dump.returncode:
            raise SystemExit(f"cuobjdump -sass failed on the compiled kernel: {dump.stderr.strip()}")
        if sass is not None:
            sass.write_text(dump.stdout)
    lines = [
        line.strip() for line in (log.stdout + log.stderr).splitlines() if re.search("registers|spill|stack", line)
    ]
    steps = register_steps(ptx)
    if steps is not None:
        lines.append(steps)
    loop = mma_loop(dump.stdout)
    if loop is not None:
        lines.append(
            f"MMA loop, per iteration: {loop.barriers} thread barriers (BAR.SYNC), {loop.mmas} HGMMA, "
            f"{loop.spill_stores} spill stores (STL), {loop.spill_loads} spill loads (LDL)"
        )
    return "\n".join(lines)


def one_pass_inputs(seq_len: int, heads: int, kv_heads: int, dim: int) -> dict:
    """Zero CPU tensors shaped as the bench's Qwen2.5-3B backward (only shapes, strides and dtypes matter)."""
    q, dout = (torch.zeros(1, seq_len, heads, dim, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.zeros(1, seq_len, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
    lse, delta = (torch.zeros(1, heads, seq_len) for _ in range(2))
    dk, dv = (torch.zeros(1, seq_len, kv_heads, dim) for _ in range(2))
    num_blocks = seq_len // 128
    return dict(
        q=q,
        k=k,
        v=v,
        dout=dout,
        lse=lse,
        delta=delta,
        dq=torch.zeros(q.shape),
        dk=dk,
        dv=dv,
        key_ptr=torch.zeros(1, heads, num_blocks + 1, dtype=torch.int32),
        key_qblock=torch.zeros(num_blocks * num_blocks, dtype=torch.int32),
    )


def forward_inputs(seq_len: int, heads: int, kv_heads: int, dim: int) -> dict:
    """Zero CPU tensors shaped as the bench's Qwen2.5-3B forward of the block tiles."""
    q, out = (torch.zeros(1, seq_len, heads, dim, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.zeros(1, seq_len, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
    num_blocks = seq_len // 128
    return dict(
        q=q,
        k=k,
        v=v,
        blk_ptr=torch.zeros(1, heads, num_blocks + 1, dtype=torch.int32),
        blk_col=torch.zeros(num_blocks * num_blocks, dtype=torch.int32),
        out=out,
        lse=torch.zeros(1, heads, seq_len),
    )


def persistent_keywords(gluon_fwd) -> dict:
    """``block_forward``'s programs (an H100's multiprocessors) where the tree's forward is persistent, else none."""
    persistent = "programs" in inspect.signature(gluon_fwd.block_forward).parameters
    return {"programs": H100_MULTIPROCESSORS} if persistent else {}


def bar_words_of(module, seq_len: int, rows: int):
    """Zero ``BarWords`` of the tree's ``bar_words`` module: one chunk per row; its walk bounds per chunk, or
    (trees before ``bounds``) one item per row."""
    lists = dict(
        column=torch.zeros(rows, module.BAR_WORD_COLUMNS, dtype=torch.int32),
        count=torch.zeros(rows, dtype=torch.int32),
        words=torch.zeros(rows, 1, seq_len // 128, 2, dtype=torch.int64),
        walk=module.MIN_WALK,
    )
    if "bounds" in {field.name for field in dataclasses.fields(module.BarWords)}:
        lists["bounds"] = torch.zeros(rows, 1, 2, dtype=torch.int32)
    else:
        lists["items"] = torch.zeros(rows, 4, dtype=torch.int32)
    return module.BarWords(**lists)


def use_tree(folder: Path) -> None:
    """Import ``mtraining_kernels`` from ``folder`` from now on, and compile against the stand-in driver; raise
    ``SystemExit`` naming the release to install where the Triton first on the path is not the one the tree's
    Gluon is written for."""
    sys.path.insert(0, str(folder))
    wanted = importlib.import_module("mtraining_kernels.triton_backend").ONE_PASS_TRITON.rstrip(".")
    if not triton.__version__.startswith(wanted):
        raise SystemExit(
            f"Triton {triton.__version__} is first on the path, but the tree's Gluon is written for {wanted}: "
            f"pip install --target /tmp/triton{wanted.replace('.', '')} 'triton=={wanted}.*' --no-deps, then put that "
            "folder first on PYTHONPATH"
        )
    driver.set_active(StandInDriver())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", default="kernels", help="the folder holding the tree's mtraining_kernels")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--sass", help="a folder to write each launch's machine code to (launch<n>.sass)")
    args = parser.parse_args(argv)
    folder = Path(args.kernels).resolve()
    if not (folder / "mtraining_kernels" / "gluon_bwd.py").is_file():
        raise SystemExit(f"--kernels {args.kernels}: no mtraining_kernels/gluon_bwd.py under {folder}")
    if args.seq_len % 128:
        raise SystemExit(f"--seq-len {args.seq_len}: give a multiple of 128")
    if args.sass and not Path(args.sass).is_dir():
        raise SystemExit(f"--sass {args.sass}: no such folder; create it first")
    use_tree(folder)
    gluon_bwd = importlib.import_module("mtraining_kernels.gluon_bwd")
    compiled = []  # every kernel the backward launches, in the order they compile
    for name in dir(gluon_bwd):
        if name.endswith("_kernel") and hasattr(getattr(gluon_bwd, name), "warmup"):
            setattr(gluon_bwd, name, CompileOnly(getattr(gluon_bwd, name), compiled))
    inputs = one_pass_inputs(args.seq_len, 16, 2, 128)
    accepted = inspect.signature(gluon_bwd.one_pass_backward).parameters
    if "bar_words" in accepted:  # a tree whose one pass also takes the bars by column: one chunk per row
        inputs["bar_words"] = bar_words_of(importlib.import_module("mtraining_kernels.bar_words"), args.seq_len, 16)
    variants = {"default": {}}
    if "documents" in accepted:  # a tree whose one pass also serves the deterministic mode and packed documents
        doc_ids = torch.zeros(1, args.seq_len, dtype=torch.int32)
        variants.update(
            documents={"documents": (doc_ids,) * 2},
            deterministic={"dq": None},
            deterministic_documents={"dq": None, "documents": (doc_ids,) * 2},
        )
    labels = []
    for label, changes in variants.items():
        before = len(compiled)
        gluon_bwd.one_pass_backward(**{**inputs, **changes}, causal_diag=True, softmax_scale=128**-0.5)
        labels += [label] * (len(compiled) - before)
    if (folder / "mtraining_kernels" / "gluon_fwd.py").is_file():
        gluon_fwd = importlib.import_module("mtraining_kernels.gluon_fwd")
        forward = gluon_fwd.block_forward_kernel = CompileOnly(gluon_fwd.block_forward_kernel)
        inputs = forward_inputs(args.seq_len, 16, 2, 128)
        inputs.update(persistent_keywords(gluon_fwd))
        gluon_fwd.block_forward(**inputs, causal_diag=True, softmax_scale=128**-0.5)
        labels += ["forward"] * len(forward.compiled)
        if "bar_col" in inspect.signature(gluon_fwd.block_forward).parameters:  # a tree whose forward takes bars
            before = len(forward.compiled)
            bars = dict(bar_ptr=inputs["blk_ptr"].clone(), bar_col=inputs["blk_col"].clone())
            gluon_fwd.block_forward(**inputs, **bars, causal_diag=True, softmax_scale=128**-0.5)
            labels += ["forward_bars"] * (len(forward.compiled) - before)
        compiled += forward.compiled
    print(f"tree {folder}, Triton {triton.__version__}, sm_90a")
    for number, (label, kernel) in enumerate(zip(labels, compiled)):
        print(f"launch {number} ({label}): shared memory {kernel.metadata.shared} B")
        sass = Path(args.sass) / f"launch{number}.sass" if args.sass else None
        print(ptxas_report(kernel.asm["ptx"], sass))


if __name__ == "__main__":
    main()
