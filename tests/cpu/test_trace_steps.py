"""tools/trace_steps.py: its reading of a profiler trace into each repetition's GPU ops and gaps, and its refusals,
each naming the offending value, before any work."""

import pytest
import torch
from tool_modules import load_tool

trace_steps = load_tool("trace_steps")


def _annotation(name, ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _launch(correlation, ts, name="cuLaunchKernelEx", cat="cuda_driver"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 5, "args": {"correlation": correlation}}


def _gpu_op(correlation, ts, dur, name, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def test_each_repetition_gets_the_gpu_ops_it_launched_with_their_gaps():
    """Ops belong to the repetition whose annotation holds their launch call, whenever the GPU runs them; the
    first op of a repetition has no gap, the next ones the GPU's idle time since the previous one ended."""
    events = [
        _annotation("REP_1", 5000, 300),  # listed out of order: the reading sorts by time
        _annotation("REP_0", 1000, 400),
        _launch(1, 1100, "cudaLaunchKernel", "cuda_runtime"),
        _gpu_op(1, 1150, 10, "fill", "gpu_memset"),
        _launch(2, 1300),
        _gpu_op(2, 1400, 2000, "block_forward_kernel"),
        _launch(3, 1350),
        _gpu_op(3, 3500, 100, "output_delta_kernel"),  # runs after REP_1 has begun on the host: still REP_0's
        _launch(4, 5100),
        _gpu_op(4, 5600, 50, "one_pass_backward_kernel"),
        _launch(5, 900),  # before any repetition: left out
        _gpu_op(5, 950, 5, "warm-up"),
        {"ph": "X", "cat": "kernel", "name": "no launch", "ts": 1200, "dur": 1, "args": {"correlation": 99}},
        {"ph": "i", "cat": "user_annotation", "name": "REP_9", "ts": 1, "dur": 0},  # not a complete event
    ]
    timelines = trace_steps.rep_timelines(events)
    assert list(timelines) == ["REP_0", "REP_1"]
    first = timelines["REP_0"]
    assert [op.name for op in first] == ["fill", "block_forward_kernel", "output_delta_kernel"]
    assert [(op.launched, op.start, op.duration, op.gap) for op in first] == [
        (100, 150, 10, 0.0),
        (300, 400, 2000, 240),
        (350, 2500, 100, 100),
    ]
    (only,) = timelines["REP_1"]
    assert (only.name, only.launched, only.start, only.gap) == ("one_pass_backward_kernel", 100, 600, 0.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ours", "--seq-len", "1000"], "--seq-len 1000: give a positive multiple of 128"),
        (["ours", "--reps", "0"], "--reps 0: give at least 1"),
        (["flex", "--pattern", "vertical_slash"], "--impl flex --pattern vertical_slash"),
        (["index", "--pattern", "block_only"], "--pattern block_only: the index steps estimate"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(argv, message):
    with pytest.raises(SystemExit, match=message):
        trace_steps.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_a_gpu_it_stops_before_building_inputs():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        trace_steps.main(["ours", "--seq-len", "1024"])
