"""The launcher's pre-flight (megatron_mtraining.launch_check) and its command line on a CPU.

``--help`` prints (megatron-core has a help string with a bare ``%``) and lists the MTraining group;
``--mtraining-check`` validates a whole 512K command for ``WORLD_SIZE`` ranks without GPU or data and
prints the resolved parallel layout; Megatron pitfalls (evaluation sizing, empty validation split,
head dims the kernel cannot run, missing files, TE asked for but absent, a resumed run whose schedule
differs from the checkpoint's) fail before any work with a message naming the flag and the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mtraining import pretrain
from megatron_mtraining.launch_check import check_launch_flags, run_check

REPO = Path(__file__).resolve().parents[2]
QWEN25_3B = (
    "--num-layers 36 --hidden-size 2048 --ffn-hidden-size 11008 --num-attention-heads 16 "
    "--group-query-attention --num-query-groups 2 --kv-channels 128 --normalization RMSNorm --norm-epsilon "
    "1e-06 --swiglu --disable-bias-linear --add-qkv-bias --rotary-percent 1.0 --rotary-base 1000000 "
    "--position-embedding-type rope --make-vocab-size-divisible-by 1 --padded-vocab-size 151936 "
    "--tokenizer-type HuggingFaceTokenizer --tokenizer-model Qwen/Qwen2.5-3B"
)
RUN_512K = (
    "--seq-length 524288 --max-position-embeddings 524288 --micro-batch-size 1 --global-batch-size 8 "
    "--train-iters 1000 --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 20 --bf16 "
    "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 1 --eval-iters 10 --eval-interval 100 --cp-comm-type p2p --mtraining-budget static "
    "--mtraining-sparsity 0.95 --mtraining-loss-chunk-size 8192"
)


def _command_line(monkeypatch, flags: str, world_size: int):
    """The launcher's parsed command line (Megatron's ``parse_args`` with the launcher's provider)."""
    from megatron.training.arguments import parse_args

    monkeypatch.setattr(sys, "argv", ["megatron_mtraining.pretrain", *flags.split()])
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return parse_args(extra_args_provider=pretrain.launcher_args)


def _check(monkeypatch, flags: str, world_size: int = 16) -> list[str]:
    lines = []
    assert (
        run_check(_command_line(monkeypatch, flags, world_size), pretrain.mtraining_model_config, report=lines.append)
        == 0
    )
    return lines


def _line(lines: list[str], key: str) -> str:
    return next(line.strip() for line in lines if line.strip().startswith(key))


def test_check_resolves_a_512k_two_node_command(monkeypatch, tmp_path):
    lines = _check(
        monkeypatch,
        f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --mock-data --mtraining-ring "
        f"hierarchical --mtraining-inner-ring-size 4",
        world_size=16,
    )
    assert "valid for WORLD_SIZE=16 ranks" in lines[0]
    assert _line(lines, "ranks") == "ranks        16 = TP 1 × PP 1 × CP 8 × DP 2"
    assert "4 micro-batches per step" in _line(lines, "batch")
    assert "65,536 per CP rank" in _line(lines, "sequence")
    assert "hierarchical ring (4 inner × 2 outer)" in _line(lines, "sequence")
    assert "head dim 128" in _line(lines, "model")
    assert "target sparsity 0.95" in _line(lines, "attention")
    assert _line(lines, "evaluation") == "evaluation   every 100 iterations, 10 validation batches each"


def test_check_derives_dp_with_tp_and_pp(monkeypatch):
    lines = _check(
        monkeypatch,
        f"{QWEN25_3B} {RUN_512K} --tensor-model-parallel-size 2 --sequence-parallel "
        "--pipeline-model-parallel-size 2 --context-parallel-size 2 --mock-data",
        world_size=16,
    )
    assert _line(lines, "ranks") == "ranks        16 = TP 2 × PP 2 × CP 2 × DP 2"


def test_check_reports_files_missing_here_without_failing(monkeypatch, tmp_path):
    prefix = tmp_path / "long_docs"
    lines = _check(
        monkeypatch,
        f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --data-path {prefix} --split "
        f"98,2,0 --pretrained-checkpoint {tmp_path / 'ckpt'}",
        world_size=8,
    )
    missing = [line for line in lines if "not found on this machine" in line]
    assert len(missing) == 2 and "--pretrained-checkpoint" in missing[0] and f"{prefix}.bin" in missing[1]


def test_a_real_launch_refuses_missing_files(monkeypatch, tmp_path):
    prefix = tmp_path / "long_docs"
    command_line = _command_line(
        monkeypatch,
        f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --data-path {prefix} --split 98,2,0",
        world_size=8,
    )
    with pytest.raises(SystemExit, match=r"not found: --data-path .*long_docs \(no .*long_docs.bin"):
        pretrain._validated_or_exit(pretrain._check_command_line, command_line)
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(b"")
    pretrain._validated_or_exit(pretrain._check_command_line, command_line)


@pytest.mark.parametrize(
    "valid, broken, message",
    [
        ("--eval-interval 100", "", r"--eval-interval is not set.*add --eval-interval N"),
        (
            "--split 98,2,0",
            "--split 100,0,0",
            r"--eval-iters 10 evaluates on the validation split, but --split 100,0,0",
        ),
        ("--kv-channels 128", "--kv-channels 96", r"head dim 96 .* --mtraining-backend triton, which supports 64, 128"),
        (
            "--kv-channels 128",
            "--kv-channels 192 --mtraining-dense --mtraining-dense-impl sdpa_cudnn --mtraining-layout zigzag",
            r"head dim 192 is not run by --mtraining-dense-impl sdpa_cudnn \(multiples of 8 "
            r"up to 128\); use --mtraining-dense-impl mtraining",
        ),
        ("--train-iters 1000", "--train-iters 20", r"--lr-warmup-iters 20 must be smaller than the decay length 20"),
    ],
)
def test_megatron_pitfalls_fail_before_work(monkeypatch, tmp_path, valid, broken, message):
    """Each case breaks one setting of an otherwise valid real-data command."""
    prefix = tmp_path / "docs"
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(b"")
    flags = f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --data-path {prefix} --split 98,2,0"
    assert valid in flags
    command_line = _command_line(monkeypatch, flags.replace(valid, broken), world_size=8)
    from megatron_mtraining.arguments import validate_mtraining_args

    with pytest.raises(ValueError, match=message):
        check_launch_flags(command_line, validate_mtraining_args(command_line))
    with pytest.raises(ValueError, match=message):
        run_check(command_line, pretrain.mtraining_model_config, report=lambda line: None)


def test_check_refuses_a_world_size_the_parallel_sizes_do_not_divide(monkeypatch):
    with pytest.raises(ValueError, match="Megatron's argument check"):
        _check(monkeypatch, f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --mock-data", world_size=12)


@pytest.mark.skipif(pretrain.HAVE_TE, reason="Transformer Engine is installed")
def test_without_transformer_engine_the_local_implementation_is_chosen_and_te_is_refused(monkeypatch):
    command_line = _command_line(monkeypatch, f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --mock-data", 8)
    chosen = {name: getattr(command_line, name) for name in pretrain.LOCAL_IMPLEMENTATION_DEFAULTS}
    assert chosen == pretrain.LOCAL_IMPLEMENTATION_DEFAULTS
    explicit = _command_line(
        monkeypatch,
        f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --mock-data --transformer-impl transformer_engine",
        8,
    )
    with pytest.raises(ValueError, match="--transformer-impl transformer_engine but Transformer Engine does not"):
        pretrain.check_transformer_impl(explicit)


def _launcher(*flags: str, world_size: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ, WORLD_SIZE=str(world_size), PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "megatron_mtraining.pretrain", *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def test_help_prints_the_mtraining_group():
    done = _launcher("--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MTraining:" in done.stdout and "--mtraining-check" in done.stdout and "--mtraining-top-p" in done.stdout


def test_check_mode_on_the_command_line(tmp_path):
    """The real entry point: a valid command exits 0 with the configuration, a bad one exits 1 naming the flag."""
    good = _launcher(
        "--mtraining-check", *f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --mock-data".split(), world_size=8
    )
    assert good.returncode == 0, good.stderr[-3000:]
    assert "ranks        8 = TP 1 × PP 1 × CP 8 × DP 1" in good.stdout
    assert "UserWarning" not in good.stderr, "library warnings about TE/Apex absence must be silenced"
    bad = _launcher(
        "--mtraining-check",
        *f"{QWEN25_3B} {RUN_512K} --context-parallel-size 8 --mock-data --mtraining-top-p 0.9".split(),
        world_size=8,
    )
    assert bad.returncode == 1
    assert "megatron_mtraining.pretrain: error: --mtraining-budget=static does not take" in bad.stderr


def _saved_schedule(checkpoint_root: Path, iteration: int, flags: str, monkeypatch) -> None:
    """A ``torch_dist`` checkpoint at ``iteration`` whose common state holds the schedule of a run with ``flags``."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.training.training import get_optimizer_param_scheduler
    from megatron_cpu import megatron_on_cpu

    _set_global_args(monkeypatch, _validated(monkeypatch, flags))
    schedule = get_optimizer_param_scheduler(torch.optim.SGD([torch.zeros(1)], lr=0.0)).state_dict()
    directory = checkpoint_root / f"iter_{iteration:07d}"
    directory.mkdir(parents=True)
    with megatron_on_cpu():
        dist.init_process_group("gloo", init_method=f"file://{checkpoint_root / 'store'}", rank=0, world_size=1)
        try:
            dist_checkpointing.save({"opt_param_scheduler": schedule, "iteration": iteration}, str(directory))
        finally:
            dist.destroy_process_group()
    (checkpoint_root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def _set_global_args(monkeypatch, args) -> None:
    """Megatron's global ``args`` for this test only (``get_args()`` reads them)."""
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)


def _validated(monkeypatch, flags: str):
    from megatron.training.arguments import validate_args

    args = _command_line(monkeypatch, flags, world_size=1)
    validate_args(args)
    return args


def test_a_resumed_run_with_another_schedule_fails_before_the_model_is_built(monkeypatch, tmp_path):
    from megatron_mtraining.launch_check import check_resumed_schedule

    flags = (
        f"{QWEN25_3B} {RUN_512K} --context-parallel-size 1 --seq-length 4096 --max-position-embeddings 4096 "
        f"--mock-data --load {tmp_path / 'run'}"
    )
    _saved_schedule(tmp_path / "run", 400, flags, monkeypatch)
    same = _validated(monkeypatch, flags)
    _set_global_args(monkeypatch, same)
    check_resumed_schedule(same)  # the saved run's own schedule resumes
    longer = _validated(monkeypatch, flags.replace("--train-iters 1000", "--train-iters 2000"))
    _set_global_args(monkeypatch, longer)
    with pytest.raises(
        ValueError,
        match=r"resuming .*iter_0000400: .*total number of iterations do not match; add "
        r"--override-opt_param-scheduler",
    ):
        check_resumed_schedule(longer)
    overridden = _validated(
        monkeypatch, flags.replace("--train-iters 1000", "--train-iters 2000") + " --override-opt_param-scheduler"
    )
    _set_global_args(monkeypatch, overridden)
    check_resumed_schedule(overridden)


@pytest.mark.parametrize(
    "extra, noted",
    [
        ("--reset-attention-mask --reset-position-ids --no-rope-fusion", True),
        ("--reset-attention-mask --reset-position-ids --no-rope-fusion --mtraining-layout skewed", False),
        ("", False),
    ],
    ids=["packed-striped", "packed-skewed", "unpacked"],
)
def test_check_advises_skewed_stripes_for_packed_documents(monkeypatch, extra, noted):
    lines = _check(monkeypatch, f"{QWEN25_3B} {RUN_512K} --context-parallel-size 16 --mock-data {extra}")
    notes = [line.strip() for line in lines if line.strip().startswith("note")]
    expected = [
        "note         packed documents in the striped layout: documents of one length unbalance the ring; "
        "--mtraining-layout skewed balances them"
    ]
    assert notes == (expected if noted else [])
