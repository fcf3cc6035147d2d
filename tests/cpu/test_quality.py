"""The quality study (examples/quality/): task generator, pattern-recall metric, a CPU training smoke run, report.

* The task: needles sit where asked (the depth-controlled one at 1 + round(depth · (H − pair_len))),
  never overlap, keys are distinct, key-specific values use their key's tokens, every query's answer
  is its key's value, the last query asks the depth-controlled needle; fillers follow their rules;
  labels and masks point at the answer tokens; batches are deterministic per (seed, stream, index).
* Recall: the chunked mask equals ``vertical_slash_mask``; the full pattern covers all mass (1.0);
  with uniform attention (q = 0) and a mask of the diagonal blocks plus one vertical, the covered mass
  has a closed form; random q/k match an fp64 dense computation.
* Training: a 2-layer model at 256 → 512 tokens, dense and MTraining (torch_blocksparse), 12 steps: the
  loss decreases, the JSON has the records, the densities, the evaluation grid and the per-layer recall;
  a time budget stops training but not the evaluation; the lr schedule and the phase syntax.
* The report writes its figures and a summary with the target checks, also with an unfinished run.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

QUALITY = Path(__file__).resolve().parents[2] / "examples" / "quality"
sys.path.insert(0, str(QUALITY))

from recall import covered_mass
from tasks import BOS, KV, QUERY, RetrievalTask, query_correct

from mtraining_kernels.reference import vertical_slash_mask
from mtraining_kernels.vertical_slash import full_index


# ------------------------------------------------------------------------------------------ task
def _pairs_in(tokens: np.ndarray, task: RetrievalTask, haystack: int) -> dict[tuple, tuple]:
    """{key: value} of the needles in a haystack, read back from the tokens."""
    pairs = {}
    for start in np.flatnonzero(tokens[1 : 1 + haystack] == KV) + 1:
        key = tuple(tokens[start + 1 : start + 1 + task.key_len])
        pairs[key] = tuple(tokens[start + 1 + task.key_len : start + task.pair_len])
    return pairs


TASKS = {
    "key-specific walks": RetrievalTask(),
    "shared phrases": RetrievalTask(
        vocab_size=512,
        key_alphabet=64,
        key_len=2,
        value_choices=100,
        key_specific_values=False,
        filler="phrases",
        num_queries=3,
    ),
}


@pytest.mark.parametrize("kind", sorted(TASKS))
@pytest.mark.parametrize("seq_len", [512, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_needle_at_requested_depth_and_answers_correct(kind, seq_len, depth, seed):
    task = TASKS[kind]
    sequence = task.sequence(np.random.default_rng(seed), seq_len, target_depth=depth)
    tokens, haystack = sequence["tokens"], task.haystack_len(seq_len)
    assert tokens.shape == (seq_len,) and tokens[0] == BOS
    starts = np.sort(sequence["needle_starts"])
    assert len(starts) == task.num_pairs and np.all(np.diff(starts) >= task.pair_len)  # no overlap
    assert starts[0] >= 1 and starts[-1] + task.pair_len <= 1 + haystack
    target_start = 1 + round(depth * (haystack - task.pair_len))
    assert sequence["needle_starts"][0] == target_start and tokens[target_start] == KV
    pairs = _pairs_in(tokens, task, haystack)
    assert len(pairs) == task.num_pairs  # distinct keys
    for key, value in pairs.items():
        assert all(task.key_base <= t < task.value_base for t in key)
        assert all(task.value_base <= t < task.filler_base for t in value)
        if task.key_specific_values:  # slot i of key k uses the tokens reserved for (k, i)
            slots = (np.array(value) - task.value_base) // task.value_choices
            assert list(slots) == [(key[0] - task.key_base) * task.value_len + i for i in range(task.value_len)]
    # everything else in the haystack is filler
    filler = np.ones(seq_len, dtype=bool)
    filler[0] = False
    for start in sequence["needle_starts"]:
        filler[start : start + task.pair_len] = False
    filler[1 + haystack :] = False
    assert np.all(tokens[filler] >= task.filler_base)
    # each query: Q, a needle's key, its value; the last query asks the depth-controlled needle and ends the sequence
    asked = []
    for span in sequence["answer_spans"]:
        query = span - task.key_len
        assert tokens[query] == QUERY
        key = tuple(tokens[query + 1 : span + 1])
        assert tuple(tokens[span + 1 : span + 1 + task.value_len]) == pairs[key]
        asked.append(key)
    assert len(set(asked)) == task.num_queries and sequence["target"] == task.num_queries - 1
    assert asked[-1] == tuple(tokens[target_start + 1 : target_start + 1 + task.key_len])
    assert sequence["answer_spans"][-1] + task.value_len == seq_len - 1


def test_fillers_follow_their_rules(seed):
    rng = np.random.default_rng(seed)
    walks = RetrievalTask()._filler(rng, 1000) - RetrievalTask().filler_base
    steps = (walks[2:] - walks[:-2]) % RetrievalTask().filler_alphabet  # t[i+2] = t[i] + δ, δ in 1 … 4
    assert set(np.unique(steps)) == {1, 2, 3, 4}
    task = RetrievalTask(filler="phrases", phrases=5, phrase_len=7)
    text = task._filler(rng, 700).reshape(100, 7)
    assert len({tuple(row) for row in text}) <= 5 and np.all(text >= task.filler_base)


def test_batch_labels_masks_and_determinism(seed):
    task = RetrievalTask(num_pairs=8, num_queries=3)
    batch = task.batch(seed, 0, 5, 3, 1024, target_depth=0.5)
    again = task.batch(seed, 0, 5, 3, 1024, target_depth=0.5)
    other = task.batch(seed, 0, 6, 3, 1024, target_depth=0.5)
    assert torch.equal(batch.tokens, again.tokens) and not torch.equal(batch.tokens, other.tokens)
    assert not torch.equal(task.batch(seed, 1, 5, 3, 1024).tokens, task.batch(seed, 0, 5, 3, 1024).tokens)
    assert not torch.equal(task.batch(seed, 0, 5, 3, 1024, 0.2).tokens, batch.tokens)
    assert torch.equal(batch.labels[:, :-1], batch.tokens[:, 1:]) and batch.loss_mask[:, -1].sum() == 0
    slots = batch.answer_slots
    assert slots.shape == (3, 3, task.value_len) and batch.target == 2
    answers = batch.labels.gather(1, slots.flatten(1))
    assert torch.all((answers >= task.value_base) & (answers < task.filler_base))
    assert torch.equal(batch.answer_mask.nonzero()[:, 1].view(3, -1), slots.flatten(1).sort(-1).values)
    # accuracy: perfect predictions are all correct; one wrong answer token fails only its query
    predictions = batch.labels.clone()
    assert query_correct(predictions, batch.labels, slots).all()
    predictions[1, slots[1, 0, 1]] += 1
    correct = query_correct(predictions, batch.labels, slots)
    assert not correct[1, 0] and correct.sum() == correct.numel() - 1


def test_task_rejects_bad_settings():
    with pytest.raises(ValueError, match="num_queries"):
        RetrievalTask(num_pairs=2, num_queries=3)
    with pytest.raises(ValueError, match="vocab_size"):
        RetrievalTask(vocab_size=300)
    with pytest.raises(ValueError, match="key_len=1"):
        RetrievalTask(key_len=2)
    with pytest.raises(ValueError, match="filler"):
        RetrievalTask(filler="lorem")
    with pytest.raises(ValueError, match="seq_len"):
        RetrievalTask().check_length(128)
    with pytest.raises(ValueError, match="target_depth"):
        RetrievalTask().sequence(np.random.default_rng(0), 1024, target_depth=1.5)


# ------------------------------------------------------------------------------------------ recall
def _random_index(gen: torch.Generator, batch: int, heads: int, seq_len: int, width: int = 16):
    v_idx = torch.randint(0, seq_len + 1, (batch, heads, width), generator=gen).sort(-1).values.int()
    s_idx = torch.randint(0, seq_len + 1, (batch, heads, width), generator=gen).sort(-1).values.int()
    return v_idx, s_idx


def test_full_pattern_covers_all_mass(seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 384, 4, 16, generator=gen) * 3, torch.randn(1, 384, 2, 16, generator=gen) * 3
    v_idx, s_idx = full_index(1, 4, 384)
    recall = covered_mass(q, k, v_idx, s_idx, row_chunk=100)
    torch.testing.assert_close(recall, torch.ones(1, 4, dtype=torch.float64), rtol=0, atol=1e-6)


def test_uniform_attention_one_vertical_closed_form():
    """q = 0: every row attends uniformly. Mask: the diagonal blocks plus column c of block 0 (no slash beyond
    the diagonal). Rows i < 128 see everything; row i >= 128 covers (i − 127) diagonal-block keys plus c, of i + 1."""
    seq_len, column = 256, 5
    q, k = torch.zeros(1, seq_len, 2, 8), torch.randn(1, seq_len, 1, 8)
    v_idx = torch.tensor([[[column, seq_len]] * 2], dtype=torch.int32)
    s_idx = torch.full((1, 2, 2), seq_len, dtype=torch.int32)
    rows = np.arange(seq_len)
    per_row = np.where(rows < 128, 1.0, (rows - 127 + 1) / (rows + 1))
    recall = covered_mass(q, k, v_idx, s_idx, row_chunk=96)
    torch.testing.assert_close(recall, torch.full((1, 2), per_row.mean(), dtype=torch.float64), rtol=0, atol=1e-6)


def test_recall_matches_fp64_dense_computation(seed):
    gen = torch.Generator().manual_seed(seed)
    seq_len, heads, kv_heads, dim = 256, 4, 2, 16
    q = torch.randn(2, seq_len, heads, dim, generator=gen) * 2
    k = torch.randn(2, seq_len, kv_heads, dim, generator=gen) * 2
    v_idx, s_idx = _random_index(gen, 2, heads, seq_len, width=8)
    mask = vertical_slash_mask(v_idx, s_idx, seq_len)
    k_full = k.double().repeat_interleave(heads // kv_heads, dim=2)
    logits = torch.einsum("bihd,bjhd->bhij", q.double(), k_full) * 0.3
    logits = logits.masked_fill(~torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), float("-inf"))
    expected = (torch.softmax(logits, -1) * mask).sum(-1).mean(-1)
    torch.testing.assert_close(
        covered_mass(q, k, v_idx, s_idx, softmax_scale=0.3, row_chunk=100), expected, rtol=0, atol=1e-5
    )


# ------------------------------------------------------------------------------------------ training smoke
SMOKE = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--ffn",
    "128",
    "--vocab",
    "128",
    "--key-alphabet",
    "8",
    "--value-choices",
    "4",
    "--pairs",
    "4",
    "--queries",
    "2",
    "--phases",
    "256x8x6x2,512x4x6",
    "--lr",
    "3e-3",
    "--warmup",
    "2",
    "--log-interval",
    "4",
    "--eval-samples",
    "2",
    "--eval-depths",
    "0,1",
    "--eval-lengths",
    "512",
    "--recall-lengths",
    "512",
    "--sink-tokens",
    "16",
    "--local-window",
    "64",
    "--cap",
    "64",
    "--seed",
    "7",
    "--device",
    "cpu",
]


@contextmanager
def one_process_megatron():
    """Let train.main set up its one-process group and Megatron state, and tear down what it set up."""
    import torch.distributed as dist
    from megatron_cpu import reset_parallel_state

    had_group = dist.is_initialized()
    try:
        yield
    finally:
        reset_parallel_state()
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    import train

    out = tmp_path_factory.mktemp("quality")
    runs = {}
    with one_process_megatron():
        for name, attention in (
            ("dense", ["--attention", "dense"]),
            ("sparse", ["--attention", "mtraining", "--top-p", "0.9"]),
        ):
            train.main(["--run", name, "--out", str(out), *attention, *SMOKE])
            runs[name] = json.loads((out / f"{name}.json").read_text())
    return runs


@pytest.mark.parametrize("name", ["dense", "sparse"])
def test_training_smoke_writes_results_and_learns(smoke_runs, name):
    run = smoke_runs[name]
    assert run["status"] == "done" and run["steps_done"] == run["steps_planned"] == 12 and not run["stopped_early"]
    assert [r["seq_len"] for r in run["train"]] == [256] * 6 + [512] * 6
    assert run["kernel"] == "torch_blocksparse" and run["mtraining"]["dense"] == (name == "dense")
    losses = [record["lm_loss"] for record in run["train"]]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
    evaluation = run["eval"]
    assert evaluation["lengths"] == [512] and len(evaluation["accuracy"]) == 1 and len(evaluation["accuracy"][0]) == 2
    assert all(0.0 <= a <= 1.0 for a in evaluation["accuracy"][0]) and np.isfinite(evaluation["lm_loss"][0])
    (measured,) = run["recall"]
    expected_settings = ["top-p 0.9", "top-p 0.95"] if name == "dense" else ["top-p 0.9"]
    assert measured["seq_len"] == 512 and sorted(measured["by_setting"]) == expected_settings
    for layers in measured["by_setting"].values():
        assert [entry["layer"] for entry in layers] == [1, 2]
        for entry in layers:
            assert len(entry["recall"]) == 4 and all(0.0 < r <= 1.0 + 1e-5 for r in entry["recall"])
            assert all(0.0 < d <= 1.0 for d in entry["density"])
    density = {record["step"]: (record["seq_len"], record["density"]) for record in run["train"] if "density" in record}
    assert sorted(density) == [4, 8, 12] and all(len(d) == 2 for _, d in density.values())
    for seq_len, layers in density.values():
        if name == "dense" or seq_len == 256:  # 2 blocks of 128: every index covers the whole triangle
            assert layers == pytest.approx([1.0, 1.0])
        else:  # cap 64 = the forced window: block distances 0, 1 + 64 columns
            assert all(0.0 < d < 1.0 for d in layers)


def test_same_seed_same_data_and_initial_weights(smoke_runs):
    """Dense and sparse runs start from the same weights and batches: the first step's loss agrees closely
    (the sparse pattern changes the attention a little at initialisation)."""
    dense, sparse = smoke_runs["dense"]["train"][0], smoke_runs["sparse"]["train"][0]
    assert dense["lm_loss"] == pytest.approx(sparse["lm_loss"], rel=1e-2)


def test_report_writes_figures_and_summary(smoke_runs, tmp_path):
    import report

    results = tmp_path / "results"
    results.mkdir()
    for name, run in smoke_runs.items():
        (results / f"{name}.json").write_text(json.dumps(run))
    report.main([str(results), "--out", str(tmp_path / "figures"), "--baseline", "dense", "--smooth", "3"])
    for figure in ("quality_accuracy_heatmap.png", "quality_loss_curves.png", "quality_recall.png"):
        assert (tmp_path / "figures" / figure).stat().st_size > 1000
    text = (tmp_path / "figures" / "quality_summary.md").read_text()
    assert "sparse: accuracy within 1 point of dense" in text and "LM loss within 2%" in text
    assert "recall >= 0.9 in every layer" in text
    assert "Paired on the same sequences" in text and "| sparse | " in text.split("Paired on the same sequences")[1]
    learned = max(np.mean(row) for row in smoke_runs["dense"]["eval"]["accuracy"]) >= report.LEARNED_ACCURACY
    assert ("WARNING: dense reaches at most" in text) != learned  # 12 steps hardly learn the task
    # a run killed before its evaluation still reports (its cells n/a)
    unfinished = dict(smoke_runs["sparse"], run="killed", status="training")
    for key in ("eval", "recall"):
        unfinished.pop(key)
    (results / "killed.json").write_text(json.dumps(unfinished))
    report.main([str(results), "--out", str(tmp_path / "figures"), "--baseline", "dense", "--smooth", "3"])
    assert "| killed | n/a |" in (tmp_path / "figures" / "quality_summary.md").read_text()


def test_time_budget_stops_training_and_still_evaluates(tmp_path):
    import train

    with one_process_megatron():
        run = train.main(
            [
                "--run",
                "short",
                "--out",
                str(tmp_path),
                "--attention",
                "dense",
                "--time-budget-s",
                "1",
                "--eval-reserve-s",
                "0.9",
                *SMOKE,
            ]
        )
    saved = json.loads((tmp_path / "short.json").read_text())
    assert saved == json.loads(json.dumps(run))
    assert run["stopped_early"] and run["steps_done"] < run["steps_planned"] and run["status"] == "done"
    assert len(run["train"]) == run["steps_done"] and len(run["eval"]["accuracy"]) == 1


def test_schedule_and_phase_parsing():
    import argparse

    import train

    args = argparse.Namespace(lr=1.0, warmup=10, decay_fraction=0.25, min_lr_ratio=0.1)
    rates = [train.learning_rate(step, 100, args) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)  # linear warm-up
    assert all(rate == pytest.approx(1.0) for rate in rates[10:76])  # stable
    assert all(a > b for a, b in zip(rates[75:], rates[76:])) and rates[-1] < 0.11  # cosine decay
    assert train.learning_rate(100, 100, args) == pytest.approx(0.1)
    assert train.parse_phases("256x32x10x8,2048x8x5") == [(256, 32, 10, 8), (2048, 8, 5, None)]
    for bad in ("256x32", "300x1x1", "256x0x1", "256x1x1x0", "axbxc"):
        with pytest.raises(argparse.ArgumentTypeError):
            train.parse_phases(bad)


def test_branch_from_checkpoint_continues_the_uninterrupted_run(smoke_runs, tmp_path):
    """A dense run resumed from the --stop-after-phase 1 checkpoint repeats the uninterrupted dense run step for step
    (same weights, optimizer state, data and schedule); a sparse branch shares the first phase's records."""
    import train

    branches = tmp_path / "runs"
    with one_process_megatron():
        shared = train.main(
            ["--run", "shared", "--out", str(tmp_path), "--attention", "dense", "--stop-after-phase", "1", *SMOKE]
        )
        dense = train.main(
            [
                "--run",
                "dense",
                "--out",
                str(branches),
                "--attention",
                "dense",
                "--resume",
                str(tmp_path / "shared.pt"),
                *SMOKE,
            ]
        )
        sparse = train.main(
            [
                "--run",
                "sparse",
                "--out",
                str(branches),
                "--attention",
                "mtraining",
                "--top-p",
                "0.9",
                "--resume",
                str(tmp_path / "shared.pt"),
                *SMOKE,
            ]
        )
    assert shared["status"] == "checkpointed" and shared["steps_done"] == shared["steps_planned"] == 6
    assert "eval" not in shared and (tmp_path / "shared.pt").is_file()
    whole = smoke_runs["dense"]
    for branch in (dense, sparse):
        assert branch["status"] == "done" and branch["resumed_from"]["step"] == 6 and branch["steps_done"] == 12
        assert [r["step"] for r in branch["train"]] == list(range(1, 13))
        assert branch["train"][:6] == shared["train"]
    for mine, theirs in zip(dense["train"], whole["train"], strict=True):
        assert mine["lm_loss"] == pytest.approx(theirs["lm_loss"], rel=1e-6), mine["step"]
    assert dense["eval"]["lm_loss"] == pytest.approx(whole["eval"]["lm_loss"], rel=1e-6)
    assert sparse["train"][6]["lm_loss"] != pytest.approx(dense["train"][6]["lm_loss"], rel=1e-9)  # attention differs


def test_branching_rejects_mismatched_or_missing_checkpoints(tmp_path):
    import train

    with one_process_megatron():
        train.main(
            ["--run", "shared", "--out", str(tmp_path), "--attention", "dense", "--stop-after-phase", "1", *SMOKE]
        )
        with pytest.raises(ValueError, match=r"'lr': \(0\.003, 0\.002\)"):
            train.main(
                [
                    "--run",
                    "other",
                    "--out",
                    str(tmp_path),
                    "--attention",
                    "dense",
                    "--resume",
                    str(tmp_path / "shared.pt"),
                    *SMOKE,
                    "--lr",
                    "2e-3",
                ]
            )
    assert not (tmp_path / "other.json").exists()
    for flags in (
        ["--stop-after-phase", "2"],
        ["--stop-after-phase", "0"],
        ["--resume", str(tmp_path / "none.pt")],
        ["--stop-after-phase", "1", "--resume", str(tmp_path / "shared.pt")],
    ):
        with pytest.raises(SystemExit):
            train.main(["--run", "x", "--out", str(tmp_path), "--attention", "dense", *SMOKE, *flags])


def test_evaluation_keeps_every_sequence_and_report_pairs_them(smoke_runs):
    """eval.correct holds each evaluated sequence's 0/1 ([length][depth][sample], consistent with the accuracy),
    and the report's paired comparison counts the sequences one run got and the other did not."""
    import report

    dense = smoke_runs["dense"]
    evaluation = dense["eval"]
    assert [len(by_depth) for by_depth in evaluation["correct"]] == [len(evaluation["depths"])]
    for row, by_depth in zip(evaluation["accuracy"], evaluation["correct"]):
        assert [sum(c) / evaluation["samples"] for c in by_depth] == row
        assert all(len(c) == evaluation["samples"] and set(c) <= {0, 1} for c in by_depth)

    def run_with(correct):  # 2 depths x 4 samples at one length
        return {"run": "x", "eval": {"lengths": [512], "depths": [0.0, 1.0], "samples": 4, "correct": [correct]}}

    base = run_with([[1, 1, 0, 0], [1, 0, 1, 0]])
    other = run_with([[1, 0, 0, 1], [1, 0, 1, 1]])  # differences: 0 −1 0 +1 | 0 0 0 +1
    (got,) = report.paired_accuracy(other, base).values()
    diff = np.array([0, -1, 0, 1, 0, 0, 0, 1], dtype=float)
    assert got["delta"] == pytest.approx(100 * diff.mean())
    assert got["half_width"] == pytest.approx(100 * 1.96 * diff.std(ddof=1) / np.sqrt(8))
    assert (got["only_baseline"], got["only_run"], got["n"]) == (1, 2, 8)
    other_depths = {"run": "y", "eval": {"lengths": [512], "depths": [0.0], "samples": 4, "correct": [[[1, 1, 1, 1]]]}}
    assert report.paired_accuracy(other_depths, base) == {}  # not the same sequences: no pairing
