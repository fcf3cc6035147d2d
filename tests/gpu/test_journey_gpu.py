"""The user journey on one GPU without Transformer Engine, run as documented.

For a Qwen2.5-shaped and a Qwen3-shaped random model (tiny: 2 layers, head dim 64) with a tokenizer
trained here: Hugging Face folder → ``tools/convert_qwen2_hf_to_megatron.py`` → ``tools/preprocess_data.py``
on JSONL documents → each example script for a few iterations on the real preprocessed data (the demo
script with evaluation on a validation split, a ``torch_dist`` save and a resume; the demo on the same data
as packed documents, ``PACKED_DOCUMENTS=1``; the 512K recipe at a short length with the static budget; the
SLURM templates through a stand-in ``srun``) →
``tools/convert_megatron_to_qwen2_hf.py`` → ``transformers`` loads the trained model, and its logits
equal those of the launcher's Megatron model loaded from the same training checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 512
SEQ_LEN = 8192
LOGITS_ATOL = 2e-4  # fp32 on both sides; the weights are the trained bf16 values
RUN_TIMEOUT_S = 480
WORDS = (
    "attention sparse ring stripe token vertical slash budget kernel block query key value gradient "
    "layer model context length sequence document data train loss step head group rank device"
).split()
# The demo on packed documents: every 8,192-token sequence holds pieces of 2 to 6 of the journey's documents (at
# most 6,001 tokens each, each ended by the EOD that tools/preprocess_data.py appends); documents of 2,048 tokens
# or more get their own sparse index, shorter ones are attended densely.
SHORT_RUN = dict(  # 3 iterations, a save and a validation at the third, statistics every step
    TRAIN_ITERS="3",
    SAVE_INTERVAL="3",
    EVAL_INTERVAL="3",
    EVAL_ITERS="1",
    SPLIT="90,10,0",
    EXTRA_ARGS="--mtraining-stats-interval 1",
)
PACKED_RUN = dict(SHORT_RUN, PACKED_DOCUMENTS="1", MIN_SPARSE_LENGTH="2048")
SHAPES = {
    "qwen2.5": dict(model_type="qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}


def _run(command: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = REPO) -> str:
    """Run ``command``; its output goes to ``log``; fails the test with the output's tail."""
    full_env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
        **(env or {}),
    )
    done = subprocess.run(
        command,
        env=full_env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    log.write_text(done.stdout)
    assert done.returncode == 0, f"{shlex.join(command)} failed ({done.returncode}):\n{done.stdout[-6000:]}"
    return done.stdout


def _documents(path: Path, count: int, seed: int) -> Path:
    """``count`` JSONL documents of random words, 200 to 6,000 words each."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 6000)))
            out.write(json.dumps({"text": text}) + "\n")
    return path


def _tokenizer(directory: Path, corpus: Path) -> Path:
    """A byte-level BPE tokenizer of VOCAB ids trained on ``corpus``, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    texts = (json.loads(line)["text"] for line in corpus.read_text().splitlines())
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    return directory


def _random_hf_model(directory: Path, shape: dict, tokenizer_dir: Path, seed: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    shape = dict(shape)
    config = AutoConfig.for_model(
        shape.pop("model_type"),
        vocab_size=VOCAB,
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=SEQ_LEN,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.1,
        eos_token_id=0,
        bos_token_id=0,
        **shape,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    for file in tokenizer_dir.iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    return directory


@pytest.fixture(scope="module", params=sorted(SHAPES))
def journey(request, tmp_path_factory) -> dict[str, Path]:
    """A converted checkpoint and a preprocessed dataset of one model shape (the journey's first steps)."""
    root = tmp_path_factory.mktemp(request.param)
    corpus = _documents(root / "docs.jsonl", count=48, seed=1)
    tokenizer_dir = _tokenizer(root / "tokenizer", corpus)
    hf_dir = _random_hf_model(root / "hf", SHAPES[request.param], tokenizer_dir, seed=2)
    checkpoint = root / "checkpoint"
    _run(
        [
            sys.executable,
            "tools/convert_qwen2_hf_to_megatron.py",
            "--hf-dir",
            str(hf_dir),
            "--output-dir",
            str(checkpoint),
        ],
        root / "convert.log",
    )
    data_prefix = root / "data" / "docs"
    _run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            str(corpus),
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            str(hf_dir),
            "--output-prefix",
            str(data_prefix),
            "--workers",
            "2",
            "--target-length",
            str(SEQ_LEN),
        ],
        root / "preprocess.log",
    )
    return {"name": request.param, "root": root, "hf": hf_dir, "checkpoint": checkpoint, "data": data_prefix}


def _script_env(journey: dict, save_dir: Path, **settings: str) -> dict[str, str]:
    return {
        "CHECKPOINT": str(journey["checkpoint"]),
        "DATA_PREFIX": str(journey["data"]),
        "SAVE_DIR": str(save_dir),
        "PYTHON": sys.executable,
        "SEQ_LEN": str(SEQ_LEN),
        "GLOBAL_BATCH_SIZE": "1",
        "WARMUP_ITERS": "1",
        "MASTER_PORT": _free_port(),
        **settings,
    }


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _iterations(log: str) -> list[int]:
    return [int(match) for match in re.findall(r" iteration +(\d+)/ *\d+ \|", log)]


def _megatron_logits(journey: dict, iteration_dir: Path, tokens: torch.Tensor, port_file: Path) -> torch.Tensor:
    """Logits of the launcher's model (MTraining spec, full pattern) loaded from a training checkpoint, fp32."""
    import argparse

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.arguments import add_megatron_arguments
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_mtraining.arguments import validate_mtraining_args
    from megatron_mtraining.pretrain import launcher_args, mtraining_model_config

    model_args_file = journey["checkpoint"] / "megatron_model_args.sh"
    script = f'source {shlex.quote(str(model_args_file))}; printf "%s\\0" "${{MODEL_ARGS[@]}}"'
    printed = subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout
    model_flags = printed.split("\0")[:-1]
    parser = launcher_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(
        [
            *model_flags,
            "--micro-batch-size",
            "1",
            "--seq-length",
            str(tokens.shape[1]),
            "--max-position-embeddings",
            str(SEQ_LEN),
            "--bf16",
            "--mtraining-dense",
            "--mtraining-backend",
            "torch",
        ]
    )
    args.params_dtype = torch.bfloat16
    dist.init_process_group("nccl", init_method=f"file://{port_file}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)  # Megatron's GPU weight init draws from this tracker
        model = (
            GPTModelBuilder(mtraining_model_config(args, validate_mtraining_args(args)))
            .build_model(ProcessGroupCollection.use_mpu_process_groups())
            .cuda()
        )
        loaded = dist_checkpointing.load(
            {"model": model.sharded_state_dict()}, str(iteration_dir), strict="raise_unexpected"
        )  # the optimizer state stays unread
        model.load_state_dict(loaded["model"])
        model.float().eval()
        positions = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
        with torch.no_grad():
            return model(tokens.cuda(), positions, None).float().cpu()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_demo_script_trains_evaluates_saves_resumes_and_converts_back(journey):
    """``examples/qwen2.5-0.5b_1gpu_demo.sh`` on the real data: 4 iterations with evaluation and a save, then a
    resume to 6 at twice the length with the static budget (a longer run: Megatron needs
    ``--override-opt_param-scheduler`` to take the new schedule), then back to Hugging Face."""
    root, save_dir = journey["root"], journey["root"] / "demo-run"
    settings = dict(
        TRAIN_ITERS="4",
        SAVE_INTERVAL="4",
        EVAL_INTERVAL="2",
        EVAL_ITERS="1",
        SPLIT="90,10,0",
        EXTRA_ARGS="--mtraining-stats-interval 1",
    )
    first = _run(
        ["bash", "examples/qwen2.5-0.5b_1gpu_demo.sh"], root / "demo-1.log", _script_env(journey, save_dir, **settings)
    )
    assert "Transformer Engine is not installed: using --transformer-impl local" in first
    assert _iterations(first)[-1] == 4
    assert "validation loss" in first
    assert re.search(r"mtraining \| iteration +\d+ \| density", first)
    assert (save_dir / "iter_0000004").is_dir()
    second = _run(
        ["bash", "examples/qwen2.5-0.5b_1gpu_demo.sh"],
        root / "demo-2.log",
        _script_env(
            journey,
            save_dir,
            **dict(
                settings,
                TRAIN_ITERS="6",
                SAVE_INTERVAL="6",
                SEQ_LEN=str(2 * SEQ_LEN),
                BUDGET="static",
                SPARSITY="0.9",
                EXTRA_ARGS=f"{settings['EXTRA_ARGS']} --override-opt_param-scheduler",
            ),
        ),
    )
    assert re.search(r"loaded checkpoint from .*demo-run.* at iteration 4", second), second[-3000:]
    assert _iterations(second) == [5, 6]

    hf_out = root / "hf-trained"
    _run(
        [
            sys.executable,
            "tools/convert_megatron_to_qwen2_hf.py",
            "--checkpoint",
            str(save_dir),
            "--output-dir",
            str(hf_out),
            "--hf-reference",
            str(journey["hf"]),
        ],
        root / "convert-back.log",
    )
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, VOCAB, (1, 512), generator=torch.Generator().manual_seed(3))
    hf_model = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf_model).__name__ == {"qwen2.5": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[journey["name"]]
    with torch.no_grad():
        hf_logits = hf_model.cuda()(tokens.cuda()).logits.float().cpu()
    megatron_logits = _megatron_logits(journey, save_dir / "iter_0000006", tokens, root / "pg-file")
    assert megatron_logits.shape == hf_logits.shape
    error = (megatron_logits - hf_logits).abs().max().item()
    assert error <= LOGITS_ATOL, f"max |Δlogits| {error:.2e} (logit std {hf_logits.std():.3f})"


def test_demo_script_trains_on_packed_documents(journey):
    """``PACKED_DOCUMENTS=1`` on the real preprocessed data: Megatron's ``GPTDataset`` packs several documents into
    each sequence, the launcher finds their boundaries at the EOD tokens and keeps each document's attention and
    RoPE positions to itself. 3 iterations with a finite loss, and every ``mtraining`` line (one per iteration)
    reports more than one document per sequence."""
    if journey["name"] != "qwen2.5":
        pytest.skip("one model shape is enough for the packed-document flags")
    root = journey["root"]
    log = _run(
        ["bash", "examples/qwen2.5-0.5b_1gpu_demo.sh"],
        root / "packed.log",
        _script_env(journey, root / "packed-run", **PACKED_RUN),
    )
    for name, value in [
        ("reset_attention_mask", "True"),
        ("reset_position_ids", "True"),
        ("eod_mask_loss", "True"),
        ("mtraining_min_sparse_length", PACKED_RUN["MIN_SPARSE_LENGTH"]),
    ]:
        assert re.search(rf" {name} \.+ {value}\s*$", log, re.MULTILINE), f"Megatron's arguments lack {name} {value}"
    assert _iterations(log) == [1, 2, 3]
    losses = [float(value) for value in re.findall(r" lm loss: (\S+) \|", log)]
    assert len(losses) == 3 and all(math.isfinite(value) for value in losses), losses
    documents = [
        float(value)
        for value in re.findall(r"mtraining \| iteration +\d+ \| density .* \| documents/sequence ([0-9.]+) \|", log)
    ]
    assert len(documents) == 3 and all(value > 1 for value in documents), documents


def _run_recipe(journey, name: str, **budget: str) -> str:
    """``examples/qwen2.5-3b_32k_to_512k.sh`` on one GPU for 3 iterations (a save and a validation at the
    third) with the ``budget`` settings; its log."""
    root = journey["root"]
    env = _script_env(journey, root / f"{name}-run", GPUS_PER_NODE="1", **SHORT_RUN, **budget)
    return _run(["bash", "examples/qwen2.5-3b_32k_to_512k.sh"], root / f"{name}.log", env)


def test_512k_recipe_runs_a_few_iterations_with_the_static_budget(journey):
    """``examples/qwen2.5-3b_32k_to_512k.sh`` on one GPU at a short length: static 90 % budget, 3 iterations."""
    if journey["name"] != "qwen2.5":
        pytest.skip("one model shape is enough for the recipe's own flags")
    log = _run_recipe(journey, "recipe", BUDGET="static", SPARSITY="0.9")
    assert _iterations(log)[-1] == 3
    densities = [float(value) for value in re.findall(r"mtraining \| iteration +\d+ \| density ([0-9.]+)", log)]
    assert densities and all(value < 0.5 for value in densities), densities


def test_512k_recipe_runs_with_the_recommended_top_p_budget(journey):
    """The recipe with the quality study's budget from 64K on (``TOP_P=0.9 BLOCK_SLASHES=1 CAP=128``): the launcher
    receives ``--mtraining-block-slashes --mtraining-cap 128`` and trains 3 iterations."""
    if journey["name"] != "qwen2.5":
        pytest.skip("one model shape is enough for the recipe's own flags")
    log = _run_recipe(journey, "recipe-top-p", TOP_P="0.9", BLOCK_SLASHES="1", CAP="128")
    # Megatron prints every argument at start: "  name ........ value"
    passed = re.search(r"mtraining_block_slashes \.+ True", log) and re.search(r"mtraining_cap \.+ 128\b", log)
    assert passed, "the recipe did not pass BLOCK_SLASHES=1 CAP=128 to the launcher"
    assert _iterations(log)[-1] == 3
    densities = [float(value) for value in re.findall(r"mtraining \| iteration +\d+ \| density ([0-9.]+)", log)]
    assert densities and all(0 < value <= 1 for value in densities), densities


@pytest.mark.parametrize("template", ["qwen2.5-3b_512k_1node.sbatch", "qwen2.5-3b_512k_multinode.sbatch"])
def test_slurm_template_runs_through_srun(journey, tmp_path, template):
    """Each SLURM template of ``examples/slurm/`` in a one-node job of one GPU, with a stand-in ``srun`` that runs
    its command on this node (the multi-node template's hierarchical ring needs several nodes; here its flat
    case runs)."""
    if journey["name"] != "qwen2.5":
        pytest.skip("one model shape is enough for the template")
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    srun = fake_bin / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n')
    srun.chmod(0o755)
    env = _script_env(
        journey,
        journey["root"] / f"slurm-run-{template}",
        GPUS_PER_NODE="1",
        TRAIN_ITERS="2",
        SAVE_INTERVAL="2",
        EVAL_INTERVAL="2",
        EVAL_ITERS="1",
        SPLIT="90,10,0",
        SLURM_NNODES="1",
        PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
    )
    log = _run(["bash", f"examples/slurm/{template}"], journey["root"] / f"slurm-{template}.log", env)
    assert _iterations(log)[-1] == 2
