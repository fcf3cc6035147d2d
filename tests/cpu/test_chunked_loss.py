"""Chunked output layer + cross-entropy (megatron_mtraining.chunked_loss) equals the full computation.

A linear output layer with per-token cross-entropy in fp64: chunked loss values and the gradients of
the hidden states and the output weight under random per-token upstream gradients (a loss mask)
match the unchunked computation; the chunks really are recomputed in backward and no logits are
kept by autograd; with sequence parallelism the rows of each all-gathered chunk land in their
original positions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_mtraining.chunked_loss import (
    ChunkedLossOutputProcessor,
    chunked_language_model_loss,
    sequence_parallel_rows,
)

SEQ, BATCH, HIDDEN, VOCAB = 53, 2, 16, 97
RTOL = 1e-12


def _problem(seed: int, seq: int = SEQ):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(seq, BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64) * 0.3
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    upstream = (torch.rand(BATCH, seq, generator=gen) < 0.7).double() * torch.rand(
        BATCH, seq, generator=gen, dtype=torch.float64
    )
    return hidden, weight, labels, upstream


def _linear_cross_entropy(weight, calls=None, repeats: int = 1):
    """``chunk_loss`` of a linear output layer; ``repeats`` emulates the sequence-parallel gather of equal shards."""

    def chunk_loss(hidden_chunk, labels_chunk):
        if calls is not None:
            calls.append(hidden_chunk.shape[0])
        gathered = hidden_chunk.repeat(repeats, 1, 1)  # [T·r, b, h]
        logits = gathered @ weight.T  # [T·r, b, V]
        return F.cross_entropy(logits.permute(1, 2, 0), labels_chunk, reduction="none")  # [b, T·r]

    return chunk_loss


def _leaves(hidden, weight):
    return hidden.clone().requires_grad_(), weight.clone().requires_grad_()


@pytest.mark.parametrize("chunk_size", [1, 8, 17, SEQ, 4 * SEQ])
def test_chunked_loss_and_gradients_equal_full(seed, chunk_size):
    hidden, weight, labels, upstream = _problem(seed)
    full_hidden, full_weight = _leaves(hidden, weight)
    full = _linear_cross_entropy(full_weight)(full_hidden, labels)
    (full * upstream).sum().backward()

    chunk_hidden, chunk_weight = _leaves(hidden, weight)
    calls = []
    chunked = chunked_language_model_loss(chunk_hidden, labels, _linear_cross_entropy(chunk_weight, calls), chunk_size)
    chunks = len(calls)
    assert chunks == -(-SEQ // chunk_size) and max(calls) <= chunk_size, f"chunk rows {calls} (seed={seed})"
    (chunked * upstream).sum().backward()
    assert len(calls) == 2 * chunks, f"backward must recompute each of the {chunks} chunks once, calls={calls}"

    assert chunked.shape == (BATCH, SEQ)
    torch.testing.assert_close(chunked, full, rtol=RTOL, atol=0, msg=lambda m: f"loss (seed={seed}): {m}")
    torch.testing.assert_close(
        chunk_hidden.grad, full_hidden.grad, rtol=RTOL, atol=1e-14, msg=lambda m: f"hidden grad (seed={seed}): {m}"
    )
    torch.testing.assert_close(
        chunk_weight.grad, full_weight.grad, rtol=1e-10, atol=1e-13, msg=lambda m: f"weight grad (seed={seed}): {m}"
    )


def test_autograd_keeps_no_logits(seed):
    """Everything autograd saves for the chunked loss is far smaller than one chunk's logits."""
    hidden, weight, labels, _ = _problem(seed)
    hidden, weight = _leaves(hidden, weight)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        chunked_language_model_loss(hidden, labels, _linear_cross_entropy(weight), chunk_size=8)
    one_chunk_logits = 8 * BATCH * VOCAB
    assert saved and max(saved) < one_chunk_logits, f"saved tensor sizes {saved} (seed={seed})"


@pytest.mark.parametrize("shards", [2, 3])
def test_sequence_parallel_rows_restore_the_sequence_order(seed, shards):
    """T identical shards: chunked rows must come back in sequence order (labels differ per copy)."""
    shard_len = 19
    hidden, weight, labels, upstream = _problem(seed, seq=shard_len * shards)
    shard = hidden[:shard_len]
    ref_shard, ref_weight = _leaves(shard, weight)
    reference = _linear_cross_entropy(ref_weight, repeats=shards)(ref_shard, labels)
    (reference * upstream).sum().backward()

    chunk_shard, chunk_weight = _leaves(shard, weight)
    chunked = chunked_language_model_loss(
        chunk_shard,
        labels,
        _linear_cross_entropy(chunk_weight, repeats=shards),
        chunk_size=8,
        sequence_parallel_size=shards,
    )
    (chunked * upstream).sum().backward()
    torch.testing.assert_close(chunked, reference, rtol=RTOL, atol=0, msg=lambda m: f"seed={seed}: {m}")
    torch.testing.assert_close(chunk_shard.grad, ref_shard.grad, rtol=RTOL, atol=1e-14)
    torch.testing.assert_close(chunk_weight.grad, ref_weight.grad, rtol=1e-10, atol=1e-13)


def test_sequence_parallel_rows_are_the_all_gather_order():
    full = torch.arange(4 * 10)
    shards = full.view(4, 10)
    gathered = torch.cat([shards[t, 3:7] for t in range(4)])
    assert torch.equal(full[sequence_parallel_rows(10, 4, 3, 7)], gathered)


def test_bad_input_is_refused():
    hidden, weight, labels, _ = _problem(0)
    loss = _linear_cross_entropy(weight)
    with pytest.raises(ValueError, match="chunk_size=0 must be an integer >= 1"):
        chunked_language_model_loss(hidden, labels, loss, 0)
    with pytest.raises(ValueError, match=r"expected \(2, 106\)"):
        chunked_language_model_loss(hidden, labels, loss, 8, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="expected hidden_states"):
        chunked_language_model_loss(hidden[:, 0], labels, loss, 8)
    with pytest.raises(ValueError, match="chunk_size=-1"):
        ChunkedLossOutputProcessor(-1)
