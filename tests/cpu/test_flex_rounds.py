"""tools/flex_rounds.py: its reading of the rounds into per-round ratios, and its refusals, each naming the
offending value, before any work."""

import pytest
import torch
from tool_modules import load_tool

flex_rounds = load_tool("flex_rounds")
OURS, FLEX = flex_rounds.IMPLEMENTATIONS


def _row(impl, round_, fwd, bwd, queued=None):
    row = dict(impl=impl, round=round_, fwd_ms=fwd, bwd_ms=bwd)
    if queued is not None:
        row.update(fwd_queued_ms=queued[0], bwd_queued_ms=queued[1])
    return row


def test_each_round_is_read_as_flex_over_ours_and_rounds_missing_one_side_are_left_out():
    """Ratios of each round's own pair: 12/8, 13/10, 16/10 → median 1.5, range 1.3–1.6; the ratio of the median
    times is 13/10; round 3 has no Flex row and round 4 no row of ours, so neither counts."""
    rows = [
        _row(OURS, 0, 2.0, 6.0, queued=(1.0, 3.0)),
        _row(FLEX, 0, 4.0, 8.0, queued=(2.0, 4.0)),
        _row(FLEX, 1, 5.0, 8.0, queued=(2.0, 5.0)),  # listed before ours: order does not matter
        _row(OURS, 1, 3.0, 7.0, queued=(2.0, 3.0)),
        _row(OURS, 2, 4.0, 6.0, queued=(1.0, 4.0)),
        _row(FLEX, 2, 6.0, 10.0, queued=(3.0, 5.0)),
        _row(OURS, 3, 1.0, 1.0, queued=(1.0, 1.0)),
        _row(FLEX, 4, 9.0, 9.0, queued=(9.0, 9.0)),
    ]
    launched = flex_rounds.ratio_summary(rows)
    assert launched == pytest.approx(dict(median=1.5, low=1.3, high=1.6, of_medians=1.3, rounds=3))
    queued = flex_rounds.ratio_summary(rows, "_queued")
    assert queued == pytest.approx(dict(median=1.5, low=1.4, high=1.6, of_medians=7 / 5, rounds=3))


def test_rows_without_a_common_round_are_refused():
    with pytest.raises(ValueError, match="no round holds both"):
        flex_rounds.ratio_summary([_row(OURS, 0, 1.0, 1.0), _row(FLEX, 1, 1.0, 1.0)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-lens", "131072", "1000"], "--seq-lens 1000: give positive multiples of 128"),
        (["--seq-lens", "0"], "--seq-lens 0: give positive multiples of 128"),
        (["--rounds", "0"], "--rounds 0: give at least 1"),
        (["--reps", "0"], "--reps 0: give at least 1"),
        (["--warmup", "-1"], "--warmup -1: give 0 or more"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(argv, message):
    with pytest.raises(SystemExit, match=message):
        flex_rounds.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_a_gpu_it_stops_before_building_inputs():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        flex_rounds.main(["--seq-lens", "1024"])


@pytest.mark.parametrize("mode", [flex_rounds.PAIRED, flex_rounds.CALLER])
def test_the_one_pair_timings_are_read_from_their_own_field(mode):
    """The rounds' ratios in a one-event-pair mode come from ``step{mode}_ms`` (3/2 and 5/4 → median 1.375),
    not from the split fields' sums (which would give 1.0)."""
    rows = [
        dict(_row(OURS, 0, 1.0, 1.0), **{f"step{mode}_ms": 2.0}),
        dict(_row(FLEX, 0, 1.0, 1.0), **{f"step{mode}_ms": 3.0}),
        dict(_row(OURS, 1, 1.0, 1.0), **{f"step{mode}_ms": 4.0}),
        dict(_row(FLEX, 1, 1.0, 1.0), **{f"step{mode}_ms": 5.0}),
    ]
    assert flex_rounds.ratio_summary(rows, mode) == pytest.approx(
        dict(median=1.375, low=1.25, high=1.5, of_medians=4 / 3, rounds=2)
    )
    assert flex_rounds.step_ms(rows[0], mode) == 2.0
    assert flex_rounds.ratio_summary(rows)["median"] == pytest.approx(1.0)


def test_a_round_times_each_mode_by_its_own_measure(monkeypatch):
    """The split modes go through ``measure`` with their queue lead, the one-pair modes through ``measure_step``,
    autograd's multithreading off only for the calling-thread mode and restored after it, for every implementation
    in the round's order."""
    calls = []

    def fake_measure(forward, backward, warmup, reps, lead):
        calls.append(("measure", forward(), lead, torch.autograd.is_multithreading_enabled()))
        return 1.0 + lead, 2.0 + lead

    def fake_measure_step(forward, backward, warmup, reps):
        threaded = torch.autograd.is_multithreading_enabled()
        calls.append(("measure_step", forward(), None, threaded))
        return 7.0 if threaded else 6.0

    monkeypatch.setattr(flex_rounds, "measure", fake_measure)
    monkeypatch.setattr(flex_rounds, "measure_step", fake_measure_step)
    steps = {impl: (lambda impl=impl: impl, None) for impl in (OURS, FLEX)}
    paired, caller = flex_rounds.PAIRED, flex_rounds.CALLER
    leads = {"": 0.0, paired: 0.0, caller: 0.0, "_queued": 20.0}
    timings = flex_rounds.time_round(steps, (FLEX, OURS), leads, warmup=1, reps=3)
    assert timings[OURS] == {
        "fwd_ms": 1.0,
        "bwd_ms": 2.0,
        f"step{paired}_ms": 7.0,
        f"step{caller}_ms": 6.0,
        "fwd_queued_ms": 21.0,
        "bwd_queued_ms": 22.0,
    }
    assert timings[FLEX] == timings[OURS]
    assert calls == [
        ("measure", FLEX, 0.0, True),
        ("measure", OURS, 0.0, True),
        ("measure_step", FLEX, None, True),
        ("measure_step", OURS, None, True),
        ("measure_step", FLEX, None, False),
        ("measure_step", OURS, None, False),
        ("measure", FLEX, 20.0, True),
        ("measure", OURS, 20.0, True),
    ]
    assert torch.autograd.is_multithreading_enabled()
