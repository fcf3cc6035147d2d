"""``ChunkedLossOutputProcessor`` inside a Megatron ``GPTModel`` on gloo ranks equals the model's own loss.

A tiny GPTModel with MTraining's layer spec (dense pattern, CP = 1) at TP = 1 (untied output layer)
and TP = 2 (tied embeddings, vocab-parallel cross-entropy across the two ranks): the per-token loss
and every parameter gradient under a random per-token upstream gradient match the unchunked
``GPTModel.forward(..., labels=...)`` in fp32, with a chunk size that does not divide the sequence.
"""

from __future__ import annotations

import torch
from megatron_cpu import megatron_on_cpu, reset_parallel_state

SEQ_LEN, BATCH, VOCAB, CHUNK = 256, 2, 128, 48
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5  # max |Δ| / max |ref|: the output-layer weight gradient sums chunks in another order


def _model(tp: int, tied: bool, seed: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.config import MTrainingConfig
    from megatron_mtraining.spec import get_gpt_layer_mtraining_spec

    reset_parallel_state()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
    )
    torch.manual_seed(seed)
    spec = get_gpt_layer_mtraining_spec(config, mtraining=MTrainingConfig(backend="torch", dense=True))
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ_LEN,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
    )


def _loss_and_grads(model, tokens, labels, upstream, output_processor=None):
    model.zero_grad(set_to_none=True)
    positions = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)
    loss = model(tokens, positions, None, labels=labels, output_processor=output_processor)
    (loss * upstream).sum().backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


def _compare(rank, world_size, seed):
    from megatron_mtraining.chunked_loss import ChunkedLossOutputProcessor

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=gen)
    upstream = torch.rand(BATCH, SEQ_LEN, generator=gen) * (torch.rand(BATCH, SEQ_LEN, generator=gen) < 0.8)
    report = {}
    with megatron_on_cpu():
        for tp, tied in ((1, False), (2, True)):
            model = _model(tp, tied, seed)
            ref_loss, ref_grads = _loss_and_grads(model, tokens, labels, upstream)
            loss, grads = _loss_and_grads(model, tokens, labels, upstream, ChunkedLossOutputProcessor(CHUNK))
            diffs = {"loss": float(((loss - ref_loss).abs() / ref_loss.abs()).max())}
            diffs.update(
                {name: float((grads[name] - ref).abs().max() / ref.abs().max()) for name, ref in ref_grads.items()}
            )
            report[f"tp{tp}"] = diffs
    return report


def test_chunked_loss_matches_gpt_model_loss(distributed, seed):
    report = distributed(_compare, 2, seed)[0]
    for layout, diffs in report.items():
        assert "output_layer.weight" in diffs or layout == "tp2", f"{layout}: the untied output layer is missing"
        for name, value in diffs.items():
            tolerance = LOSS_RTOL if name == "loss" else GRAD_RTOL
            assert value <= tolerance, f"{layout} {name}: relative difference {value:.2e} (seed={seed})"
