"""tools/tune_triton.py without a GPU: the config patching, the correctness comparison, the candidates."""

import pytest
import torch

pytest.importorskip("triton")

from tool_modules import load_tool

from mtraining_kernels import triton_backend

tune_triton = load_tool("tune_triton")


@pytest.mark.parametrize("dim", [64, 128])
def test_forward_patch_applies_inside_and_restores_after(dim):
    before = triton_backend._forward_config(dim)
    with tune_triton.patched("forward", {"num_warps": 2, "num_stages": 5}):
        assert triton_backend._forward_config(dim) == {"num_warps": 2, "num_stages": 5}
    assert triton_backend._forward_config(dim) == before


def test_backward_patch_applies_inside_and_restores_even_on_error():
    before = dict(triton_backend.QUERY_MAJOR_CONFIG)
    with pytest.raises(RuntimeError, match="launch failed"):
        with tune_triton.patched("backward", {"num_warps": 4, "num_stages": 1}):
            assert triton_backend.QUERY_MAJOR_CONFIG == {"num_warps": 4, "num_stages": 1}
            raise RuntimeError("launch failed")
    assert triton_backend.QUERY_MAJOR_CONFIG == before
    with pytest.raises(ValueError, match="kernel='sideways'"):
        with tune_triton.patched("sideways", {}):
            pass


def test_the_current_configs_are_among_the_candidates():
    """The sweep times the configs in use in the same run, so every row has its baseline."""
    for dim in (64, 128):
        assert tune_triton.current_config("forward", dim) in tune_triton.FORWARD_CANDIDATES
    assert tune_triton.current_config("backward", 128) in tune_triton.BACKWARD_CANDIDATES
    assert tune_triton.current_config("key_major", 128) in tune_triton.KEY_MAJOR_CANDIDATES
    assert tune_triton.current_config("bar_chunk", 128) in tune_triton.BAR_CHUNK_CANDIDATES


def test_key_major_patch_applies_inside_and_restores_after():
    before = dict(triton_backend.KEY_MAJOR_CONFIG)
    config = {"num_warps": 4, "num_stages": 2, "QUERY_ROWS": 32}
    with tune_triton.patched("key_major", config):
        assert triton_backend.KEY_MAJOR_CONFIG == config
    assert triton_backend.KEY_MAJOR_CONFIG == before


def test_worst_rmse_names_the_tensor_that_differs(seed):
    expected = {name: torch.randn(64, 16, dtype=torch.float32) for name in ("out", "dq", "dk", "dv")}
    same = {name: tensor.clone() for name, tensor in expected.items()}
    assert tune_triton.worst_rmse(same, expected)[1] == 0.0
    perturbed = dict(same, dk=expected["dk"] * 1.01)
    name, rmse = tune_triton.worst_rmse(perturbed, expected)
    assert name == "dk" and rmse == pytest.approx(0.01, rel=1e-4)
    broken = dict(same, dv=torch.full_like(expected["dv"], float("nan")))
    assert tune_triton.worst_rmse(broken, expected) == ("dv", float("inf"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_refuses_to_run_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        tune_triton.main(["--seq-len", "4096"])


def test_bar_chunk_patch_applies_inside_and_restores_after():
    before = dict(triton_backend.BAR_CHUNK_CONFIG)
    config = {"num_warps": 8, "num_stages": 4, "QUERY_ROWS": 128}
    with tune_triton.patched("bar_chunk", config):
        assert triton_backend.BAR_CHUNK_CONFIG == config
    assert triton_backend.BAR_CHUNK_CONFIG == before
    assert "bar_chunk" in tune_triton.DETERMINISTIC_KERNELS  # the only backward that launches it
