"""Pattern recall: how much of the true softmax mass of *all* queries the estimated sparse pattern covers.

For each layer of a trained model, a forward pre-hook on ``core_attention`` captures the post-RoPE
``query [s, b, Hq, d]`` and ``key [s, b, Hkv, d]`` of a real sequence. The layer's estimator
(:func:`megatron_mtraining.estimation.estimate_vertical_slash` with the layer's top-P budget, exactly as
``MTrainingAttention._estimate`` calls it at CP = 1) gives the vertical-slash index, whose mask is the
one of :func:`mtraining_kernels.reference.vertical_slash_mask`, built here a chunk of query rows at a
time. Then, per query head (fp32 logits, chunks of rows so 16K+ tokens fit)::

    recall = (1/N) Σ_i Σ_{j ∈ M_i} softmax_j(scale · q_i · k_j)

i.e. the mean over every query row of the probability mass inside the mask (1.0 = nothing lost).
"""

from __future__ import annotations

import torch

from megatron_mtraining.attention import MTrainingAttention
from megatron_mtraining.attention_stats import mask_density
from megatron_mtraining.config import MTrainingConfig
from mtraining_kernels import estimation
from mtraining_kernels.reference import vertical_slash_mask


def covered_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    v_idx: torch.Tensor,
    s_idx: torch.Tensor,
    softmax_scale: float | None = None,
    row_chunk: int = 1024,
) -> torch.Tensor:
    """Mean over query rows of the softmax mass inside the mask, per (sample, query head): fp64 ``[b, Hq]``.

    ``q [b, N, Hq, d]``, ``k [b, N, Hkv, d]`` (GQA: head h reads KV head h // (Hq/Hkv)); logits in fp32.
    """
    batch, seq_len, q_heads, dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    total = torch.zeros(batch, q_heads, dtype=torch.float64, device=q.device)
    k = k.float()
    for start in range(0, seq_len, row_chunk):
        stop = min(start + row_chunk, seq_len)
        rows = torch.arange(start, stop, device=q.device)
        q_rows = q[:, start:stop].float().reshape(batch, stop - start, kv_heads, group, dim)
        logits = torch.einsum("brkgd,bnkd->bkgrn", q_rows, k[:, :stop]).reshape(batch, q_heads, stop - start, stop)
        logits = logits.mul_(scale).masked_fill_(
            rows[:, None] < torch.arange(stop, device=q.device)[None, :], float("-inf")
        )
        probs = torch.softmax(logits, dim=-1)
        inside = vertical_slash_mask(v_idx, s_idx, seq_len, rows=rows)[..., :stop]
        total += (probs * inside).sum(dim=(-1, -2)).double()
    return total / seq_len


def capture_qk(
    model: torch.nn.Module, tokens: torch.Tensor
) -> dict[int, tuple[MTrainingAttention, torch.Tensor, torch.Tensor]]:
    """Run ``model`` on ``tokens [b, N]`` (no grad) and return {layer_number: (module, q, k)} with
    ``q [b, N, Hq, d]`` and ``k [b, N, Hkv, d]`` as the core attention received them (post-RoPE)."""
    captured = {}

    def hook(module, args, kwargs):
        query, key = args[0], args[1]
        captured[module.layer_number] = (
            module,
            query.detach().permute(1, 0, 2, 3).contiguous(),
            key.detach().permute(1, 0, 2, 3).contiguous(),
        )

    handles = [
        module.register_forward_pre_hook(hook, with_kwargs=True)
        for module in model.modules()
        if isinstance(module, MTrainingAttention)
    ]
    try:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        with torch.no_grad():
            model(tokens, positions, None)
    finally:
        for handle in handles:
            handle.remove()
    if not captured:
        raise ValueError("the model has no MTrainingAttention modules; build it with get_gpt_layer_mtraining_spec")
    return captured


def estimated_index(
    module: MTrainingAttention, q: torch.Tensor, k: torch.Tensor, settings: MTrainingConfig
) -> estimation.VerticalSlashIndex:
    """The index the layer's estimator gives under ``settings`` (budget, last_q, sinks, window), at CP = 1."""
    seq_len, heads = q.shape[1], q.shape[2]
    budget = settings.budget_table(
        num_layers=module.config.num_layers, num_heads=module.config.num_attention_heads, seq_length=seq_len
    ).resolve(module.layer_number, range(heads))
    return estimation.estimate_vertical_slash(
        q,
        k,
        budget,
        softmax_scale=module.softmax_scale,
        last_q=settings.last_q,
        sink_tokens=settings.sink_tokens,
        local_window=settings.local_window,
    )


def pattern_recall(
    model: torch.nn.Module, tokens: torch.Tensor, settings: dict[str, MTrainingConfig], row_chunk: int = 1024
) -> dict[str, list[dict]]:
    """Per settings name (e.g. ``"top-p 0.9"``), one entry per layer: ``{"layer", "recall": [per head],
    "density": [per head]}``, averaged over the batch ``tokens [b, N]``."""
    captured = capture_qk(model, tokens)
    results = {name: [] for name in settings}
    for layer_number in sorted(captured):
        module, q, k = captured[layer_number]
        for name, config in settings.items():
            index = estimated_index(module, q, k, config)
            recall = covered_mass(q, k, index.v_idx, index.s_idx, module.softmax_scale, row_chunk)
            density = mask_density(index.v_idx, index.s_idx, q.shape[1])
            results[name].append(
                {"layer": layer_number, "recall": recall.mean(0).tolist(), "density": density.mean(0).tolist()}
            )
        del q, k
    return results
