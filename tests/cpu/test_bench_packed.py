"""tools/bench_packed.py run for real on the CPU (``--backend torch_blocksparse``, eager FlexAttention, a tiny
shape): every mixture builds its per-document index, our packed and all-dense runs and Flex's document-causal
kernel run, Flex's cross-check against our dense-document run passes, and the table pairs each row with Flex."""

import json
import time

import pytest
from tool_modules import load_tool

bench_packed = load_tool("bench_packed")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _once(forward, backward, warmup, reps):
    """One timed call on the CPU (the tool's CUDA-event timing needs a GPU)."""
    start = time.perf_counter()
    result = forward()
    middle = time.perf_counter()
    backward(result)
    return (middle - start) * 1e3, (time.perf_counter() - middle) * 1e3


def _median_ms(fn, reps):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@pytest.mark.parametrize(
    "pattern",
    [
        ["--pattern", "budget", "--sparsity", "0.9", "--profile"],
        ["--pattern", "realistic", "--far-slashes", "20", "--far-verticals", "20"],
    ],
    ids=["budget-profiled", "realistic"],
)
def test_smoke_run_on_cpu(tmp_path, monkeypatch, capsys, pattern):
    monkeypatch.setattr(bench_packed, "SHAPES", {"tiny": (4, 2, 64)})
    monkeypatch.setattr(bench_packed, "measure", _once)
    monkeypatch.setattr(bench_packed, "median_ms", _median_ms)
    jsonl, table = tmp_path / "packed.jsonl", tmp_path / "packed.md"
    bench_packed.main(
        [
            "--backend",
            "torch_blocksparse",
            "--shape",
            "tiny",
            "--seq-lens",
            "2048",
            "--min-sparse-length",
            "256",
            *pattern,
            "--jsonl",
            str(jsonl),
            "--table",
            str(table),
        ]
    )
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    impls = {(row["mixture"], row["impl"]) for row in rows}
    for mixture in bench_packed.MIXTURES:
        for impl in ("mtraining_packed", "mtraining_packed_dense", "flex_document_causal"):
            assert (mixture, impl) in impls, f"no {impl} row for {mixture}"
    assert ("single", "mtraining_unpacked") in impls
    by_key = {(row["mixture"], row["impl"]): row for row in rows}
    for mixture in bench_packed.MIXTURES:
        assert by_key[mixture, "mtraining_packed_dense"]["density"] == 1.0
        assert 0.0 < by_key[mixture, "mtraining_packed"]["density"] < 1.0, mixture
        assert max(by_key[mixture, "flex_document_causal"]["flex_check"].values()) < bench_packed.FLEX_REL_RMSE
    assert by_key["single", "mtraining_packed"]["documents"] == 1
    assert by_key["uniform4k", "mtraining_packed"]["documents"] == 1  # 4K documents: one at N = 2048
    assert by_key["prolong", "mtraining_packed"]["documents"] > 1
    assert all(row["pattern"] == pattern[1] for row in rows)
    text = table.read_text()
    assert ("budget 0.90 pattern" if pattern[1] == "budget" else "realistic pattern") in text
    assert text.count("\n| ") == len(rows) + 1  # header and one line per row
    assert "| prolong | 2048 |" in text and "mtraining_packed" in text
    printed = capsys.readouterr().out
    profiled = "--profile" in pattern
    for mixture in bench_packed.MIXTURES:
        assert (f"# index kernel times, per-document estimation, {mixture} N=2048" in printed) == profiled
