"""tools/profile_conversion.py: its flags parse, and without a GPU it stops with a clear message before any work
(it was run on an H200: docs/benchmarks.md, "Kernels v2, step 4")."""

import pytest
import torch
from tool_modules import load_tool

profile_conversion = load_tool("profile_conversion")


def test_flags_parse_with_their_defaults():
    args = profile_conversion.parse_args(["--check-contents", "0"])
    assert (args.check_contents, args.seq_len, args.heads, tuple(args.budget)) == (0, 131072, 16, (1000, 6000))


def test_a_bad_flag_value_is_refused():
    with pytest.raises(SystemExit):
        profile_conversion.parse_args(["--check-contents", "2"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without CUDA")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        profile_conversion.main(["--check-contents", "1"])
