"""The quality study (examples/quality/): task generator, pattern-recall metric, a CPU training smoke run, report.

* The task: needles sit where asked (the depth-controlled one at 1 + round(depth · (H − pair_len))),
  never overlap, keys are distinct, key-specific values use their key's tokens, every query's answer
  is its key's value, the last query asks the depth-controlled needle; fillers follow their rules;
  labels and masks point at the answer tokens; batches are deterministic per (seed, stream, index).
* Recall: the chunked mask equals ``vertical_slash_mask``; the full pattern covers all mass (1.0);
  with uniform attention (q = 0) and a mask of the diagonal blocks plus one vertical, the covered mass
  has a closed form; random q/k match an fp64 dense computation.
* Training: a 2-layer model at 128 → 512 → 1024 tokens, dense and MTraining (torch_blocksparse), 9 steps:
  the loss decreases, the JSON has the records, the densities, the phase times (attention time inside
  them), the evaluation grid and the per-layer recall after each recall length's phase; a time budget
  stops training but not the evaluation; the lr schedule, the phase and sparsity-schedule syntax.
* The staged study (study.py, a tiny plan): stages A, B, C run one after another, a finished stage is
  skipped when run again, a stage cut short (B before a run's checkpoint, C inside a run's evaluation)
  resumes at that run with every step, phase, recall and evaluated length recorded once, a stage whose
  predecessor is missing refuses, ``--check`` passes the long plan and refuses a budget that does not fit;
  the dense branch repeats the uninterrupted dense run step for step; the schedule run switches its static
  budget by length; the report writes its figures, the summary (targets, recommendation; also with an
  unfinished run) and quality.jsonl (delta = accuracy − dense accuracy inside its interval, stage_train_s > 0).
* The paired interval (Newcombe's): equals two published worked examples, contains the difference, keeps a
  width with no differing sequence, flips sign with the runs, equals the normal approximation on large samples.
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
MODEL = [
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
    "--lr",
    "3e-3",
    "--warmup",
    "2",
    "--log-interval",
    "2",
    "--eval-samples",
    "2",
    "--eval-depths",
    "0,1",
    "--eval-lengths",
    "512,1024",
    "--recall-lengths",
    "512,1024",
    "--sink-tokens",
    "16",
    "--local-window",
    "64",
    "--seed",
    "7",
]
PHASES = "128x8x3x2,512x4x3,1024x2x3"
SMOKE = ["--phases", PHASES, *MODEL, "--device", "cpu"]
TOP_P = ["--attention", "mtraining", "--top-p", "0.9", "--cap", "64"]


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
def smoke_runs(tmp_path_factory, study):
    """An uninterrupted dense run of the whole curriculum, and the study's top-P run (branched from its shared
    dense start)."""
    import train

    out = tmp_path_factory.mktemp("quality")
    with one_process_megatron():
        train.main(["--run", "dense", "--out", str(out), "--attention", "dense", *SMOKE])
    return {"dense": json.loads((out / "dense.json").read_text()), "sparse": study["runs"]["topp0.9"]}


@pytest.mark.parametrize("name", ["dense", "sparse"])
def test_training_smoke_writes_results_and_learns(smoke_runs, name):
    run = smoke_runs[name]
    assert run["status"] == "done" and run["steps_done"] == run["steps_planned"] == 9 and not run["stopped_early"]
    assert [r["seq_len"] for r in run["train"]] == [128] * 3 + [512] * 3 + [1024] * 3
    assert run["kernel"] == "torch_blocksparse" and run["mtraining"]["dense"] == (name == "dense")
    assert run["budget"] == ("dense" if name == "dense" else "top-p 0.9")
    losses = [record["lm_loss"] for record in run["train"]]
    assert len(losses) == 9 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2
    evaluation = run["eval"]
    assert evaluation["lengths"] == [512, 1024] and evaluation["samples"] == [2, 2]
    assert [len(row) for row in evaluation["accuracy"]] == [2, 2]
    assert all(0.0 <= a <= 1.0 for row in evaluation["accuracy"] for a in row)
    assert all(np.isfinite(evaluation["lm_loss"]))
    assert [(m["seq_len"], m["step"]) for m in run["recall"]] == [(512, 6), (1024, 9)]  # after each phase
    for measured in run["recall"]:
        expected_settings = ["top-p 0.9", "top-p 0.95"] if name == "dense" else ["top-p 0.9"]
        assert sorted(measured["by_setting"]) == expected_settings
        assert measured["own"] == (None if name == "dense" else "top-p 0.9")
        for layers in measured["by_setting"].values():
            assert [entry["layer"] for entry in layers] == [1, 2]
            for entry in layers:
                assert len(entry["recall"]) == 4 and all(0.0 < r <= 1.0 + 1e-5 for r in entry["recall"])
                assert all(0.0 < d <= 1.0 for d in entry["density"])
    density = {record["step"]: (record["seq_len"], record["density"]) for record in run["train"] if "density" in record}
    assert sorted(density) == [2, 3, 4, 6, 8, 9] and all(len(d) == 2 for _, d in density.values())  # + phase ends
    for seq_len, layers in density.values():
        if name == "dense" or seq_len == 128:  # one block of 128: every index covers the whole triangle
            assert layers == pytest.approx([1.0, 1.0])
        else:  # cap 64 = the forced window: block distances 0, 1 + 64 columns
            assert all(0.0 < d < 1.0 for d in layers)
    trained_by = [run["run"]] * 3 if name == "dense" else ["shared", run["run"], run["run"]]
    assert [(p["seq_len"], p["steps"], p["run"]) for p in run["phases"]] == list(
        zip([128, 512, 1024], [3] * 3, trained_by)
    )
    for phase in run["phases"]:
        steps = [r for r in run["train"] if r["seq_len"] == phase["seq_len"]]
        assert phase["train_s"] == pytest.approx(sum(r["step_s"] for r in steps), abs=1e-4)
        assert 0 < phase["attention_s"] < phase["train_s"]  # the timer saw forward and backward
        assert phase["attention_fwd_s"] > 0 and phase["attention_bwd_s"] > 0


def test_sparse_run_from_scratch_starts_like_dense(smoke_runs, tmp_path):
    """Same seed, same data and initial weights: an MTraining run from scratch agrees closely with the dense one
    on its first step (128 tokens, one block: the same full attention, only the kernels' rounding differs)."""
    import train

    flags = ["--phases", "128x8x1x2", *SMOKE[2:], "--eval-lengths", "128", "--recall-lengths", "128"]
    with one_process_megatron():
        sparse = train.main(["--run", "sparse", "--out", str(tmp_path), *TOP_P, *flags, "--eval-samples", "1"])
    assert sparse["status"] == "done" and sparse["mtraining"]["dense"] is False
    assert sparse["train"][0]["lm_loss"] == pytest.approx(smoke_runs["dense"]["train"][0]["lm_loss"], rel=1e-3)


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
    assert len(run["train"]) == run["steps_done"] and len(run["eval"]["accuracy"]) == 2


def test_schedule_phase_and_sparsity_parsing():
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
    schedule = train.parse_sparsity("0.8:16384,0.9:32768,0.95")
    assert schedule == ((0.8, 16384), (0.9, 32768), (0.95, None))
    got = [train.sparsity_at(schedule, n) for n in (2048, 16384, 16512, 32768, 131072)]
    assert got == [0.8, 0.8, 0.9, 0.9, 0.95]
    assert train.parse_sparsity("0.95") == ((0.95, None),)
    for bad in ("1.0", "0.9:abc", "0.9:1024", "0.9,0.95", "0.8:4096,0.9:2048,0.95", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            train.parse_sparsity(bad)


# ------------------------------------------------------------------------------------------ staged study
STUDY_RUNS = {
    "dense": ["--attention", "dense", "--recall-top-p", "0.9", "--recall-sparsity", "0.25"],
    "static": ["--attention", "mtraining", "--sparsity", "0.25"],
    "topp0.9": TOP_P,
    "schedule": ["--attention", "mtraining", "--sparsity", "0.25:512,0.5"],
}


def _plan(path: Path) -> Path:
    plan = {"phases": PHASES, "stages": [1, 2, 3], "runs": STUDY_RUNS, "baseline": "dense", "flags": MODEL}
    path.write_text(json.dumps(plan | {"prefix": "quality"}))
    return path


class Killed(Exception):
    """Stands for a run killed in the middle of a stage."""


@contextmanager
def killed_after_save(run: str, when):
    """Kill run ``run`` right after the first write of its JSON at which ``when(data)`` holds."""
    import train

    save, fired = train.Results.save, []

    def save_then_kill(results):
        save(results)
        if not fired and results.data["run"] == run and when(results.data):
            fired.append(run)
            raise Killed(run)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train.Results, "save", save_then_kill)
        yield
    assert fired, f"{run} was never killed"


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Stages A, B and C of a tiny plan, each one command; B is cut short in ``static`` (after its 512-token
    phase, before its checkpoint) and run again, then once more (everything done: skipped); C is cut short in
    ``topp0.9`` (after its first evaluated length) and run again."""
    import study as study_module

    root = tmp_path_factory.mktemp("study")
    plan, out, docs = _plan(root / "plan.json"), root / "out", root / "docs"
    command = ["--plan", str(plan), "--out", str(out), "--report-to", str(docs), "--device", "cpu"]
    killed = {}
    with one_process_megatron():
        study_module.main(["--stage", "A", *command])
        cut_b = killed_after_save("static", lambda data: data["phases"][-1]["run"] == "static")
        with cut_b, pytest.raises(Killed):
            study_module.main(["--stage", "B", *command])
        killed["B"] = json.loads((out / "runs" / "static.json").read_text())
        killed["B checkpoints"] = sorted(p.name for p in (out / "runs").glob("*.pt"))
        before = _mtimes(out / "runs")
        study_module.main(["--stage", "B", *command])
        assert {name: t for name, t in _mtimes(out / "runs").items() if name in before and "dense" in name} == {
            name: t for name, t in before.items() if "dense" in name
        }  # the finished dense run was skipped
        written = _mtimes(out / "runs")
        study_module.main(["--stage", "B", *command])
        assert _mtimes(out / "runs") == written
        cut_c = killed_after_save("topp0.9", lambda data: len(data.get("eval", {}).get("accuracy", [])) == 1)
        with cut_c, pytest.raises(Killed):
            study_module.main(["--stage", "C", *command])
        killed["C"] = json.loads((out / "runs" / "topp0.9.json").read_text())
        study_module.main(["--stage", "C", *command])
    runs = {name: json.loads((out / "runs" / f"{name}.json").read_text()) for name in STUDY_RUNS}
    return {"root": root, "out": out, "docs": docs, "runs": runs, "command": command, "killed": killed}


def test_stages_cut_short_resume_without_duplicate_records(study):
    killed, runs = study["killed"], study["runs"]
    # the cut left a run JSON in training with its records so far, and no checkpoint of that run
    assert killed["B"]["status"] == "training" and killed["B"]["steps_done"] == 6
    assert [(p["seq_len"], p["run"]) for p in killed["B"]["phases"]] == [(128, "shared"), (512, "static")]
    assert killed["B checkpoints"] == ["dense.phase2.pt"]
    assert killed["C"]["status"] == "evaluating" and len(killed["C"]["eval"]["accuracy"]) == 1
    for name, run in runs.items():  # every step, phase, recall and evaluated length once
        assert [r["step"] for r in run["train"]] == list(range(1, 10)), name
        assert [p["seq_len"] for p in run["phases"]] == [128, 512, 1024]
        assert [m["seq_len"] for m in run["recall"]] == [512, 1024]
        assert run["eval"]["lengths"] == [512, 1024] and len(run["eval"]["accuracy"]) == 2
    again, before = ([r["lm_loss"] for r in run["train"]] for run in (runs["topp0.9"], killed["C"]))
    assert again == pytest.approx(before, rel=1e-6)  # stage C trained the same steps again


def test_study_stages_write_checkpoints_and_branch(study, smoke_runs):
    out, runs = study["out"], study["runs"]
    assert (out / "shared.phase1.pt").is_file() and json.loads((out / "shared.json").read_text())["steps_done"] == 3
    shared = json.loads((out / "shared.json").read_text())
    for name, run in runs.items():
        assert (out / "runs" / f"{name}.phase2.pt").is_file()
        assert run["status"] == "done" and run["steps_done"] == 9
        assert [(r["run"], r["step"]) for r in run["resumed_from"]] == [("shared", 3), (name, 6)]
        assert run["train"][:3] == shared["train"]  # the shared phase's records
        assert [(p["seq_len"], p["run"]) for p in run["phases"]] == [(128, "shared"), (512, name), (1024, name)]
        assert [m["seq_len"] for m in run["recall"]] == [512, 1024]
    # the dense branch (two resumes) repeats the uninterrupted dense run step for step
    for mine, theirs in zip(runs["dense"]["train"], smoke_runs["dense"]["train"], strict=True):
        assert mine["lm_loss"] == pytest.approx(theirs["lm_loss"], rel=1e-6), mine["step"]
    assert runs["dense"]["eval"]["lm_loss"] == pytest.approx(smoke_runs["dense"]["eval"]["lm_loss"], rel=1e-6)
    assert runs["static"]["train"][3]["lm_loss"] != pytest.approx(runs["dense"]["train"][3]["lm_loss"], rel=1e-9)
    # the schedule's static budget follows the length: denser at 512 (0.25) than at 1024 (0.5)
    schedule = {p["seq_len"]: p for p in runs["schedule"]["phases"]}
    assert (schedule[512]["budget"], schedule[1024]["budget"]) == ("static 0.25", "static 0.5")
    assert np.mean(schedule[1024]["density"]) < np.mean(schedule[512]["density"]) < 1.0
    assert [m["own"] for m in runs["schedule"]["recall"]] == ["static 0.25", "static 0.5"]
    assert runs["schedule"]["budget"] == "static 0.25 to 512, 0.5 beyond"


def test_study_report_and_quality_jsonl(study):
    docs, runs = study["docs"], study["runs"]
    for figure in ("accuracy_heatmap", "loss_curves", "density", "recall", "stage_time"):
        assert (docs / f"quality_{figure}.png").stat().st_size > 1000
    text = (docs / "quality_summary.md").read_text()
    assert "Paired on the same sequences" in text and "Recommendation" in text and "one setting" in text
    assert "static: accuracy within 1 point of dense" in text and "phase trains >= 3x faster" in text
    assert "- target: one MTraining setting within 1 point of dense at every evaluated length" in text
    records = [json.loads(line) for line in (docs / "quality.jsonl").read_text().splitlines()]
    assert sorted((r["run"], r["seq_len"]) for r in records) == sorted((n, k) for n in STUDY_RUNS for k in (512, 1024))
    dense = {r["seq_len"]: r for r in records if r["run"] == "dense"}
    for record in records:
        run = runs[record["run"]]
        lengths = run["eval"]["lengths"]
        correct = run["eval"]["correct"][lengths.index(record["seq_len"])]
        assert record["accuracy"] == pytest.approx(np.mean(correct))
        assert record["attention"] == run["attention"] and record["n_sequences"] == 4
        assert record["delta_vs_dense"] == pytest.approx(record["accuracy"] - dense[record["seq_len"]]["accuracy"])
        assert record["delta_ci_low"] <= record["delta_vs_dense"] <= record["delta_ci_high"]
        phase = next(p for p in run["phases"] if p["seq_len"] == record["seq_len"])
        assert record["stage_train_s"] == phase["train_s"] > 0 and record["stage_steps"] == 3
        assert 0 < record["attention_s"] < record["stage_train_s"]
        assert record["lm_loss"] == run["eval"]["lm_loss"][lengths.index(record["seq_len"])]
        assert 0 < record["density"] <= 1 and record["budget"] == phase["budget"]
        assert record["speedup_vs_dense"] == pytest.approx(dense[record["seq_len"]]["stage_train_s"] / phase["train_s"])
    assert all(r["density"] == 1.0 and r["status"] == "baseline" for r in dense.values())
    assert {r["budget"] for r in records if r["run"] == "schedule"} == {"static 0.25", "static 0.5"}


def test_target_needs_one_setting_not_worse_at_every_length_and_fast_enough(study):
    """The summary's target line: MET only by a MTraining run not worse than dense at every length dense was
    evaluated at and >= 3x faster in the longest phase."""
    import report

    runs, dense = list(study["runs"].values()), study["runs"]["dense"]
    records = report.quality_records(runs, dense)

    def verdict(edit) -> str:
        edited = []
        for record in map(dict, records):
            if record["run"] != "dense":
                record.update(status="worse", speedup_vs_dense=1.0)
                if record["run"] == "static":
                    record.update(status="matches", speedup_vs_dense=3.5)
            edited += edit(record)
        (line,) = [check for check in report.target_checks(runs, dense, edited) if check.startswith("target:")]
        return line.rsplit(": ", 1)[1]

    assert verdict(lambda r: [r]) == "MET by static"
    slow = {"speedup_vs_dense": 2.9}
    assert verdict(lambda r: [r | slow if r["run"] == "static" and r["seq_len"] == 1024 else r]) == "NOT MET"
    worse = {"status": "worse"}
    assert verdict(lambda r: [r | worse if r["run"] == "static" and r["seq_len"] == 512 else r]) == "NOT MET"
    assert verdict(lambda r: [] if r["run"] == "static" and r["seq_len"] == 512 else [r]) == "NOT MET"  # missing


def test_report_compares_only_like_with_like(study):
    """No speed-up between phases of different step counts; no pairing of runs evaluated on other sequences."""
    import copy

    import report

    dense, static = study["runs"]["dense"], study["runs"]["static"]
    short = copy.deepcopy(static)
    short["phases"][-1]["steps"] -= 1  # its 1024-token phase cut short
    speedups = {r["seq_len"]: r["speedup_vs_dense"] for r in report.quality_records([dense, short], dense)}
    assert speedups[512] is not None and speedups[1024] is None
    assert report.paired_accuracy(static, dense)
    other = copy.deepcopy(static)
    other["settings"]["eval_tokens"] //= 2  # another --eval-tokens can draw other sequences: not paired
    assert report.paired_accuracy(other, dense) == {}


def test_study_check_passes_the_long_plans_and_names_a_budget_that_does_not_fit(tmp_path):
    """``--check`` runs train.py's up-front checks of every run of every stage without training: the long plans
    pass (static 0.95 first trains at 16K); branching it after the 2K phase puts static 0.95 at 8K, refused."""
    import study as study_module

    study_module.main(["--stage", "all", "--check", "--out", str(tmp_path / "out")])
    study_module.main(["--stage", "all", "--check", "--out", str(tmp_path / "out"), "--plan", "long_cap"])
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(study_module.PLANS["long"], stages=[3, 7, 8])))
    refused = r"^\[static0\.95\] stage B: .*sparsity=0\.95 cannot be guaranteed at seq_len=8192"
    with pytest.raises(SystemExit, match=refused):
        study_module.main(["--stage", "all", "--check", "--out", str(tmp_path / "out"), "--plan", str(bad)])


def test_study_refuses_a_stage_before_its_predecessor_and_reports_an_unfinished_run(study, tmp_path):
    import report
    import study as study_module

    with one_process_megatron(), pytest.raises(SystemExit, match="run --stage A first"):
        study_module.main(["--stage", "B", *study["command"][:2], "--out", str(tmp_path / "fresh"), "--device", "cpu"])
    with pytest.raises(SystemExit):
        study_module.main(["--stage", "D", *study["command"]])
    runs = list(study["runs"].values())
    killed = dict(study["runs"]["static"], run="killed", status="training")
    for key in ("eval", "recall"):
        killed.pop(key)
    records = report.quality_records([*runs, killed], study["runs"]["dense"])
    text = report.summary([*runs, killed], "dense", {}, records)
    assert "| killed | mtraining |" in text and not any(r["run"] == "killed" for r in records)


def test_branching_rejects_mismatched_or_missing_checkpoints(study, tmp_path):
    import train

    shared = str(study["out"] / "shared.phase1.pt")
    with one_process_megatron():
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
                    shared,
                    *SMOKE,
                    "--lr",
                    "2e-3",
                ]
            )
        with pytest.raises(ValueError, match="sparsity=0.25 cannot be guaranteed at seq_len=128"):
            train.main(
                ["--run", "static", "--out", str(tmp_path), "--attention", "mtraining", "--sparsity", "0.25", *SMOKE]
            )
    assert not (tmp_path / "other.json").exists()
    for flags in (
        ["--stop-after-phase", "3"],
        ["--stop-after-phase", "0"],
        ["--resume", str(tmp_path / "none.pt")],
        ["--stop-after-phase", "1", "--resume", shared],  # the checkpoint is already there
        ["--sparsity", "0.5", "--top-p", "0.9"],
        ["--eval-samples", "2,2,2"],
        ["--recall-lengths", "2048"],
    ):
        with one_process_megatron(), pytest.raises(SystemExit):
            train.main(["--run", "x", "--out", str(tmp_path), "--attention", "dense", *SMOKE, *flags])


# ------------------------------------------------------------------------------------------ paired comparison
def test_evaluation_keeps_every_sequence_and_report_pairs_them(smoke_runs):
    """eval.correct holds each evaluated sequence's 0/1 ([length][depth][sample], consistent with the accuracy),
    and the report pairs the same sequences of two runs."""
    import report

    evaluation = smoke_runs["dense"]["eval"]
    assert [len(by_depth) for by_depth in evaluation["correct"]] == [len(evaluation["depths"])] * 2
    for row, by_depth, samples in zip(evaluation["accuracy"], evaluation["correct"], evaluation["samples"]):
        assert [sum(c) / samples for c in by_depth] == row
        assert all(len(c) == samples and set(c) <= {0, 1} for c in by_depth)

    def run_with(correct, samples=4):  # 2 depths x 4 samples at one length
        return {
            "run": "x",
            "eval": {"lengths": [512], "depths": [0.0, 1.0], "samples": [samples], "correct": [correct]},
        }

    base = run_with([[1, 1, 0, 0], [1, 0, 1, 0]])
    other = run_with([[1, 0, 0, 1], [1, 0, 1, 1]])  # differences: 0 −1 0 +1 | 0 0 0 +1
    (got,) = report.paired_accuracy(other, base).values()
    assert got["delta"] == pytest.approx(1 / 8) and (got["only_baseline"], got["only_run"], got["n"]) == (1, 2, 8)
    assert got["ci_low"] < 0 < got["delta"] < got["ci_high"]
    other_depths = {"run": "y", "eval": {"lengths": [512], "depths": [0.0], "samples": [4], "correct": [[[1] * 4]]}}
    assert report.paired_accuracy(other_depths, base) == {}  # not the same sequences: no pairing


def _table(a: int, b: int, c: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """0/1 of two runs with a sequences both right, b only the first, c only the second, d neither."""
    first = np.array([1] * a + [1] * b + [0] * c + [0] * d)
    second = np.array([1] * a + [0] * b + [1] * c + [0] * d)
    return first, second


@pytest.mark.parametrize(
    "table, interval",
    [
        # Newcombe, Statistics in Medicine 17 (1998) 2635-2650, Table II example (a), method 10
        ((36, 12, 2, 0), (0.0569, 0.3404)),
        # Fagerland, Lydersen & Laake, Statistical Analysis of Contingency Tables (2017), ch. 8: complete response
        # before and after consolidation therapy (Cavo et al. 2012), Newcombe square-and-add interval
        ((59, 6, 16, 80), (-0.1186, -0.0046)),
    ],
)
def test_paired_interval_matches_published_worked_examples(table, interval):
    """Newcombe's paired interval by hand for (a, b, c, d) = (36, 12, 2, 0), n = 50: p₁ = 48/50, p₂ = 38/50,
    Δ = 0.2; Wilson (0.8654, 0.9890) and (0.6259, 0.8570); ad − bc = −24 < 0, so φ = −24 / √(48·2·38·12) =
    −0.1147 (no correction); L = 0.2 − √(0.0946² + 2·0.1147·0.0946·0.0970 + 0.0970²) = 0.0569 and
    U = 0.2 + √(0.1341² + 2·0.1147·0.1341·0.0290 + 0.0290²) = 0.3404."""
    import report

    assert report.wilson(48, 50) == pytest.approx((0.8654, 0.9890), abs=5e-5)  # the docstring's Wilson intervals
    assert report.wilson(38, 50) == pytest.approx((0.6259, 0.8570), abs=5e-5)
    got = report.paired_difference(*_table(*table))
    assert got["delta"] == pytest.approx((table[1] - table[2]) / sum(table))
    assert (got["ci_low"], got["ci_high"]) == pytest.approx(interval, abs=5e-5)


def test_paired_interval_properties():
    import report

    for a, b, c, d in ((40, 3, 5, 40), (88, 0, 0, 0), (44, 0, 0, 44), (0, 0, 0, 88), (10, 6, 0, 72), (3, 1, 2, 2)):
        ours, theirs = _table(a, b, c, d)
        got = report.paired_difference(ours, theirs)
        assert got["delta"] == pytest.approx((b - c) / (a + b + c + d))
        assert -1 <= got["ci_low"] <= got["delta"] <= got["ci_high"] <= 1
        assert got["ci_high"] - got["ci_low"] > 0.01  # a width even when no sequence differs
        flipped = report.paired_difference(theirs, ours)
        assert (flipped["ci_low"], flipped["ci_high"]) == pytest.approx((-got["ci_high"], -got["ci_low"]))
    # large samples: the normal approximation over the per-sequence differences
    ours, theirs = _table(4500, 600, 500, 4400)
    got = report.paired_difference(ours, theirs)
    diff = ours - theirs
    half = 1.96 * diff.std(ddof=1) / np.sqrt(diff.size)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((diff.mean() - half, diff.mean() + half), abs=5e-4)
    with pytest.raises(ValueError, match="same"):
        report.paired_difference([1, 0], [1])
