"""tools/profile_step.py's refusals, each naming the offending value, before any work."""

import pytest
import torch
from tool_modules import load_tool

profile_step = load_tool("profile_step")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ours", "--seq-len", "1000"], "--seq-len 1000: give a positive multiple of 128"),
        (["ours", "--seq-len", "0"], "--seq-len 0"),
        (["ours", "--steps", "0"], "--steps 0: give at least 1"),
        (["flex", "--pattern", "vertical_slash"], "--impl flex --pattern vertical_slash"),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(argv, message):
    with pytest.raises(SystemExit, match=message):
        profile_step.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_without_a_gpu_it_stops_before_building_inputs():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        profile_step.main(["cudnn", "--seq-len", "1024"])
