"""The MTraining launcher: Megatron's ``pretrain`` with MTraining's layer spec, data layout and metrics.

Run it like Megatron-LM's ``pretrain_gpt.py`` (``torchrun ... -m megatron_mtraining.pretrain <Megatron
flags> <--mtraining-* flags>``); every Megatron flag keeps its meaning (DESIGN.md §3):

1. ``parse_and_validate_args(extra_args_provider=launcher_args)``, with the ``--mtraining-*`` checks
   and :func:`~megatron_mtraining.launch_check.check_launch_flags` (Megatron pitfalls: evaluation
   settings, head dims, missing files) run on the command line first (unless the model settings come
   from ``--use-checkpoint-args`` or ``--yaml-cfg``) so that bad combinations fail with a message
   naming the flag. Without Transformer Engine the launcher uses Megatron's local implementation and
   turns off the TE/Apex fusions, and says so in one line;
2. ``gpt_config_from_args`` with :func:`~megatron_mtraining.spec.get_gpt_layer_mtraining_spec` as the
   layer spec, a pre-wrap hook that gives every model chunk layout-aware RoPE, and a
   ``finalize_model_grads_func`` that also checks the index caches and logs MTraining metrics;
3. ``pretrain(...)`` with :class:`MTrainingForwardStep` (our :func:`get_batch`: Megatron's TP
   broadcast, then this CP rank's positions in the MTraining layout; zigzag keeps Megatron's split)
   and Megatron's ``GPTDataset``/``MockGPTDataset`` (``--mock-data``) provider.

``python -m megatron_mtraining.pretrain --mtraining-check <flags>`` (no torchrun, no GPU, no data read)
validates the command for ``WORLD_SIZE`` ranks and prints the resolved configuration
(:func:`~megatron_mtraining.launch_check.run_check`).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import warnings
from functools import partial
from typing import Callable

# megatron-core warns on import about every Transformer Engine / Apex fallback; the launcher says it in one line
LIBRARY_NOISE = r".*(Transformer Engine|Apex|transformer-engine|absl\.logging|Could not determine rank)"
warnings.filterwarnings("ignore", message=LIBRARY_NOISE, category=UserWarning)
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime" on CPU machines

import torch
import torch.distributed as dist
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, get_timers, get_tokenizer, inprocess_restart, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args, parse_args
from megatron.training.models import GPTModelConfig
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import Layout

from .arguments import (
    add_mtraining_args,
    document_source,
    hierarchical_cp_sizes,
    per_document_positions,
    validate_mtraining_args,
)
from .attention import PackedDocuments
from .chunked_loss import ChunkedLossOutputProcessor
from .config import MTrainingConfig
from .launch_check import check_launch_flags, check_resumed_schedule, layout_note, run_check
from .layout import install_layout_rope, select_layout_positions
from .megatron_compat import fill_optimizer_state_before_loading
from .spec import get_gpt_layer_mtraining_spec
from .step_metrics import MTrainingStepEnd
from .turn_plan import planned_layout

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
DOCUMENT_KEYS = ("cu_seqlens", "max_seqlen")  # GPTDataset's, with --dataloader-inter-document-masking
SPIKY_LOSS_FACTOR = 10  # Megatron's pretrain_gpt.py: a loss 10x the largest seen so far is spiky


# ------------------------------------------------------------------------------------------ model
def _install_layout_rope(mtraining: MTrainingConfig, per_token_positions: bool, model_chunks):
    """Pre-wrap hook: every chunk's RoPE table follows this CP rank's positions in the MTraining layout
    (with ``per_token_positions``, each token's position id)."""
    cp_group = mpu.get_context_parallel_group()
    layout = mtraining.layout_for(dist.get_world_size(cp_group))
    for chunk in model_chunks:
        install_layout_rope(chunk, layout, cp_group, per_token_positions)
    return model_chunks


def mtraining_model_config(args, mtraining: MTrainingConfig) -> GPTModelConfig:
    """Megatron's ``GPTModelConfig`` of ``args`` with MTraining's layer spec, layout RoPE and step end.

    ``--reset-position-ids`` (or ``--dataloader-inter-document-masking``) gives RoPE each token's position id
    (restarting per document) in every layout.
    """
    model_config = gpt_config_from_args(args)
    model_config.transformer_layer_spec = partial(get_gpt_layer_mtraining_spec, mtraining=mtraining)
    per_token_positions = per_document_positions(args)
    reorders = mtraining.layout != "zigzag" or per_token_positions
    if reorders and model_config.position_embedding_type in ("rope", "yarn"):
        model_config.pre_wrap_hooks.append(partial(_install_layout_rope, mtraining, per_token_positions))
    model_config.transformer.finalize_model_grads_func = MTrainingStepEnd(args.num_layers, mtraining.stats_interval)
    return model_config


# ------------------------------------------------------------------------------------------ data
def get_batch(
    data_iterator,
    vp_stage: int | None,
    layout: Layout,
    eod_token: int | None = None,
    inter_document_masking: bool = False,
    plan_layout: Callable[[Documents], Layout] | None = None,
) -> tuple:
    """``(tokens, labels, loss_mask, attention_mask, position_ids)`` of this rank, each ``[b, N/CP]`` (or None),
    and the micro-batch's :class:`PackedDocuments` (None when unpacked).

    TP rank 0 reads the micro-batch and Megatron broadcasts it over TP. Every rank then derives the document
    boundaries of the whole sequences: with ``inter_document_masking`` from the dataset's ``cu_seqlens``
    (``Documents.from_padded_cu_seqlens``), else with ``eod_token`` (``--reset-attention-mask``) from the
    tokens (``Documents.from_eod``). With ``plan_layout`` (``--mtraining-plan-turns``) a packed micro-batch gets
    the layout it returns for its documents (the same on every rank, which derives the same documents), carried
    to the attention by the :class:`PackedDocuments`. Then this CP rank keeps its positions: the layout's for
    striped/skewed/contiguous, Megatron's own split for zigzag.
    """
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * (len(BATCH_KEYS) + 1)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        batch = {
            key: sample[key].cuda(non_blocking=True) if sample.get(key) is not None else None
            for key in (*BATCH_KEYS, *(DOCUMENT_KEYS if inter_document_masking else ()))
        }
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=inter_document_masking,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    if inter_document_masking:
        documents = Documents.from_padded_cu_seqlens(batch["cu_seqlens"], batch["tokens"].shape[1])
    elif eod_token is not None:
        documents = Documents.from_eod(batch["tokens"], eod_token)
    else:
        documents = None
    packed = None
    if documents is not None:
        if plan_layout is not None:
            layout = plan_layout(documents)
        packed = PackedDocuments(documents, layout if plan_layout is not None else None)
    batch = {key: batch[key] for key in BATCH_KEYS}
    if layout.kind == "zigzag":
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    else:
        batch = select_layout_positions(batch, layout, mpu.get_context_parallel_rank())
    return (*(batch[key] for key in BATCH_KEYS), packed)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's GPT loss: (masked token-loss sum, token count, report) with its NaN/Inf/spike checks."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(
                rerun_state_machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


class MTrainingForwardStep:
    """Megatron ``forward_step_func``: :func:`get_batch`, the model (chunked loss when asked), :func:`loss_func`."""

    def __init__(self, mtraining: MTrainingConfig, loss_chunk_size: int):
        self.mtraining = mtraining
        self.output_processor = ChunkedLossOutputProcessor(loss_chunk_size) if loss_chunk_size else None
        self._plans: dict[tuple[int, int], Callable[[Documents], Layout]] = {}

    def plan_layout(self, seq_len: int, cp_size: int) -> Callable[[Documents], Layout] | None:
        """``--mtraining-plan-turns``: the planner of a micro-batch's layout at this length, from the static budget
        averaged over the model's layers and heads; None without the flag."""
        if not self.mtraining.plan_turns:
            return None
        if (seq_len, cp_size) not in self._plans:
            args = get_args()
            table = self.mtraining.budget_table(
                num_layers=args.num_layers, num_heads=args.num_attention_heads, seq_length=seq_len
            )
            budgets = [budget for layer in table.per_head for budget in layer]
            mt = self.mtraining
            self._plans[(seq_len, cp_size)] = partial(
                planned_layout,
                world_size=cp_size,
                vertical_size=round(sum(budget.v_size for budget in budgets) / len(budgets)),
                slash_size=round(sum(budget.s_size for budget in budgets) / len(budgets)),
                min_sparse_length=mt.min_sparse_length,
                sink_tokens=mt.sink_tokens,
                local_window=mt.local_window,
            )
        return self._plans[(seq_len, cp_size)]

    def __call__(self, data_iterator, model):
        timers = get_timers()
        timers("batch-generator", log_level=2).start()
        cp_size = mpu.get_context_parallel_world_size()
        layout = self.mtraining.layout_for(cp_size)
        source = document_source(get_args())
        eod_token = get_tokenizer().eod if source == "eod" else None
        tokens, labels, loss_mask, attention_mask, position_ids, packed = get_batch(
            data_iterator,
            get_attr_wrapped_model(model, "vp_stage"),
            layout,
            eod_token,
            source == "cu_seqlens",
            self.plan_layout(get_args().seq_length, cp_size),
        )
        timers("batch-generator").stop()
        output = model(
            tokens,
            position_ids,
            attention_mask,
            labels=labels,
            loss_mask=loss_mask,
            packed_seq_params=packed,
            output_processor=self.output_processor,
        )
        return output, partial(loss_func, loss_mask)


def is_dataset_built_on_rank(vp_stage: int | None = None) -> bool:
    return is_first_or_last_pipeline_stage(vp_stage) and mpu.get_tensor_model_parallel_rank() == 0


def gpt_dataset_config_from_args(args, tokenizer) -> GPTDatasetConfig:
    """Megatron's GPT dataset settings of ``args`` and ``tokenizer`` (as in Megatron-LM's ``pretrain_gpt.py``)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as file:
            sequences_per_dataset = json.load(file)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        inter_document_masking=args.dataloader_inter_document_masking,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=sequences_per_dataset,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
    )


def datasets_provider(train_val_test_num_samples, vp_stage: int | None = None):
    """Train/validation/test ``GPTDataset`` (``MockGPTDataset`` with ``--mock-data``) from Megatron's builder."""
    args = get_args()
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        MockGPTDataset if args.mock_data else GPTDataset,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        gpt_dataset_config_from_args(args, get_tokenizer()),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


datasets_provider.is_distributed = True


# ------------------------------------------------------------------------------------------ entry point
# Megatron's defaults that need Transformer Engine or Apex, and the local implementation's values for them
LOCAL_IMPLEMENTATION_DEFAULTS = {
    "transformer_impl": "local",
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "bias_swiglu_fusion": False,
    "no_persist_layer_norm": True,
    "masked_softmax_fusion": False,
}
LOCAL_IMPLEMENTATION_NOTE = (
    "Transformer Engine is not installed: using --transformer-impl local with "
    "--no-rope-fusion --no-gradient-accumulation-fusion --no-bias-swiglu-fusion "
    "--no-persist-layer-norm --no-masked-softmax-fusion"
)
_PERCENT_SIGNS = re.compile(r"%%|%\([a-z_]+\)[a-z]|%")  # escaped, a format field, or a bare sign


def launcher_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider`` of the launcher: the ``--mtraining-*`` flags, and two launcher defaults.

    Without Transformer Engine the defaults are the local implementation's (:data:`LOCAL_IMPLEMENTATION_DEFAULTS`;
    an explicit ``--transformer-impl transformer_engine`` is refused by :func:`check_transformer_impl`).
    Help strings with a bare ``%`` (one of megatron-core's) are escaped so that ``--help`` prints.
    """
    add_mtraining_args(parser)
    if not HAVE_TE:
        parser.set_defaults(**LOCAL_IMPLEMENTATION_DEFAULTS)
    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = _PERCENT_SIGNS.sub(lambda sign: "%%" if sign[0] == "%" else sign[0], action.help)
    return parser


def check_transformer_impl(args) -> None:
    if args.transformer_impl == "transformer_engine" and not HAVE_TE:
        raise ValueError(
            "--transformer-impl transformer_engine but Transformer Engine does not import; install it "
            "(pip install 'megatron-mtraining[te]') or drop the flag (the launcher then uses the local "
            "implementation)"
        )


def _validated_or_exit(check, *args) -> MTrainingConfig:
    try:
        return check(*args)
    except ValueError as error:
        raise SystemExit(f"megatron_mtraining.pretrain: error: {error}") from None


def _check_command_line(command_line) -> MTrainingConfig:
    check_transformer_impl(command_line)
    mtraining = validate_mtraining_args(command_line)
    check_launch_flags(command_line, mtraining)
    return mtraining


def _use_prebuilt_dataset_helpers() -> None:
    """Skip Megatron's dataset-helper build when the compiled module is already installed.

    megatron-core wheels ship ``helpers_cpp`` prebuilt but not its Makefile, while Megatron's
    initialisation always runs ``make`` there and exits when it fails. Only for this launcher's process.
    """
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout: let Megatron build it
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None


def main() -> None:
    """Parse Megatron's and MTraining's flags from ``sys.argv`` and train (or, with ``--mtraining-check``, check)."""
    command_line = parse_args(extra_args_provider=launcher_args)
    if command_line.mtraining_check:
        if not HAVE_TE:
            print(LOCAL_IMPLEMENTATION_NOTE)
        check_transformer_impl(command_line)
        sys.exit(_validated_or_exit(run_check, command_line, mtraining_model_config))
    if not command_line.use_checkpoint_args and command_line.yaml_cfg is None:
        _validated_or_exit(_check_command_line, command_line)  # before Megatron's asserts, which say less
    if not HAVE_TE and command_line.rank == 0:
        print(LOCAL_IMPLEMENTATION_NOTE, flush=True)
    _use_prebuilt_dataset_helpers()
    fill_optimizer_state_before_loading()
    args = parse_and_validate_args(extra_args_provider=launcher_args)
    mtraining = _validated_or_exit(validate_mtraining_args, args)
    _validated_or_exit(check_resumed_schedule, args)
    if (note := layout_note(args, mtraining)) and args.rank == 0:
        print(f"note: {note}", flush=True)
    args.hierarchical_context_parallel_sizes = hierarchical_cp_sizes(args, mtraining)
    config = pretrain_cfg_container_from_args(args, mtraining_model_config(args, mtraining))
    run_pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    run_pretrain(
        config,
        datasets_provider,
        ModelType.encoder_or_decoder,
        MTrainingForwardStep(mtraining, args.mtraining_loss_chunk_size),
        store=store,
    )


if __name__ == "__main__":
    main()
