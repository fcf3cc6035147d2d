"""Quickstart: train a tiny Qwen2-shaped GPT with MTraining's sparse attention over a CP = 2 striped ring.

    python examples/quickstart.py            # or: make demo

* **Machine with GPUs:** runs the real launcher, ``torchrun -m megatron_mtraining.pretrain`` with the
  flags below, ``--mock-data`` and the Triton kernels; Megatron prints the loss, the launcher the
  MTraining metrics, every iteration.
* **CPU-only machine:** Megatron's ``pretrain`` needs CUDA, so two gloo processes run a minimal loop
  instead, around the same pieces: the same flags parsed and validated by Megatron and
  ``megatron_mtraining.arguments``, the same ``GPTModel`` built by the launcher's model config
  (MTraining layer spec, layout RoPE), Megatron's ``MockGPTDataset`` split into the striped layout by
  ``select_layout_positions``, and the same metrics. Kernels: ``torch_blocksparse``. One line per step
  with the loss, the attention density and the ring's worker/step imbalance; about a minute on 2 cores.

The model: 2 layers, hidden 256, 4 query heads in 2 KV groups of head dim 64, SwiGLU, RMSNorm
(eps 1e-6), QKV bias, RoPE base 1e6, tied embeddings (Qwen2's shape, scaled down), 4,096-token
sequences. The budget is top-P with a small cap so that the attention is visibly sparse at this length.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONTEXT_PARALLEL = 2
STEPS = 20

TINY_QWEN2 = [
    "--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "704", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "64",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear", "--add-qkv-bias",
    "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
    "--seq-length", "4096", "--max-position-embeddings", "4096",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--mock-data",
    "--micro-batch-size", "1", "--global-batch-size", "1",
    "--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0.0",
    "--clip-grad", "1.0", "--seed", "1234",
    "--context-parallel-size", str(CONTEXT_PARALLEL),
    "--mtraining-layout", "striped", "--mtraining-top-p", "0.9", "--mtraining-cap", "80",
    "--mtraining-sink-tokens", "16", "--mtraining-local-window", "64", "--mtraining-loss-chunk-size", "1024",
]
# without Transformer Engine, Megatron's local layers and no TE/Apex fusions
LOCAL_IMPL_FLAGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion",
                    "--no-rope-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion"]
GPU_FLAGS = ["--bf16", "--mtraining-kernel", "triton", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
             *([] if importlib.util.find_spec("transformer_engine") else LOCAL_IMPL_FLAGS)]
CPU_FLAGS = ["--mtraining-kernel", "torch_blocksparse", "--use-cpu-initialization", *LOCAL_IMPL_FLAGS]


# ------------------------------------------------------------------------------------------ GPU: the launcher
def run_launcher(steps: int) -> int:
    """``torchrun -m megatron_mtraining.pretrain`` on CONTEXT_PARALLEL GPUs; returns its exit code."""
    flags = [*TINY_QWEN2, *GPU_FLAGS, "--train-iters", str(steps)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={CONTEXT_PARALLEL}",
               "-m", "megatron_mtraining.pretrain", *flags]
    print(" ".join(command), flush=True)
    # Megatron asserts this setting for context parallelism on Hopper and older GPUs
    return subprocess.call(command, env=dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1"))


# ------------------------------------------------------------------------------------------ CPU: a minimal loop
def cpu_args(flags: list[str]) -> argparse.Namespace:
    """Megatron's parsed and validated arguments (``--mtraining-*`` included) for ``flags``, on a CPU.

    Megatron's ``validate_args`` asks the GPU for its architecture when CP > 1, so it validates the
    CP = 1 equivalent (nothing it derives depends on CP) and the CP size is put back afterwards.
    """
    from megatron.training.arguments import add_megatron_arguments, validate_args

    from megatron_mtraining.arguments import add_mtraining_args

    parser = add_mtraining_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(flags)
    cp = args.context_parallel_size
    args.rank, args.world_size, args.context_parallel_size = 0, 1, 1
    with contextlib.redirect_stdout(io.StringIO()):                 # Megatron prints every argument
        validate_args(args)
    args.world_size, args.context_parallel_size = cp, cp
    return args


@contextlib.contextmanager
def rope_tables_on_cpu():
    """Megatron's RoPE moves its frequencies to ``torch.cuda.current_device()`` on first use; keep them on the CPU."""
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = current_device


def train_on_cpu(steps: int, report=print, extra_flags: Sequence[str] = ()) -> list[dict]:
    """Train on this gloo process group (one rank per CP rank); returns one record per step on every rank.

    ``report(line)`` is called on rank 0 with one line per step; ``extra_flags`` are appended to the
    demo's flags (e.g. another ``--seed``).
    """
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import MockGPTDataset
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_mtraining.arguments import validate_mtraining_args
    from megatron_mtraining.chunked_loss import ChunkedLossOutputProcessor
    from megatron_mtraining.index_cache import assert_index_caches_empty
    from megatron_mtraining.layout import select_layout_positions
    from megatron_mtraining.pretrain import gather_step_metrics, gpt_dataset_config_from_args, mtraining_model_config

    args = cpu_args([*TINY_QWEN2, *CPU_FLAGS, "--train-iters", str(steps), *extra_flags])
    if dist.get_world_size() != args.context_parallel_size:
        raise ValueError(f"the CPU demo runs one process per CP rank: {args.context_parallel_size} processes, "
                         f"got {dist.get_world_size()}")
    mtraining = validate_mtraining_args(args)
    parallel_state.initialize_model_parallel(context_parallel_size=args.context_parallel_size)
    try:
        cp_group = parallel_state.get_context_parallel_group()
        layout = mtraining.layout_for(args.context_parallel_size)
        torch.manual_seed(args.seed)
        model_config = mtraining_model_config(args, mtraining)
        model = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())
        for hook in model_config.pre_wrap_hooks:
            (model,) = hook([model])
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_eps, weight_decay=args.weight_decay)
        output_processor = ChunkedLossOutputProcessor(args.mtraining_loss_chunk_size)
        dataset_config = gpt_dataset_config_from_args(args, build_tokenizer(args))
        dataset, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [steps, 0, 0], lambda: True,
                                                      dataset_config).build()
        records = []
        with rope_tables_on_cpu():
            for step in range(steps):
                started = time.perf_counter()
                sample = {key: value[None] for key, value in dataset[step].items()}
                local = select_layout_positions(sample, layout, dist.get_rank(cp_group))
                token_losses = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                                     output_processor=output_processor)
                sums = torch.stack([(token_losses * local["loss_mask"]).sum(), local["loss_mask"].sum()])
                totals = sums.detach().clone()
                dist.all_reduce(totals, group=cp_group)
                (sums[0] / totals[1]).backward()
                for param in model.parameters():                   # each CP rank holds its tokens' share
                    dist.all_reduce(param.grad, group=cp_group)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                assert_index_caches_empty([model])
                metrics = gather_step_metrics([model], args.num_layers, group=cp_group)
                record = {"step": step + 1, "loss": float(totals[0] / totals[1]), "density": metrics.mean_density,
                          "worker_imbalance": metrics.worker_imbalance, "step_imbalance": metrics.step_imbalance,
                          "seconds": time.perf_counter() - started}
                records.append(record)
                if dist.get_rank() == 0:
                    report(f"step {record['step']:3d}/{steps} | loss {record['loss']:.4f} | density "
                           f"{record['density']:.3f} | worker imbalance {record['worker_imbalance']:.3f} | step "
                           f"imbalance {record['step_imbalance']:.3f} | {record['seconds']:.1f} s")
        return records
    finally:
        parallel_state.destroy_model_parallel()


def _cpu_rank(rank: int, port: int, steps: int) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="megatron")           # Apex/TE fallbacks are expected on a CPU
    logging.getLogger("megatron").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=CONTEXT_PARALLEL, timeout=timedelta(minutes=5))
    try:
        train_on_cpu(steps, report=lambda line: print(line, flush=True))
    finally:
        dist.destroy_process_group()


def run_on_cpu(steps: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print(f"CPU demo: {CONTEXT_PARALLEL} gloo processes, CP = {CONTEXT_PARALLEL} (striped), sparse attention "
          f"(torch_blocksparse), {steps} steps", flush=True)
    mp.spawn(_cpu_rank, args=(port, steps), nprocs=CONTEXT_PARALLEL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps")
    parser.add_argument("--cpu", action="store_true", help="run the CPU loop even when GPUs are present")
    options = parser.parse_args()
    if options.steps < 1:
        parser.error(f"--steps={options.steps} must be >= 1")
    if torch.cuda.device_count() >= CONTEXT_PARALLEL and not options.cpu:
        sys.exit(run_launcher(options.steps))
    run_on_cpu(options.steps)


if __name__ == "__main__":
    main()
