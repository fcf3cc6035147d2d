"""The CPU quickstart (examples/quickstart.py, ``make demo``) trains.

Its training loop runs briefly on 2 gloo ranks exactly as the demo does (CP = 2, striped layout,
top-P sparse attention through the torch_blocksparse ring, chunked loss, Megatron's mock data) with a
fresh ``--seed``: the loss falls, both ranks agree on it, the attention is sparse and the striped
ring is balanced.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

STEPS = 6
LOSS_DROP = 0.5                 # nats, mean of the last 3 steps below the mean of the first 3
QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart.py")


def _train(rank, world_size, steps, seed):
    spec = importlib.util.spec_from_file_location("quickstart", QUICKSTART)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    return quickstart.train_on_cpu(steps, report=lambda line: None, extra_flags=["--seed", str(seed % 2**31)])


@pytest.mark.slow           # about a minute: two ranks build Megatron's model and mock data, then train
def test_quickstart_loss_falls(distributed, seed):
    records = distributed(_train, 2, STEPS, seed, timeout=600)
    losses = [record["loss"] for record in records[0]]
    assert len(losses) == STEPS
    assert losses == [record["loss"] for record in records[1]], f"ranks disagree on the loss (seed={seed})"
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - LOSS_DROP, f"loss did not fall: {losses} (seed={seed})"
    for record in records[0]:
        assert 0.05 < record["density"] < 0.95, f"step {record['step']}: density {record['density']} (seed={seed})"
        assert 1.0 <= record["worker_imbalance"] < 1.2, f"step {record['step']}: {record} (seed={seed})"
        assert 1.0 <= record["step_imbalance"] < 1.5, f"step {record['step']}: {record} (seed={seed})"
