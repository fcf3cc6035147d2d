import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when it is first imported, and megatron-core imports it early (any test
    # module importing megatron.training does), so the interpreter tests' own setting would come too late.
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(__file__))  # make tests/harness.py importable (also in spawned ranks)

from harness import run_on_ranks


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def distributed():
    """``distributed(fn, world_size, *args)`` runs fn on gloo CPU ranks and returns per-rank results."""
    return run_on_ranks


@pytest.fixture
def seed():
    """A fresh random seed per test, seeded into torch and shown in failures."""
    value = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(value)
    return value
