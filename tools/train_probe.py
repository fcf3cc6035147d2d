"""Run the MTraining launcher and record every training iteration (for GPU tests and end-to-end benchmarks).

Use it in place of ``-m megatron_mtraining.pretrain``, with the same flags::

    MTRAINING_PROBE_DIR=/tmp/run torchrun --nproc-per-node 2 tools/train_probe.py <launcher flags>

Each rank writes one JSON object per training iteration to ``$MTRAINING_PROBE_DIR/rank<R>.jsonl``:

- ``iteration`` (1-based), ``iter_ms`` (wall time of Megatron's ``train_step``, CUDA-synchronised);
- ``loss`` and ``loss_hex`` (the token-averaged LM loss, exact bits; only on the last pipeline stage,
  else null), ``grad_norm`` and ``grad_norm_hex`` (null when Megatron skipped the step);
- ``grad_sha256``: a hash of this rank's gradient buffers (``main_grad`` in parameter order) after the step,
  only with ``MTRAINING_PROBE_HASH_GRADS=1`` (it copies every gradient to the host);
- ``mem_allocated``, ``mem_reserved``, ``max_mem_allocated``: CUDA bytes after the step (the maximum since
  the run started);
- with ``MTRAINING_PROBE_PROFILE_ITER=K``, iteration K also has ``kernel_ms`` (all GPU kernel time of the
  step, from ``torch.profiler``) and ``attention_kernel_ms`` (the core-attention kernels: MTraining's Triton
  kernels, SDPA's flash/cuDNN/efficient kernels).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

ATTENTION_KERNEL = re.compile(r"block_bar_forward|backward_kernel|flash|fmha|cudnn|sdpa|attention", re.IGNORECASE)


def _float_fields(name: str, value) -> dict:
    if value is None:
        return {name: None, f"{name}_hex": None}
    value = float(value)
    return {name: value, f"{name}_hex": value.hex()}


def _grad_sha256(model_chunks) -> str:
    digest = hashlib.sha256()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                digest.update(name.encode())
                digest.update(grad.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def _kernel_times(profile) -> tuple[float, float]:
    """(all kernels, attention kernels) GPU time in ms of a ``torch.profiler`` run."""
    total = attention = 0.0
    for event in profile.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        milliseconds = event.device_time / 1e3
        total += milliseconds
        if ATTENTION_KERNEL.search(event.name):
            attention += milliseconds
    return total, attention


class IterationRecorder:
    """Wraps Megatron's ``train_step`` and appends one record per iteration to this rank's JSONL file."""

    def __init__(self, train_step, out_dir: Path, hash_grads: bool, profile_iteration: int | None):
        self.train_step = train_step
        self.out_dir = out_dir
        self.hash_grads = hash_grads
        self.profile_iteration = profile_iteration

    def __call__(self, forward_step_func, data_iterator, model, *args, iteration=None, **kwargs):
        number = (iteration or 0) + 1
        profile = None
        if number == self.profile_iteration:
            profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profile.__enter__()
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = self.train_step(forward_step_func, data_iterator, model, *args, iteration=iteration, **kwargs)
        torch.cuda.synchronize()
        record = {"iteration": number, "iter_ms": (time.perf_counter() - start) * 1e3}
        if profile is not None:
            profile.__exit__(None, None, None)
            record["kernel_ms"], record["attention_kernel_ms"] = _kernel_times(profile)
        loss_dict, grad_norm = result[0], result[5]
        record.update(_float_fields("loss", loss_dict.get("lm loss")))
        record.update(_float_fields("grad_norm", grad_norm))
        if self.hash_grads:
            record["grad_sha256"] = _grad_sha256(model)
        record.update(
            mem_allocated=torch.cuda.memory_allocated(),
            mem_reserved=torch.cuda.memory_reserved(),
            max_mem_allocated=torch.cuda.max_memory_allocated(),
        )
        with open(self.out_dir / f"rank{dist.get_rank()}.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
        return result


def read_records(out_dir: str | os.PathLike, rank: int) -> list[dict]:
    """The records rank ``rank`` wrote under ``out_dir``, in iteration order."""
    lines = Path(out_dir, f"rank{rank}.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda record: record["iteration"])


def main() -> None:
    out_dir = os.environ.get("MTRAINING_PROBE_DIR")
    if not out_dir:
        raise SystemExit("tools/train_probe.py: set MTRAINING_PROBE_DIR to the folder for the per-rank records")
    profile_iteration = os.environ.get("MTRAINING_PROBE_PROFILE_ITER")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    import megatron.training.training as training

    from megatron_mtraining import pretrain

    training.train_step = IterationRecorder(
        training.train_step,
        Path(out_dir),
        os.environ.get("MTRAINING_PROBE_HASH_GRADS") == "1",
        int(profile_iteration) if profile_iteration else None,
    )
    pretrain.main()


if __name__ == "__main__":
    main()
