"""Launch-config sweep of the Triton attention kernels on one GPU, against cuDNN in the same run.

The kernels' launch configs (``num_warps``, ``num_stages``) are constants in
``mtraining_kernels.triton_backend``, picked from the compiler's resource report rather than by timing.
This tool times candidates on this GPU, causal, bf16, ``[1, N, Hq, d]``:

* ``forward`` candidates replace ``_forward_config`` and are timed on the forward;
* ``backward`` candidates replace ``QUERY_MAJOR_CONFIG`` (the dq pass) and ``key_major`` candidates
  ``KEY_MAJOR_CONFIG`` (the blocks' dk/dv pass), each timed on the default backward (on Hopper, head dim
  128, the default backward's block tiles take ``gluon_bwd``'s one pass instead, whose layout is fixed
  in that module: there the dq pass walks the bars alone and the key-major config is unused);
* ``bar_chunk`` candidates replace ``BAR_CHUNK_CONFIG`` (the deterministic mode's pass over the bars' dk/dv)
  and are timed on the deterministic backward, on the sparse pattern only (the full one has no bars);
* with ``--deterministic`` every backward family is checked and timed on the deterministic backward, where the
  dq pass computes the dq of every block tile (on Hopper too) and is the config that mode runs on;

each on the full causal pattern (our dense mode) and on a pattern calibrated to ``--sparsity``, next to
torch SDPA cuDNN in the same run. Every candidate's output and gradients are compared with those of the
current config (relative RMSE, bound ``--rmse-bound``; the deterministic mode's with its own), so a fast
but wrong config cannot win. A candidate that does not compile (e.g. shared memory) is reported, not fatal.
``--kernels`` picks the families to sweep. Prints a table; rows go to ``--jsonl``.

    python tools/tune_triton.py --seq-len 131072 --jsonl /tmp/tune.jsonl
    python tools/tune_triton.py --seq-len 131072 --kernels bar_chunk
    python tools/tune_triton.py --seq-len 131072 --kernels backward --deterministic
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
from pathlib import Path
from unittest import mock

import torch
from bench_attention import SHAPES, budget_pattern, mask_density, measure, time_sdpa
from provenance import git_commit
from torch.nn.attention import SDPBackend

from mtraining_kernels import Layout, convert_index, sparse_attention, triton_backend
from mtraining_kernels.vertical_slash import full_index

FORWARD_CANDIDATES = tuple({"num_warps": warps, "num_stages": stages} for warps in (4, 8) for stages in (2, 3, 4))
BACKWARD_CANDIDATES = tuple({"num_warps": warps, "num_stages": stages} for warps in (4, 8) for stages in (1, 2, 3))
KEY_MAJOR_CANDIDATES = tuple(
    {"num_warps": warps, "num_stages": stages, "QUERY_ROWS": rows}
    for warps in (4, 8)
    for stages in (2, 3, 4)
    for rows in (32, 64)
)
BAR_CHUNK_CANDIDATES = tuple(
    {"num_warps": warps, "num_stages": stages, "QUERY_ROWS": rows}
    for warps in (4, 8)
    for stages in (2, 3, 4)
    for rows in (64, 128)
)
CANDIDATES = {
    "forward": FORWARD_CANDIDATES,
    "backward": BACKWARD_CANDIDATES,
    "key_major": KEY_MAJOR_CANDIDATES,
    "bar_chunk": BAR_CHUNK_CANDIDATES,
}
KERNELS = tuple(CANDIDATES)
# the module-level launch config that each backward kernel's candidates replace
BACKWARD_CONFIGS = {"backward": "QUERY_MAJOR_CONFIG", "key_major": "KEY_MAJOR_CONFIG", "bar_chunk": "BAR_CHUNK_CONFIG"}
DETERMINISTIC_KERNELS = ("bar_chunk",)  # timed on the deterministic backward, the only one that launches them


@contextlib.contextmanager
def patched(kernel: str, config: dict):
    """Launch ``kernel``'s Triton kernel with ``config`` inside the block; the module's own config after."""
    if kernel == "forward":
        with mock.patch.object(triton_backend, "_forward_config", lambda dim: dict(config)):
            yield
    elif kernel in BACKWARD_CONFIGS:
        with mock.patch.dict(getattr(triton_backend, BACKWARD_CONFIGS[kernel]), config, clear=True):
            yield
    else:
        raise ValueError(f"kernel={kernel!r} is unknown; use one of {KERNELS}")


def current_config(kernel: str, dim: int) -> dict:
    if kernel == "forward":
        return triton_backend._forward_config(dim)
    return dict(getattr(triton_backend, BACKWARD_CONFIGS[kernel]))


def relative_rmse(got: torch.Tensor, expected: torch.Tensor) -> float:
    """‖got − expected‖₂ / ‖expected‖₂ in fp64 (0 when both are zero)."""
    got, expected = got.double(), expected.double()
    norm = float(expected.norm())
    return float((got - expected).norm()) / norm if norm else float((got - expected).norm())


def attention_outputs(q, k, v, dout, index, deterministic: bool) -> dict[str, torch.Tensor]:
    out = sparse_attention(q, k, v, index, backend="triton", deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


def worst_rmse(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[str, float]:
    """(tensor name, relative RMSE) of the tensor that differs most; inf when any value is not finite."""
    errors = {
        name: (relative_rmse(got[name], expected[name]) if torch.isfinite(got[name]).all() else float("inf"))
        for name in expected
    }
    name = max(errors, key=errors.get)
    return name, errors[name]


def sweep_pattern(pattern: str, q, k, v, dout, index, density: float, kernels, options, record) -> None:
    """Time every candidate of ``kernels`` on one pattern; ``record(**row)`` each result."""
    baselines = {}  # by mode, from the current configs
    for kernel in kernels:
        deterministic = options.deterministic or kernel in DETERMINISTIC_KERNELS
        if deterministic not in baselines:
            baselines[deterministic] = attention_outputs(q, k, v, dout, index, deterministic)
        current = current_config(kernel, q.shape[-1])
        for config in CANDIDATES[kernel]:
            row = dict(
                pattern=pattern,
                density=density,
                kernel=kernel,
                config=config,
                current=config == current,
                deterministic=deterministic,
            )
            try:
                with patched(kernel, config):
                    outputs = attention_outputs(q, k, v, dout, index, deterministic)
                    name, rmse = worst_rmse(outputs, baselines[deterministic])
                    fwd_ms, bwd_ms = measure(
                        lambda: sparse_attention(q, k, v, index, backend="triton", deterministic=deterministic),
                        lambda out: torch.autograd.grad(out, (q, k, v), dout),
                        options.warmup,
                        options.reps,
                    )
            except Exception as error:  # a config the compiler or the GPU rejects
                record(**row, status=f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                continue
            ok = rmse <= options.rmse_bound
            record(
                **row,
                status="ok" if ok else f"wrong: {name} relative RMSE {rmse:.2e}",
                rmse=rmse,
                worst_tensor=name,
                ms=fwd_ms if kernel == "forward" else bwd_ms,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=131072)
    parser.add_argument("--shape", default="qwen2.5-3b", choices=list(SHAPES))
    parser.add_argument("--sparsity", type=float, default=0.95)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--rmse-bound",
        type=float,
        default=5e-3,
        help="largest relative RMSE of out/dq/dk/dv against the current config",
    )
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument(
        "--deterministic", action="store_true", help="check and time every backward family on deterministic=True"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", type=Path, default=None)
    options = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_triton.py needs a CUDA device")
    if options.seq_len % 128 or options.seq_len < 1024:
        raise SystemExit(f"--seq-len={options.seq_len} must be a multiple of 128 and >= 1024")

    heads, kv_heads, dim = SHAPES[options.shape]
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(options.seed)
    q, k, v, dout = (
        torch.randn(1, options.seq_len, h, dim, generator=generator).to(device, torch.bfloat16)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "commit": git_commit(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": options.shape,
        "seq_len": options.seq_len,
        "heads_q": heads,
        "heads_kv": kv_heads,
        "head_dim": dim,
        "dtype": "bf16",
    }
    causal_fwd_flops = 4.0 * options.seq_len * (options.seq_len + 1) / 2 * heads * dim  # 4·d per (i ≥ j) entry
    rows = []

    def record(**fields) -> None:
        row = {**meta, **fields}
        if "ms" in row:
            flops = causal_fwd_flops * row["density"] * (1.0 if row["kernel"] == "forward" else 2.5)
            row["tflops_actual"] = flops / row["ms"] / 1e9
        rows.append(row)
        if options.jsonl:
            options.jsonl.parent.mkdir(parents=True, exist_ok=True)
            with open(options.jsonl, "a") as file:
                file.write(json.dumps(row) + "\n")
        config = row.get("config", {})
        print(
            f"{row['pattern']:8s} {row['kernel']:8s} warps={config.get('num_warps', '-')} "
            f"stages={config.get('num_stages', '-')}"
            + (f" rows={config['QUERY_ROWS']}" if "QUERY_ROWS" in config else "")
            + f"{' (current)' if row.get('current') else ''}: "
            f"{row.get('ms', float('nan')):9.2f} ms {row.get('tflops_actual', float('nan')):6.1f} TFLOP/s "
            f"{row['status']}",
            flush=True,
        )

    fwd_ms, bwd_ms = time_sdpa(
        SDPBackend.CUDNN_ATTENTION, q.detach(), k.detach(), v.detach(), dout, options.warmup, options.reps
    )
    record(pattern="dense", density=1.0, kernel="forward", config={"impl": "sdpa_cudnn"}, status="ok", ms=fwd_ms)
    record(pattern="dense", density=1.0, kernel="backward", config={"impl": "sdpa_cudnn"}, status="ok", ms=bwd_ms)

    dense_kernels = [kernel for kernel in options.kernels if kernel not in DETERMINISTIC_KERNELS]  # no bars
    if dense_kernels:
        v_idx, s_idx = full_index(1, heads, options.seq_len, device=device)
        index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, options.seq_len)
        sweep_pattern("dense", q, k, v, dout, index, 1.0, dense_kernels, options, record)
        del index
    v_idx, s_idx, _ = budget_pattern(1, heads, options.seq_len, options.sparsity, device, generator)
    index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, options.seq_len)
    sweep_pattern(
        f"sparse{options.sparsity:g}",
        q,
        k,
        v,
        dout,
        index,
        mask_density(v_idx, s_idx, options.seq_len),
        options.kernels,
        options,
        record,
    )

    print(
        "\n| pattern | kernel | config | ms | TFLOP/s (computed) | vs cuDNN | status |\n|---|---|---|---|---|---|---|"
    )
    cudnn = {row["kernel"]: row["tflops_actual"] for row in rows if row["config"].get("impl") == "sdpa_cudnn"}
    for row in rows:
        pass_of = "forward" if row["kernel"] == "forward" else "backward"  # key_major, bar_chunk: a backward
        share = f"{row['tflops_actual'] / cudnn[pass_of]:.0%}" if "tflops_actual" in row else "–"
        ms = f"{row['ms']:.2f}" if "ms" in row else "–"
        tflops = f"{row['tflops_actual']:.1f}" if "tflops_actual" in row else "–"
        config = ", ".join(f"{key}={value}" for key, value in row["config"].items())
        print(
            f"| {row['pattern']} | {row['kernel']} | {config}{' (current)' if row.get('current') else ''} | {ms} | "
            f"{tflops} | {share} | {row['status']} |"
        )


if __name__ == "__main__":
    main()
