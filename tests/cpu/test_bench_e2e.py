"""tools/bench_e2e.py without a GPU: FLOP formulas, the launcher commands it builds, result parsing, extrapolation,
failure handling, the time budget and the report.

The commands of ``--dry-run`` are read back by torchrun's parser and by Megatron's parser with
``add_mtraining_args``, then validated by :func:`validate_mtraining_args` (and, for one per variant, by Megatron's
own ``validate_args``), so a misspelt or inconsistent flag fails here. The training itself is replaced by a fake
``launch`` that writes the probe's records and the launcher's density line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tool_modules import load_tool

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))
bench = load_tool("bench_e2e")

# a tiny shape whose FLOPs are counted by hand below
TINY = bench.ModelShape("tiny", num_layers=3, hidden=4, ffn=8, heads=2, kv_heads=1, head_dim=2, vocab=10)
# Qwen2.5 HF configs (config.json values) and the parameter counts of their model cards
HF_CONFIGS = {
    "0.5b": dict(
        num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2
    ),
    "1.5b": dict(
        num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2
    ),
    "3b": dict(
        num_hidden_layers=36, hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2
    ),
}
MODEL_CARD_PARAMETERS = {"0.5b": 0.49e9, "1.5b": 1.54e9, "3b": 3.09e9}


def options(*argv: str) -> argparse.Namespace:
    return bench.parse_args(list(argv))


# ---------------------------------------------------------------------------------------- FLOPs
def test_flops_of_a_tiny_shape_by_hand():
    n = 6
    # QKV 2·6·4·(2·2 + 2·1·2) = 384; output projection 2·6·4·4 = 192; SwiGLU 3 x 2·6·4·8 = 1152
    assert bench.layer_linear_flops(TINY, n) == 384 + 192 + 1152
    # causal attention: half of 4·N²·Hq·d = 2·36·2·2 = 288, scaled by the density
    assert bench.layer_attention_flops(TINY, n) == 288
    assert bench.layer_attention_flops(TINY, n, density=0.25) == 72
    assert bench.output_layer_flops(TINY, n) == 2 * 6 * 4 * 10 == 480
    # forward = 3 layers x (1728 + 288) + 480 = 6528; model FLOPs = 3 x forward
    assert bench.iteration_flops(TINY, n, 3) == 3 * 6528 == 19584
    # density 0.5: attention 144 per layer, forward 3 x 1872 + 480 = 6096
    assert bench.iteration_flops(TINY, n, 3, density=0.5) == 3 * 6096
    # full recompute runs each layer's forward again (3 x 2016), the chunked loss the output layer's (480)
    assert bench.iteration_flops(TINY, n, 3, recompute_layers=True) == 19584 + 6048
    assert bench.iteration_flops(TINY, n, 3, recompute_output=True) == 19584 + 480
    # with the attention output kept the recomputation skips attention's 288 per layer
    assert bench.iteration_flops(TINY, n, 3, recompute_layers=True, recompute_attention=False) == 19584 + 3 * 1728
    assert bench.iteration_flops(TINY, n, 2) == 3 * (2 * 2016 + 480)
    # packed documents: the attention over the document-causal area, here half the causal one (two of 3 tokens)
    assert bench.layer_attention_flops(TINY, n, area=0.5) == 144
    assert bench.layer_attention_flops(TINY, n, density=0.5, area=0.5) == 72
    assert bench.iteration_flops(TINY, n, 3, area=0.5) == 3 * (3 * (1728 + 144) + 480)


@pytest.mark.parametrize("name", list(bench.QWEN25))
def test_matmul_flops_are_six_flops_per_parameter_and_token(name):
    """Without attention, model FLOPs are 6 x (matrix parameters, the tied output layer included) per token,
    which is the model card's parameter count up to the norms and QKV biases."""
    shape = bench.QWEN25[name]
    tokens = 4096
    per_token = bench.iteration_flops(shape, tokens, shape.num_layers, density=0.0) / (6 * tokens)
    assert per_token == pytest.approx(MODEL_CARD_PARAMETERS[name], rel=0.01)


def test_attention_dominates_qwen25_3b_at_512k():
    """DESIGN.md §7: attention is about 94 % of Qwen2.5-3B's model FLOPs at 512K (here 93 %: the output layer
    is counted too), which caps the gain of 95 % sparsity near 9x."""
    shape, n = bench.QWEN25["3b"], 524288
    total = bench.iteration_flops(shape, n, shape.num_layers)
    attention = 3 * shape.num_layers * bench.layer_attention_flops(shape, n)
    assert 0.92 < attention / total < 0.95
    assert 8 < total / bench.iteration_flops(shape, n, shape.num_layers, density=0.05) < 9


def test_throughput_by_hand():
    n, iter_ms, gpus, peak = 6, 2.0, 2, 1e-9  # peak in TFLOP/s, tiny so that the MFU is readable
    result = bench.throughput(
        TINY, n, iter_ms, density=0.5, gpus=gpus, peak_tflops=peak, recompute="full", loss_chunked=True
    )
    assert result["tokens_per_s"] == pytest.approx(6 / 0.002)
    dense = 19584 / 2 / 0.002 / 1e12
    actual = 3 * 6096 / 2 / 0.002 / 1e12
    hardware = (3 * 6096 + 3 * 1872 + 480) / 2 / 0.002 / 1e12
    assert result["tflops_per_gpu_dense_equiv"] == pytest.approx(dense)
    assert result["tflops_per_gpu_actual"] == pytest.approx(actual)
    assert result["tflops_per_gpu_hardware"] == pytest.approx(hardware)
    assert result["mfu_dense_equiv"] == pytest.approx(dense / peak)
    assert result["mfu_actual"] == pytest.approx(actual / peak)


def test_h200_peak_is_the_default():
    assert bench.H200_BF16_PEAK_TFLOPS == 989.0 and options().peak_tflops == 989.0
    assert options("--peak-tflops", "500").peak_tflops == 500


# ---------------------------------------------------------------------------------------- commands
@pytest.fixture(scope="module")
def megatron_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from megatron_mtraining.arguments import add_mtraining_args

    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    add_megatron_arguments(parser)
    return add_mtraining_args(parser)


def dry_run_commands(*argv: str) -> list[tuple[str, dict[str, str], argparse.Namespace]]:
    """(comment, environment, torchrun's parsed arguments) of every command ``--dry-run`` prints."""
    from torch.distributed.run import get_args_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main(["--dry-run", *argv])
    lines = [line for line in out.getvalue().splitlines() if not line.startswith("# dataset ")]
    assert lines[-1].startswith("# estimated total")
    runs = []
    for comment, line in zip(lines[:-1:2], lines[1:-1:2]):
        assert comment.startswith("# qwen2.5-"), comment
        words = shlex.split(line)
        start = words.index(sys.executable)
        env = dict(word.split("=", 1) for word in words[:start])
        assert words[start + 1 : start + 3] == ["-m", "torch.distributed.run"], line
        runs.append((comment, env, get_args_parser().parse_args(words[start + 3 :])))
    return runs


def launcher_args(parser, torchrun: argparse.Namespace) -> argparse.Namespace:
    from megatron_mtraining.arguments import validate_mtraining_args

    assert (torchrun.module, torchrun.training_script) == (False, bench.PROBE)
    args = parser.parse_args(torchrun.training_script_args)
    validate_mtraining_args(args)
    return args


def test_kept_attention_output_mode_reaches_the_launcher(megatron_parser):
    runs = dry_run_commands(
        "--models",
        "0.5b",
        "--seq-lens",
        "131072",
        "--variants",
        "mtraining-static,dense",
        "--recompute",
        bench.KEEP_ATTENTION,
    )
    assert len(runs) == 2 * 2
    for _, _, torchrun in runs:
        args = launcher_args(megatron_parser, torchrun)
        assert args.recompute_granularity == "full" and args.mtraining_keep_attention_output


def test_default_dry_run_commands_are_accepted_by_the_launcher(megatron_parser):
    """The default matrix: 3 models x 3 lengths x 4 variants x 2 layer counts; every command parses and validates."""
    runs = dry_run_commands()
    assert len(runs) == 3 * 3 * len(bench.VARIANT_KEYS) * 2 == 90
    seen = set()
    for comment, env, torchrun in runs:
        assert torchrun.nproc_per_node == "2" and torchrun.standalone
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        args = launcher_args(megatron_parser, torchrun)
        name = comment.split(",")[0][2:]
        model = bench.QWEN25[name.split("_")[0].removeprefix("qwen2.5-")]
        assert args.num_layers in (2, 4) and f"_L{args.num_layers}" in env["MTRAINING_PROBE_DIR"]
        assert (
            args.hidden_size,
            args.ffn_hidden_size,
            args.num_attention_heads,
            args.num_query_groups,
            args.kv_channels,
        ) == (model.hidden, model.ffn, model.heads, model.kv_heads, model.head_dim)
        assert args.seq_length == args.max_position_embeddings and args.seq_length in (131072, 262144, 524288)
        assert (args.context_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (
            2,
            1,
            1,
        )
        assert args.bf16 and args.mock_data and args.transformer_impl == "local"
        assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "uniform", 1)
        assert args.mtraining_loss_chunk_size == 8192
        assert args.rotary_base == bench.ROTARY_BASE and args.hidden_dropout == 0.0
        assert (args.micro_batch_size, args.global_batch_size) == (1, 1)
        schedule_iters = int(env["MTRAINING_PROBE_PROFILE_ITER"])
        if args.mtraining_dense:
            assert args.mtraining_stats_interval == 0 and args.train_iters == schedule_iters == 6
        else:
            assert args.mtraining_stats_interval == args.train_iters == schedule_iters + 1 == 7
            assert args.mtraining_backend == "triton"
        seen.add(
            (
                args.mtraining_dense,
                args.mtraining_layout,
                args.mtraining_budget,
                args.mtraining_top_p,
                args.mtraining_sparsity,
            )
        )
    assert {
        (False, "striped", "top-p", 0.9, None),
        (False, "striped", "static", None, 0.95),
        (False, "zigzag", "top-p", 0.9, None),
        (False, "zigzag", "static", None, 0.95),
    } <= seen


@pytest.mark.parametrize("kernel", bench.DENSE_KERNELS)
def test_dense_baseline_commands(megatron_parser, kernel):
    (comment, _, torchrun), *_ = dry_run_commands(
        "--variants", "dense", "--dense-kernel", kernel, "--models", "3b", "--seq-lens", "524288"
    )
    assert f"dense-{kernel}" in comment
    args = launcher_args(megatron_parser, torchrun)
    assert args.mtraining_dense and args.mtraining_dense_impl == ("mtraining" if kernel == "triton" else kernel)
    assert kernel != "triton" or args.mtraining_backend == "triton"
    assert args.mtraining_layout == ("striped" if kernel == "triton" else "zigzag")


ONE_GPU_MIXTURES = (
    "--cp",
    "1",
    "--models",
    "0.5b",
    "--seq-lens",
    "65536",
    "--mixtures",
    "none,prolong,uniform4k",
    "--variants",
    "dense,mtraining-static,mtraining",
    "--layers",
    "1,2",
)


def test_one_gpu_mixture_commands(megatron_parser, capsys):
    """CP = 1 on three mixtures: one process, no ring; unpacked runs on mock data with the cuDNN dense baseline,
    packed ones on their dataset with the document flags and our dense kernels as the baseline (same mask)."""
    runs = dry_run_commands(*ONE_GPU_MIXTURES)
    assert len(runs) == 3 * 3 * 2
    seen = set()
    for comment, env, torchrun in runs:
        assert torchrun.nproc_per_node == "1"
        args = launcher_args(megatron_parser, torchrun)
        assert args.context_parallel_size == 1 and args.seq_length == 65536
        mixture = next((m for m in ("prolong", "uniform4k") if f"_64k_{m}_" in comment), "none")
        if mixture == "none":
            assert args.mock_data and args.data_path is None
            assert not (args.reset_attention_mask or args.reset_position_ids or args.eod_mask_loss)
        else:
            assert not args.mock_data and args.split == "100,0,0"
            assert args.data_path == [f"/tmp/bench_e2e/<run>/datasets/{mixture}_65536_v151936"]
            assert args.reset_attention_mask and args.reset_position_ids and args.eod_mask_loss
            assert not args.apply_rope_fusion  # --reset-position-ids needs unfused RoPE
        if args.mtraining_dense:
            kernel, impl = ("sdpa_cudnn", "sdpa_cudnn") if mixture == "none" else ("triton", "mtraining")
            assert args.mtraining_dense_impl == impl and f"_dense-{kernel}," in comment
            assert impl != "mtraining" or args.mtraining_backend == "triton"
        budget = None if args.mtraining_dense else (args.mtraining_top_p, args.mtraining_sparsity)
        seen.add((mixture, budget))
    assert seen == {(m, b) for m in ("none", "prolong", "uniform4k") for b in (None, (0.9, None), (None, 0.95))}


def test_dry_run_lists_each_packed_dataset_with_its_documents(capsys):
    from packed_dataset import mixture_lengths

    bench.main(["--dry-run", *ONE_GPU_MIXTURES, "--warmup", "1", "--iters", "2"])  # 5 iterations: 6 sequences
    datasets = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# dataset ")]
    assert datasets == [
        f"# dataset /tmp/bench_e2e/<run>/datasets/{m}_65536_v151936: 6 sequences, documents {mixture_lengths(m, 65536)}"
        for m in ("prolong", "uniform4k")
    ]


def test_dense_kernel_default_follows_the_mixture():
    opts = options("--mixtures", "none,single", "--variants", "dense", "--models", "0.5b", "--seq-lens", "131072")
    unpacked, single = bench.configurations(opts)
    assert (unpacked.variant.dense_kernel, unpacked.variant.layout, unpacked.mixture) == (
        "sdpa_cudnn",
        "zigzag",
        "none",
    )
    assert (single.variant.dense_kernel, single.variant.layout, single.document_lengths) == (
        "triton",
        "striped",
        (131072,),
    )
    assert single.name == "qwen2.5-0.5b_128k_single_dense-triton" and single.mask_area == 1.0
    triton = options("--mixtures", "none,prolong", "--variants", "dense", "--dense-kernel", "triton")
    assert {c.variant.dense_kernel for c in bench.configurations(triton)} == {"triton"}
    with pytest.raises(ValueError, match="needs document lengths"):
        bench.Config(bench.QWEN25["0.5b"], 8, bench.dense_variant("triton"), "prolong")
    with pytest.raises(ValueError, match="sum to 7"):
        bench.Config(bench.QWEN25["0.5b"], 8, bench.dense_variant("triton"), "prolong", (3, 4))


@pytest.mark.parametrize("variant", ["mtraining", "dense"])
def test_megatron_validates_packed_one_gpu_runs(variant, tmp_path):
    """Megatron's own ``validate_args`` accepts a packed run at CP = 1 (data path, document flags, bf16)."""
    from quickstart import cpu_args

    opts = options("--cp", "1", "--mixtures", "prolong", "--min-sparse-length", "2048")
    config = bench.Config(bench.QWEN25["0.5b"], 65536, bench.variant_for(variant, "triton"), "prolong", (32768, 32768))
    args = cpu_args(bench.launcher_flags(config, 2, bench.Schedule(1, 2, log_density=True), opts, tmp_path))
    assert args.context_parallel_size == 1 and args.reset_attention_mask and args.mtraining_min_sparse_length == 2048
    assert args.data_path == [str(tmp_path / "datasets" / "prolong_65536_v151936")]


@pytest.mark.parametrize(
    "variant", ["mtraining", "mtraining-static", "mtraining-zigzag", "mtraining-zigzag-static", "dense"]
)
def test_megatron_validates_each_variant(variant):
    """Megatron's own ``validate_args`` (as the launcher runs it) accepts the flags: bf16, recompute, CP."""
    import torch
    from quickstart import cpu_args

    config = bench.Config(bench.QWEN25["3b"], 524288, bench.variant_for(variant, "sdpa_cudnn"))
    schedule = bench.Schedule(2, 3, log_density=config.variant.sparse)
    args = cpu_args(bench.launcher_flags(config, 4, schedule, options()))
    assert args.context_parallel_size == 2 and args.params_dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(bench.QWEN25))
def test_model_flags_are_the_qwen25_architecture(megatron_parser, name):
    """The flags of each shape describe the same Qwen2 architecture as the model's HF config (converter's reading)."""
    import dataclasses

    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    from megatron_mtraining.conversion.architecture import QwenArchitecture

    shape = bench.QWEN25[name]
    config = bench.Config(shape, 131072, bench.SPARSE_VARIANTS["mtraining"])
    args = megatron_parser.parse_args(
        bench.launcher_flags(config, shape.num_layers, bench.Schedule(1, 1, True), options())
    )
    args.rank = 0
    args.padded_vocab_size = vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)
    hf = {
        "model_type": "qwen2",
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        **HF_CONFIGS[name],
    }
    expected = dataclasses.replace(
        QwenArchitecture.from_hf_config(hf), rotary_base=bench.ROTARY_BASE, max_position_embeddings=131072
    )
    assert QwenArchitecture.from_megatron_args(args) == expected
    assert shape.vocab == args.padded_vocab_size and shape.head_dim == expected.kv_channels


def test_untied_shape_adds_the_flag(megatron_parser):
    untied = bench.ModelShape("untied", 2, 256, 512, 4, 2, 64, tied=False)
    assert "--untie-embeddings-and-output-weights" in untied.flags(2)
    assert "--untie-embeddings-and-output-weights" not in bench.QWEN25["3b"].flags(2)


def test_full_depth_dry_run_times_the_real_layer_count(megatron_parser):
    runs = dry_run_commands("--full-depth", "--models", "3b", "--seq-lens", "524288", "--variants", "mtraining")
    assert len(runs) == 1
    assert launcher_args(megatron_parser, runs[0][2]).num_layers == 36


def test_local_impl_flags_match_the_quickstart():
    from quickstart import LOCAL_IMPL_FLAGS

    assert bench.LOCAL_IMPL_FLAGS == tuple(LOCAL_IMPL_FLAGS)


def test_schedule_iteration_numbers():
    schedule = bench.Schedule(warmup=2, iters=3, log_density=True)
    assert list(schedule.timed) == [3, 4, 5]
    assert (schedule.profile_iteration, schedule.density_iteration, schedule.train_iters) == (6, 7, 7)
    dense = bench.Schedule(warmup=1, iters=4, log_density=False)
    assert (list(dense.timed), dense.profile_iteration, dense.density_iteration, dense.train_iters) == (
        [2, 3, 4, 5],
        6,
        None,
        6,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "7b"], "--models"),
        (["--variants", "sparse"], "--variants"),
        (["--layers", "4"], "two distinct"),
        (["--layers", "2,30"], "exceed the depth"),
        (["--seq-lens", "131072,131072"], "twice"),
        (["--iters", "0"], "--iters"),
        (["--dense-kernel", "fa3"], "--dense-kernel"),
        (["--seq-lens", "128k"], "integers"),
        (["--run-timeout-s", "0"], "--run-timeout-s"),
        (["--dry-run", "--plot-only"], "not allowed with"),
        (["--mixtures", "books"], "--mixtures: ['books'] unknown"),
        (["--mixtures", "none,none"], "twice"),
        (["--mixtures", "prolong", "--dense-kernel", "sdpa_cudnn"], "has no document mask"),
        (["--min-sparse-length", "0"], "--min-sparse-length"),
    ],
)
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err


def test_unknown_variant_and_kernel_raise():
    with pytest.raises(ValueError, match="--dense-kernel='fa3'"):
        bench.dense_variant("fa3")
    with pytest.raises(ValueError, match="'sparse' is unknown"):
        bench.variant_for("sparse", "triton")


# ---------------------------------------------------------------------------------------- parsing results
LOG = """ [2026-12-01] iteration        6/       7 | elapsed time per iteration (ms): 812.3 | lm loss: 1.2E+01
 mtraining | iteration        7 | density 0.0731 | worker imbalance 1.002 | step imbalance 1.010 | index time 12.5 ms
"""


def test_parse_density():
    assert bench.parse_density(LOG, 7) == 0.0731
    with pytest.raises(ValueError, match="iteration 6 | density"):
        bench.parse_density(LOG, 6)


@pytest.mark.parametrize(
    "log, timed_out, expected",
    [
        (
            "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n",
            False,
            "CUDA out of memory",
        ),
        ("", True, "timed out after 600 s (killed)"),
        (
            "Traceback (most recent call last):\n[rank0]: ValueError: --mtraining-cap=10 is smaller\n"
            "[rank1]: RuntimeError: NCCL communicator was aborted\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
            False,
            "exit code 1: ValueError: --mtraining-cap=10 is smaller",
        ),
        ("Segmentation fault\n", False, "exit code 1"),
    ],
)
def test_failure_reason(log, timed_out, expected):
    assert bench.failure_reason(1, timed_out, 600, log) == expected


def fake_records(schedule: bench.Schedule, layers: int, rank: int, fixed_ms=100.0, per_layer_ms=50.0) -> list[dict]:
    """Probe records: the timed iterations' times vary around fixed + per_layer x L (rank 1 slower by 1 ms)."""
    records = []
    for number in range(1, schedule.train_iters + 1):
        iter_ms = fixed_ms + per_layer_ms * layers + rank + (number % 3) - 1
        if number <= schedule.warmup:
            iter_ms += 5000  # compilation: must not count
        record = {
            "iteration": number,
            "iter_ms": iter_ms,
            "max_mem_allocated": (10 + layers + rank) * 10**9,
            "mem_reserved": (12 + layers + rank - number % 2) * 10**9,
        }
        if number == schedule.profile_iteration:
            iter_ms += 300  # profiler overhead: must not count
            record.update(
                iter_ms=iter_ms, kernel_ms=80.0 + 40.0 * layers + rank, attention_kernel_ms=30.0 * layers + rank
            )
        records.append(record)
    return records


def test_summarize_point_takes_the_median_of_the_slowest_rank():
    schedule = bench.Schedule(warmup=2, iters=3, log_density=True)
    records = {rank: fake_records(schedule, 4, rank) for rank in (0, 1)}
    point = bench.summarize_point(records, schedule, 4, density=0.07)
    # timed iterations 3, 4, 5 on rank 1: 300 + 1 + (0, 1, 2) - 1
    assert point["iter_ms_timed"] == [300.0, 301.0, 302.0] and point["iter_ms"] == 301.0
    assert point["kernel_ms"] == 240.5 and point["attention_kernel_ms"] == 120.5
    assert point["attention_share"] == pytest.approx(120.5 / 240.5)
    assert point["peak_mem_gb"] == 15.0 and point["reserved_mem_gb"] == 17.0
    assert point["density"] == 0.07 and point["layers"] == 4
    del records[1][4]
    with pytest.raises(ValueError, match=r"iterations \[5\]"):
        bench.summarize_point(records, schedule, 4, density=0.07)


def test_fit_line_is_least_squares():
    assert bench.fit_line([2, 4], [200.0, 300.0]) == (100.0, 50.0)
    intercept, slope = bench.fit_line([1, 2, 3], [1.0, 2.0, 2.0])
    assert (intercept, slope) == pytest.approx((2 / 3, 0.5))
    with pytest.raises(ValueError, match="two distinct"):
        bench.fit_line([2, 2], [1.0, 2.0])


def point(layers: int, iter_ms: float, kernel_ms: float, attention_ms: float) -> dict:
    return {
        "layers": layers,
        "iter_ms": iter_ms,
        "kernel_ms": kernel_ms,
        "attention_kernel_ms": attention_ms,
        "attention_share": attention_ms / kernel_ms,
        "density": 1.0,
        "peak_mem_gb": 1.0,
    }


def test_extrapolate_to_full_depth():
    result = bench.extrapolate([point(2, 200.0, 180.0, 60.0), point(4, 300.0, 260.0, 120.0)], 36)
    assert result["iter_ms"] == pytest.approx(100 + 50 * 36)
    assert result["fit"] == pytest.approx({"fixed_ms": 100.0, "per_layer_ms": 50.0})
    assert result["attention_share"] == pytest.approx(30 * 36 / (100 + 40 * 36))
    single = bench.extrapolate([point(36, 2000.0, 1800.0, 900.0)], 36)
    assert (single["iter_ms"], single["attention_share"], single["fit"]) == (2000.0, 0.5, None)
    with pytest.raises(ValueError, match="does not grow"):
        bench.extrapolate([point(2, 300.0, 1.0, 1.0), point(4, 290.0, 1.0, 1.0)], 36)
    with pytest.raises(ValueError, match="cannot be extrapolated"):
        bench.extrapolate([point(4, 300.0, 1.0, 1.0)], 36)


# ---------------------------------------------------------------------------------------- running (fake launcher)
REQUIRED_FIELDS = {
    "gpu",
    "commit",
    "date",
    "model",
    "seq_len",
    "tp",
    "cp",
    "pp",
    "attention",
    "sparsity_setting",
    "iter_ms",
    "tokens_per_s",
    "tflops_per_gpu_dense_equiv",
    "mfu_dense_equiv",
    "peak_mem_gb",
    "dense_kernel",
    "layers_timed",
    "extrapolated",
    "density",
    "attention_share",
    "command",
}
META = {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2026-12-01T00:00:00+00:00", "torch": "2.11.0"}


class FakeLauncher:
    """Stands in for :func:`bench_e2e.launch`: writes the probe records and the launcher's output of one run."""

    def __init__(self, density=0.0731, fail_at_layers=None, failure_log="", timed_out=False):
        self.density, self.fail_at_layers, self.failure_log, self.timed_out = (
            density,
            fail_at_layers,
            failure_log,
            timed_out,
        )
        self.calls = []

    def __call__(self, command, env, log_path, timeout_s):
        flags = command[command.index(bench.PROBE) + 1 :]
        layers = int(flags[flags.index("--num-layers") + 1])
        stats_iteration = int(flags[flags.index("--mtraining-stats-interval") + 1])
        self.calls.append((layers, timeout_s, env))
        if layers == self.fail_at_layers:
            log_path.write_text(self.failure_log)
            return (None if self.timed_out else 1), self.timed_out
        profile = int(env["MTRAINING_PROBE_PROFILE_ITER"])
        schedule = bench.Schedule(warmup=profile - 4, iters=3, log_density=stats_iteration > 0)
        assert schedule.profile_iteration == profile
        for rank in (0, 1):
            with open(Path(env["MTRAINING_PROBE_DIR"], f"rank{rank}.jsonl"), "w") as file:
                for record in fake_records(schedule, layers, rank):
                    file.write(json.dumps(record) + "\n")
        log = (
            ""
            if stats_iteration == 0
            else (f" mtraining | iteration {stats_iteration:8d} | density {self.density:.4f} | worker imbalance 1.0\n")
        )
        log_path.write_text(log)
        return 0, False


def test_measured_row_extrapolates_and_has_every_field(monkeypatch, tmp_path):
    fake = FakeLauncher()
    monkeypatch.setattr(bench, "launch", fake)
    opts = options("--warmup", "1", "--iters", "3")
    config = bench.Config(bench.QWEN25["3b"], 524288, bench.SPARSE_VARIANTS["mtraining"])
    row = bench.measure_config(config, opts, META, tmp_path, deadline=None)
    assert row["status"] == "ok", row.get("error")
    assert REQUIRED_FIELDS <= set(row)
    assert [layers for layers, _, _ in fake.calls] == [2, 4]
    assert row["layers_timed"] == [2, 4] and row["extrapolated"] and row["num_layers"] == 36
    # median of rank 1's timed iterations is 100 + 50 L + 1 (+0): the fit is 101 + 50 L
    assert row["fit"] == pytest.approx({"fixed_ms": 101.0, "per_layer_ms": 50.0})
    assert row["iter_ms"] == pytest.approx(101 + 50 * 36)
    assert row["tokens_per_s"] == pytest.approx(524288 / (row["iter_ms"] / 1e3))
    assert row["density"] == 0.0731 and [p["density"] for p in row["points"]] == [0.0731, 0.0731]
    shape = bench.QWEN25["3b"]
    dense_flops = bench.iteration_flops(shape, 524288, 36)
    assert row["tflops_per_gpu_dense_equiv"] == pytest.approx(dense_flops / 2 / (row["iter_ms"] / 1e3) / 1e12)
    assert row["mfu_dense_equiv"] == pytest.approx(row["tflops_per_gpu_dense_equiv"] / 989)
    assert row["tflops_per_gpu_actual"] < row["tflops_per_gpu_hardware"] < row["tflops_per_gpu_dense_equiv"]
    assert (row["peak_mem_gb"], row["reserved_mem_gb"], row["peak_mem_layers"]) == (15.0, 17.0, 4)  # deepest run
    assert row["attention_share"] == pytest.approx((0.5 + 30 * 36) / (80.5 + 40 * 36))
    assert (row["attention"], row["sparsity_setting"], row["dense_kernel"], row["layout"]) == (
        "mtraining",
        "top_p=0.9",
        None,
        "striped",
    )
    assert (row["tp"], row["cp"], row["pp"], row["recompute"]) == (1, 2, 1, "full")
    assert len(row["command"]) == 2 and "--num-layers 4" in row["command"][1]
    assert "MTRAINING_PROBE_PROFILE_ITER=5" in row["command"][0]
    json.dumps(row)  # a JSON object


def test_dense_row_has_density_one_and_its_kernel(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "launch", FakeLauncher())
    config = bench.Config(bench.QWEN25["0.5b"], 131072, bench.dense_variant("sdpa_cudnn"))
    row = bench.measure_config(config, options(), META, tmp_path, deadline=None)
    assert row["status"] == "ok" and row["density"] == 1.0
    assert row["tflops_per_gpu_actual"] == pytest.approx(row["tflops_per_gpu_dense_equiv"])
    assert (row["attention"], row["sparsity_setting"], row["dense_kernel"], row["layout"]) == (
        "dense",
        "dense",
        "sdpa_cudnn",
        "zigzag",
    )


def test_oom_is_recorded_with_the_points_measured_before(monkeypatch, tmp_path):
    fake = FakeLauncher(fail_at_layers=4, failure_log="[rank0]: torch.OutOfMemoryError: CUDA out of memory.\n")
    monkeypatch.setattr(bench, "launch", fake)
    config = bench.Config(bench.QWEN25["3b"], 524288, bench.dense_variant("triton"))
    row = bench.measure_config(config, options(), META, tmp_path, deadline=None)
    assert row["status"] == "failed" and row["error"] == "4 layers: CUDA out of memory"
    assert row["iter_ms"] is None and row["tokens_per_s"] is None
    assert [p["layers"] for p in row["points"]] == [2] and len(row["command"]) == 2
    assert {"gpu", "commit", "model", "seq_len", "attention", "command", "layers_timed"} <= set(row)


def test_first_failure_stops_the_configuration(monkeypatch, tmp_path):
    fake = FakeLauncher(fail_at_layers=2, timed_out=True)
    monkeypatch.setattr(bench, "launch", fake)
    config = bench.Config(bench.QWEN25["3b"], 524288, bench.SPARSE_VARIANTS["mtraining-zigzag"])
    row = bench.measure_config(config, options("--run-timeout-s", "42"), META, tmp_path, deadline=None)
    assert [layers for layers, _, _ in fake.calls] == [2]
    assert row["error"] == "2 layers: timed out after 42 s (killed)" and row["points"] == []


def test_missing_density_line_fails_the_configuration(monkeypatch, tmp_path):
    class NoDensity(FakeLauncher):
        def __call__(self, command, env, log_path, timeout_s):
            result = super().__call__(command, env, log_path, timeout_s)
            log_path.write_text("")
            return result

    monkeypatch.setattr(bench, "launch", NoDensity())
    config = bench.Config(bench.QWEN25["0.5b"], 131072, bench.SPARSE_VARIANTS["mtraining"])
    row = bench.measure_config(config, options(), META, tmp_path, deadline=None)
    assert row["status"] == "failed" and "no ' mtraining | iteration 7 | density' line" in row["error"]


def test_run_timeout_is_capped_by_the_time_budget(monkeypatch, tmp_path):
    fake = FakeLauncher()
    monkeypatch.setattr(bench, "launch", fake)
    config = bench.Config(bench.QWEN25["0.5b"], 131072, bench.SPARSE_VARIANTS["mtraining"])
    bench.measure_config(config, options(), META, tmp_path, deadline=time.monotonic() + 100)
    assert all(timeout <= 100 for _, timeout, _ in fake.calls)
    bench.measure_config(config, options("--run-timeout-s", "30"), META, tmp_path / "again", deadline=None)
    assert fake.calls[-1][1] == 30


def test_run_matrix_skips_what_does_not_fit_the_budget(monkeypatch, tmp_path, capsys):
    fake = FakeLauncher()
    monkeypatch.setattr(bench, "launch", fake)
    monkeypatch.setattr(bench, "gpu_name", lambda cp: "NVIDIA H200")
    jsonl = tmp_path / "e2e.jsonl"
    argv = [
        "--models",
        "0.5b,3b",
        "--seq-lens",
        "131072",
        "--variants",
        "mtraining,dense",
        "--dense-kernel",
        "triton",
        "--jsonl",
        str(jsonl),
        "--plot",
        str(tmp_path / "chart.png"),
        "--out-dir",
        str(tmp_path / "runs"),
        "--commit",
        "abc1234",
        "--startup-s",
        "10",
    ]
    opts = options(*argv)
    small = bench.config_estimate_s(
        bench.Config(bench.QWEN25["0.5b"], 131072, bench.SPARSE_VARIANTS["mtraining"]), opts
    )
    dense_3b = bench.config_estimate_s(bench.Config(bench.QWEN25["3b"], 131072, bench.dense_variant("triton")), opts)
    assert small < dense_3b
    bench.main([*argv, "--time-budget-s", str(dense_3b - 1)])  # the 3B dense estimate no longer fits
    output = capsys.readouterr().out
    rows = bench.read_jsonl(jsonl)
    assert [(row["model"], row["attention"]) for row in rows] == [
        ("qwen2.5-0.5b", "mtraining"),
        ("qwen2.5-0.5b", "dense"),
        ("qwen2.5-3b", "mtraining"),
    ]
    assert all(row["status"] == "ok" and row["commit"] == "abc1234" for row in rows)
    assert "skipped: qwen2.5-3b_128k_dense-triton: estimated" in output
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_gpu_mixture_matrix_writes_datasets_and_rows(monkeypatch, tmp_path, capsys):
    """CP = 1 on mock data and a packed mixture, trained by the fake launcher: the packed runs read a dataset
    written before them, the rows carry their mixture and its mask area, each sparse row is compared with the
    dense row of its own mixture, and the chart's lines say the mixture."""
    from packed_dataset import mask_area, mixture_lengths, read_document_lengths

    fake = FakeLauncher()
    monkeypatch.setattr(bench, "launch", fake)
    monkeypatch.setattr(bench, "gpu_name", lambda cp: "NVIDIA H200")
    jsonl, chart = tmp_path / "e2e.jsonl", tmp_path / "chart.png"
    argv = ["--cp", "1", "--models", "0.5b", "--seq-lens", "65536", "--mixtures", "none,prolong"]
    argv += ["--variants", "mtraining-static,dense", "--warmup", "1", "--iters", "3", "--commit", "abc1234"]
    bench.main([*argv, "--jsonl", str(jsonl), "--plot", str(chart), "--out-dir", str(tmp_path / "runs")])
    output = capsys.readouterr().out
    rows = bench.read_jsonl(jsonl)
    assert [(r["mixture"], r["attention"], r["dense_kernel"]) for r in rows] == [
        ("none", "mtraining", None),
        ("none", "dense", "sdpa_cudnn"),
        ("prolong", "mtraining", None),
        ("prolong", "dense", "triton"),
    ]
    lengths = mixture_lengths("prolong", 65536)
    for r in rows:
        assert r["status"] == "ok" and r["cp"] == 1 and len(r["command"]) == 2
        packed = r["mixture"] == "prolong"
        assert r["data"] == ("packed" if packed else "mock")
        assert r["document_lengths"] == (lengths if packed else None)
        assert r["mask_area"] == (mask_area(lengths) if packed else 1.0) and (r["mask_area"] < 0.5) == packed
        dense_flops = bench.iteration_flops(bench.QWEN25["0.5b"], 65536, 24, area=r["mask_area"])
        assert r["tflops_per_gpu_dense_equiv"] == pytest.approx(dense_flops / (r["iter_ms"] / 1e3) / 1e12)
        assert ("--reset-attention-mask" in r["command"][0]) == packed and ("--mock-data" in r["command"][0]) != packed
    data_paths = set()
    for r in rows[2:]:
        for command in r["command"]:
            words = shlex.split(command)
            data_paths.add(words[words.index("--data-path") + 1])
    (prefix,) = map(Path, data_paths)  # one dataset per mixture and length, shared by its runs
    assert prefix.with_suffix(".bin").exists() and prefix.with_suffix(".idx").exists()
    assert read_document_lengths(prefix, bench.QWEN25_VOCAB - 1) == [lengths] * 7  # 6 iterations + 1
    assert f"# dataset {prefix}: 7 sequences of {len(lengths)} documents (prolong, N = 65536)" in output
    # the fake times every run alike, so each sparse row runs at the speed of its own mixture's dense row
    baselines = bench.dense_baselines(rows)
    assert [bench.speedup(r, baselines) for r in rows] == [1.0, 1.0, 1.0, 1.0]
    assert {baseline["mixture"] for baseline in baselines.values()} == {"none", "prolong"}
    table = output.split("| model |", 1)[1].splitlines()
    assert "| 64K | none | mtraining |" in table[2] and "| 64K | prolong | dense |" in table[5]
    assert set(bench.speedup_series(rows)) == {
        "qwen2.5-0.5b CP 1 mtraining sparsity=0.95",
        "qwen2.5-0.5b CP 1 mtraining sparsity=0.95, prolong",
    }
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_without_a_mixture_are_unpacked_and_not_compared_with_packed_ones():
    old = row(attention="dense", setting="dense", kernel="sdpa_cudnn", tokens_per_s=100.0)  # no "mixture" key
    packed_sparse = {**row(tokens_per_s=300.0), "mixture": "prolong"}
    unpacked_sparse = {**row(tokens_per_s=500.0), "mixture": "none"}
    baselines = bench.dense_baselines([old, packed_sparse, unpacked_sparse])
    assert bench.speedup(unpacked_sparse, baselines) == 5.0
    assert bench.speedup(packed_sparse, baselines) is None  # no dense row with the prolong mask


def test_launch_kills_the_whole_process_group_after_the_timeout(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    command = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"]
    started = time.monotonic()
    returncode, timed_out = bench.launch(command, {}, tmp_path / "log.txt", timeout_s=1)
    assert timed_out and time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.05)
    assert not _alive(grandchild), "the run's child process survived the timeout"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return status != "Z"  # a zombie awaiting its parent is dead


def test_launch_passes_the_environment_and_exit_code(tmp_path):
    command = [sys.executable, "-c", "import os, sys; print(os.environ['PROBE_TEST']); sys.exit(3)"]
    returncode, timed_out = bench.launch(command, {"PROBE_TEST": "hello"}, tmp_path / "log.txt", timeout_s=60)
    assert (returncode, timed_out) == (3, False)
    assert (tmp_path / "log.txt").read_text().strip() == "hello"


# ---------------------------------------------------------------------------------------- report
def row(
    model="qwen2.5-3b",
    seq_len=524288,
    attention="mtraining",
    setting="top_p=0.9",
    kernel=None,
    tokens_per_s=1000.0,
    extrapolated=True,
    status="ok",
    gpu="NVIDIA H200",
) -> dict:
    return {
        "gpu": gpu,
        "cp": 2,
        "model": model,
        "seq_len": seq_len,
        "recompute": "full",
        "extrapolated": extrapolated,
        "attention": attention,
        "sparsity_setting": setting,
        "dense_kernel": kernel,
        "tokens_per_s": tokens_per_s if status == "ok" else None,
        "status": status,
        "num_layers": 36,
        "layers_timed": [2, 4] if extrapolated else [36],
        "iter_ms": 1.0 if status == "ok" else None,
        "tflops_per_gpu_dense_equiv": 1.0,
        "tflops_per_gpu_actual": 0.1,
        "mfu_dense_equiv": 0.5,
        "peak_mem_gb": 50.0,
        "peak_mem_layers": 4,
        "density": 0.05,
        "attention_share": 0.6,
        **({} if status == "ok" else {"error": "CUDA out of memory"}),
    }


def test_speedup_is_over_the_fastest_latest_dense_row():
    rows = [
        row(attention="dense", setting="dense", kernel="triton", tokens_per_s=900.0),  # superseded below
        row(attention="dense", setting="dense", kernel="triton", tokens_per_s=100.0),
        row(attention="dense", setting="dense", kernel="sdpa_cudnn", tokens_per_s=200.0),
        row(tokens_per_s=1200.0),
        row(attention="dense", setting="dense", kernel="sdpa_cudnn", tokens_per_s=5000.0, status="failed"),
        row(tokens_per_s=700.0, gpu="NVIDIA H100"),
    ]  # no H100 baseline
    baselines = bench.dense_baselines(rows)
    assert len(baselines) == 1
    assert next(iter(baselines.values()))["dense_kernel"] == "sdpa_cudnn"
    assert bench.speedup(rows[3], baselines) == 6.0
    assert bench.speedup(rows[5], baselines) is None
    assert bench.speedup(rows[4], baselines) is None


def test_speedup_series_one_line_per_model_variant_and_method():
    rows = [
        row(attention="dense", setting="dense", kernel="sdpa_cudnn", tokens_per_s=100.0, seq_len=n)
        for n in (131072, 524288)
    ]
    rows += [
        row(tokens_per_s=300.0, seq_len=524288),
        row(tokens_per_s=150.0, seq_len=131072),
        row(setting="sparsity=0.95", tokens_per_s=500.0, seq_len=524288),
        row(attention="dense", setting="dense", kernel="sdpa_cudnn", tokens_per_s=10.0, extrapolated=False),
        row(tokens_per_s=40.0, extrapolated=False),
    ]
    kept = [
        row(attention="dense", setting="dense", kernel="sdpa_cudnn", tokens_per_s=125.0, seq_len=131072),
        row(tokens_per_s=250.0, seq_len=131072),
    ]
    for r in kept:
        r["recompute"] = "full-keep-attention"
    assert bench.speedup_series(rows + kept) == {
        "qwen2.5-3b CP 2 mtraining sparsity=0.95": [(524288, 5.0)],
        "qwen2.5-3b CP 2 mtraining top_p=0.9": [(131072, 1.5), (524288, 3.0)],
        "qwen2.5-3b CP 2 mtraining top_p=0.9, full depth": [(524288, 4.0)],
        "qwen2.5-3b CP 2 mtraining top_p=0.9, recompute full-keep-attention": [(131072, 2.0)],
    }


def test_compare_runs_puts_each_configurations_latest_run_next_to_the_one_before():
    def dated(date, **kwargs):
        r = row(**kwargs)
        r.update(
            date=date, commit=f"c{date[-1]}", fit={"per_layer_ms": 1000.0 / kwargs["tokens_per_s"], "fixed_ms": 5.0}
        )
        return r

    dense = dict(attention="dense", setting="dense", kernel="sdpa_cudnn")
    rows = [
        dated("2026-01-01T00:00:01", tokens_per_s=200.0),  # sparse alone: no × dense that run
        dated("2026-01-02T00:00:02", tokens_per_s=100.0, **dense),
        dated("2026-01-02T00:00:02", tokens_per_s=250.0),  # 2.5x the dense of its run
        dated("2026-01-02T00:00:02", tokens_per_s=90.0, model="qwen2.5-1.5b"),  # measured once: no line
        row(status="failed"),
    ]
    lines = bench.run_to_run(rows).splitlines()
    assert len(lines) == 3, lines  # header, rule, the one repeated config
    cells = lines[2].split(" | ")
    assert cells[2] == "none" and cells[3] == "mtraining"  # rows without a mixture are unpacked
    assert "c1 2026-01-01T00:00 → c2 2026-01-02T00:00" in cells[6]
    assert cells[7] == "5 → 4 (-20.0 %)"  # per layer ms
    assert cells[9] == "200 → 250 (+25.0 %)"
    assert cells[10] == "– → 2.50 |"


def test_table_shows_measured_failed_and_skipped_rows():
    rows = [
        row(attention="dense", setting="dense", kernel="sdpa_cudnn", tokens_per_s=100.0),
        row(tokens_per_s=550.0),
        row(model="qwen2.5-1.5b", status="failed"),
    ]
    table = bench.format_table(rows, bench.dense_baselines(rows), ["qwen2.5-3b_512k_dense: estimated 900 s"])
    lines = table.splitlines()
    assert len({line.count("|") for line in lines[:5]}) == 1  # a well-formed markdown table
    assert "dense (sdpa_cudnn)" in lines[2] and "2,4→36" in lines[2] and "| 1.00 |" in lines[2]
    assert "| 5.50 |" in lines[3] and "50.0 (4)" in lines[3]
    assert "FAILED: CUDA out of memory" in lines[4]
    assert lines[5] == "skipped: qwen2.5-3b_512k_dense: estimated 900 s"


def test_plot_only_writes_the_chart_from_the_jsonl(tmp_path, capsys):
    jsonl, chart = tmp_path / "e2e.jsonl", tmp_path / "chart.png"
    for item in (
        row(attention="dense", setting="dense", kernel="sdpa_cudnn", tokens_per_s=100.0),
        row(tokens_per_s=600.0),
    ):
        bench.append_jsonl(jsonl, item)
    bench.main(["--plot-only", "--jsonl", str(jsonl), "--plot", str(chart)])
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 6.00 |" in capsys.readouterr().out
    only_dense = tmp_path / "dense.jsonl"
    bench.append_jsonl(only_dense, row(attention="dense", setting="dense", kernel="sdpa_cudnn"))
    with pytest.raises(SystemExit, match="nothing to plot"):
        bench.main(["--plot-only", "--jsonl", str(only_dense), "--plot", str(chart)])


def test_git_commit_names_the_checkout():
    commit = bench.git_commit()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert commit.removesuffix("+dirty") == head
