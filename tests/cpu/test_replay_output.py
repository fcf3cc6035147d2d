"""``replay_output`` of the single-device entry points (activation recomputation that keeps the attention
output): the forward is skipped, the backward is the same; bad pairs are refused. The ring versions are
in tests/distributed/test_ring.py and test_dense_ring.py, the Megatron wiring in test_megatron_model.py."""

import pytest
import torch
from patterns import random_index
from replay import replay_matches

from megatron_mtraining.config import MTrainingConfig
from mtraining_kernels import sdpa_backend, torch_backend
from mtraining_kernels.index import convert_index
from mtraining_kernels.interface import dense_attention, sparse_attention
from mtraining_kernels.layout import Layout

SEQ_LEN, HEADS, KV_HEADS, DIM = 512, 4, 2, 32


def _inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(1, SEQ_LEN, HEADS, DIM, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, SEQ_LEN, KV_HEADS, DIM, generator=gen) for _ in range(2))
    v_idx, s_idx = random_index(1, HEADS, SEQ_LEN, 40, 6, gen)
    return q, k, v, dout, convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, SEQ_LEN)


CALLS = {  # name: (index → attention(q, k, v, replay_output) → (out, lse), module, forward launcher)
    "sparse": (
        lambda index: (
            lambda q, k, v, replay: sparse_attention(
                q, k, v, index, backend="torch_blocksparse", return_lse=True, replay_output=replay
            )
        ),
        torch_backend,
        "block_bar_forward",
    ),
    "dense": (
        lambda index: (
            lambda q, k, v, replay: dense_attention(q, k, v, impl="flash", return_lse=True, replay_output=replay)
        ),
        sdpa_backend,
        "attention_forward",
    ),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_replay_gives_the_same_output_and_gradients_without_a_forward(seed, call):
    q, k, v, dout, index = _inputs(seed)
    build, module, launcher = CALLS[call]
    attention = build(index)
    assert replay_matches(attention, (q, k, v), dout, module, launcher), (
        f"seed={seed} {call}: the replayed call differs"
    )


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda q: q[0], "replay_output must be the \\(out, lse\\) pair"),
        (lambda q: (q[..., :16].contiguous(), torch.zeros(1, HEADS, SEQ_LEN)), "replay_output out \\(1, 512, 4, 16\\)"),
        (lambda q: (q.double(), torch.zeros(1, HEADS, SEQ_LEN)), "torch.float64 on cpu must match q"),
        (lambda q: (q.clone(), torch.zeros(1, SEQ_LEN, HEADS)), "replay_output lse \\(1, 512, 4\\)"),
        (lambda q: (q.clone(), torch.zeros(1, HEADS, SEQ_LEN, dtype=torch.int32)), "must be a float"),
    ],
)
def test_bad_replay_output_is_refused(call, bad, message):
    q, k, v, _, index = _inputs(0)
    with pytest.raises(ValueError, match=message):
        CALLS[call][0](index)(q, k, v, bad(q))


def test_reference_backend_cannot_keep_the_output():
    with pytest.raises(ValueError, match="--mtraining-keep-attention-output needs a kernel with a separate backward"):
        MTrainingConfig(backend="reference", keep_attention_output=True)
