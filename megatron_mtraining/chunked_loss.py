"""Output layer and cross-entropy in sequence chunks, recomputed in backward, so the full logits never exist.

At 512K tokens the logits alone do not fit: Qwen2.5-3B at CP = 2 holds 262,144 positions per rank,
and [262144, 151936] bf16 logits take 80 GB (the fp32 softmax that cross-entropy keeps for backward
twice that). megatron-core 0.19 has no chunked or fused linear-cross-entropy (its
``cross_entropy_loss_fusion`` still takes materialised logits), so this module splits the sequence:
each chunk's logits are computed, reduced to per-token losses and dropped; backward recomputes one
chunk at a time (``torch.utils.checkpoint``, non-reentrant, so every parameter still receives one
summed gradient per backward, as Megatron's DDP hooks expect). Peak logits memory is one chunk.

It plugs into ``GPTModel.forward(..., output_processor=ChunkedLossOutputProcessor(n))``, which
hands over the final hidden states instead of computing logits, and reuses the model's own
``output_layer``, logit scaling and ``compute_language_model_loss`` (so tensor parallelism,
vocab-parallel and fused cross-entropy behave exactly as without chunking).

With sequence parallelism the hidden states are this TP rank's shard ``[N_loc/T, b, h]`` and the
output layer all-gathers each chunk across the T ranks, so chunk rows ``[a, c)`` of the shards become
global rows ``{t·N_loc/T + a … t·N_loc/T + c − 1 : t < T}`` (:func:`sequence_parallel_rows`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

ChunkLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def sequence_parallel_rows(
    shard_len: int, parallel_size: int, start: int, stop: int, device: torch.device | None = None
) -> torch.Tensor:
    """Rows of the full sequence held by the all-gather of shard rows ``[start, stop)``, in gather order.

    int64 ``[parallel_size·(stop − start)]``; shard t holds full rows ``[t·shard_len, (t+1)·shard_len)``.
    """
    shard_starts = torch.arange(parallel_size, device=device)[:, None] * shard_len
    return (shard_starts + torch.arange(start, stop, device=device)[None, :]).reshape(-1)


def chunked_language_model_loss(
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    chunk_loss: ChunkLoss,
    chunk_size: int,
    sequence_parallel_size: int = 1,
) -> torch.Tensor:
    """Per-token loss ``[b, N]`` of ``hidden_states [N/T, b, h]`` and ``labels [b, N]``, chunk by chunk.

    ``chunk_loss(hidden_chunk [r, b, h], labels_chunk [b, T·r]) -> [b, T·r]`` is the output layer
    plus cross-entropy of one chunk; T = ``sequence_parallel_size`` is the number of shards its
    all-gather joins (1 without sequence parallelism). Chunks hold ⌈chunk_size / T⌉ rows of the
    shard, the last one fewer. Under autograd each chunk is recomputed in backward, so no chunk's
    logits outlive its own forward.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be an integer >= 1 (positions per chunk)")
    if not isinstance(sequence_parallel_size, int) or sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size={sequence_parallel_size!r} must be an integer >= 1")
    if hidden_states.dim() != 3 or labels.dim() != 2:
        raise ValueError(
            f"expected hidden_states [N/T, b, h] and labels [b, N], got {tuple(hidden_states.shape)} "
            f"and {tuple(labels.shape)}"
        )
    shard_len, batch = hidden_states.shape[:2]
    if labels.shape != (batch, shard_len * sequence_parallel_size):
        raise ValueError(
            f"labels {tuple(labels.shape)} do not match hidden_states {tuple(hidden_states.shape)} "
            f"with sequence_parallel_size={sequence_parallel_size}: expected "
            f"({batch}, {shard_len * sequence_parallel_size})"
        )
    rows_per_chunk = -(-chunk_size // sequence_parallel_size)
    recompute = torch.is_grad_enabled()
    losses, order = [], []
    for start, hidden_chunk in zip(range(0, shard_len, rows_per_chunk), hidden_states.split(rows_per_chunk)):
        rows = sequence_parallel_rows(
            shard_len, sequence_parallel_size, start, start + hidden_chunk.shape[0], device=labels.device
        )
        labels_chunk = labels.index_select(1, rows)
        if recompute:
            losses.append(
                checkpoint(chunk_loss, hidden_chunk, labels_chunk, use_reentrant=False, preserve_rng_state=False)
            )
        else:
            losses.append(chunk_loss(hidden_chunk, labels_chunk))
        order.append(rows)
    loss = torch.cat(losses, dim=1)
    if sequence_parallel_size == 1:
        return loss
    return loss.index_select(1, torch.argsort(torch.cat(order)))


class ChunkedLossOutputProcessor:
    """A ``GPTModel`` ``output_processor`` computing the language-model loss in chunks of ``chunk_size`` positions.

    Returns what ``GPTModel`` returns without it: the per-token loss ``[b, s]`` when labels are
    given, else the logits ``[b, s, V/TP]`` (computed whole; only training needs chunking).
    """

    def __init__(self, chunk_size: int):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be an integer >= 1 (positions per chunk)")
        self.chunk_size = chunk_size

    def __call__(
        self,
        *,
        hidden_states: torch.Tensor,
        output_layer,
        output_weight: torch.Tensor | None,
        labels: torch.Tensor | None,
        runtime_gather_output: bool | None,
        compute_language_model_loss,
        scale_logits,
        **_,
    ) -> torch.Tensor:
        def logits_of(hidden: torch.Tensor) -> torch.Tensor:
            logits, _ = output_layer(hidden, weight=output_weight, runtime_gather_output=runtime_gather_output)
            return scale_logits(logits)

        if labels is None:
            return logits_of(hidden_states).transpose(0, 1).contiguous()

        def chunk_loss(hidden: torch.Tensor, chunk_labels: torch.Tensor) -> torch.Tensor:
            return compute_language_model_loss(chunk_labels, logits_of(hidden))

        shards = output_layer.tp_group.size() if output_layer.sequence_parallel else 1
        return chunked_language_model_loss(hidden_states, labels, chunk_loss, self.chunk_size, shards)
