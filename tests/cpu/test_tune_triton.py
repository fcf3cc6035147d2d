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


@pytest.mark.parametrize(
    ("kernel", "config_name", "config"),
    [
        ("key_major", "KEY_MAJOR_CONFIG", {"num_warps": 4, "num_stages": 2, "QUERY_ROWS": 32}),
        ("bar_chunk", "BAR_CHUNK_CONFIG", {"num_warps": 8, "num_stages": 4, "QUERY_ROWS": 128}),
    ],
)
def test_pass_config_patch_applies_inside_and_restores_after(kernel, config_name, config):
    before = dict(getattr(triton_backend, config_name))
    with tune_triton.patched(kernel, config):
        assert getattr(triton_backend, config_name) == config
    assert getattr(triton_backend, config_name) == before


@pytest.mark.parametrize(
    ("kernel", "asked", "deterministic"),
    [("backward", False, False), ("bar_chunk", False, True), ("backward", True, True), ("key_major", True, True)],
)
def test_each_pass_is_checked_and_timed_in_the_mode_that_launches_it(monkeypatch, kernel, asked, deterministic):
    """The default backward never launches the bar-chunk pass: its candidates are compared with, and timed on, the
    deterministic backward, the others on the default one unless ``--deterministic`` asks for that mode."""
    modes = []
    outputs = {name: torch.ones(2) for name in ("out", "dq", "dk", "dv")}

    def fake_outputs(q, k, v, dout, index, deterministic):
        modes.append(deterministic)
        return outputs

    def fake_sparse_attention(q, k, v, index, backend, deterministic):
        modes.append(deterministic)

    def fake_measure(forward, backward, warmup, reps):
        forward()
        return 1.0, 2.0

    monkeypatch.setattr(tune_triton, "attention_outputs", fake_outputs)
    monkeypatch.setattr(tune_triton, "sparse_attention", fake_sparse_attention)
    monkeypatch.setattr(tune_triton, "measure", fake_measure)
    rows = []
    options = type("Options", (), {"warmup": 1, "reps": 1, "rmse_bound": 1e-3, "deterministic": asked})
    q = torch.zeros(1, 128, 16, 128)  # read for its head dim only
    tune_triton.sweep_pattern(
        "sparse", q, None, None, None, None, 0.05, [kernel], options, lambda **row: rows.append(row)
    )
    assert len(rows) == len(tune_triton.CANDIDATES[kernel]) and all(row["status"] == "ok" for row in rows)
    assert all(row["ms"] == 2.0 for row in rows)  # the backward's time
    assert modes and set(modes) == {deterministic}
    assert all(row["deterministic"] == deterministic for row in rows)


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
