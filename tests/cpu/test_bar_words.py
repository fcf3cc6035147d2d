"""The bars regrouped by column for the one-pass backward (``mtraining_kernels.bar_words``), built by Triton's CPU
interpreter, against a direct regrouping of the same lists in Python: every row's distinct columns, each
(chunk, query block) membership word, and walk ranges that cover exactly the blocks with a nonzero word."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter tests run only on machines without CUDA"
)
pytest.importorskip("triton")

from triton_cases import make_index

from mtraining_kernels.bar_words import BAR_WORD_COLUMNS, bar_words_by_column, word_splits
from mtraining_kernels.index import convert_index
from mtraining_kernels.layout import Layout


def _expected(bar_ptr, bar_col, num_chunks):
    """(columns per row, words [b, Hq, C, nb, 2] as Python ints) regrouped by hand."""
    batch, heads, num_blocks = bar_ptr.shape[0], bar_ptr.shape[1], bar_ptr.shape[2] - 1
    columns, words = {}, {}
    for z in range(batch):
        for h in range(heads):
            lists = [bar_col[bar_ptr[z, h, i] : bar_ptr[z, h, i + 1]].tolist() for i in range(num_blocks)]
            distinct = sorted({c for cols in lists for c in cols})
            columns[z, h] = distinct
            slot = {c: s for s, c in enumerate(distinct)}
            for i, cols in enumerate(lists):
                for c in cols:
                    chunk, bit = divmod(slot[c], BAR_WORD_COLUMNS)
                    key = (z, h, chunk, i, bit // 64)
                    words[key] = words.get(key, 0) | (1 << (bit % 64))
    return columns, words


def _as_unsigned(word: int) -> int:
    return word & (2**64 - 1)


@pytest.mark.parametrize(
    "layout, pattern, seq_len",
    [
        (Layout("contiguous", 1), "bars", 2048),
        (Layout("striped", 2), "mixed", 4096),
        (Layout("zigzag", 2), "bars", 4096),
    ],
)
def test_words_match_a_direct_regrouping(layout, pattern, seq_len):
    gen = torch.Generator().manual_seed(seq_len + len(pattern))
    v_idx, s_idx = make_index(2, 3, seq_len, pattern, gen)
    for rank in range(layout.world_size):
        index = convert_index(v_idx, s_idx, layout, rank, seq_len)
        key_len = seq_len // layout.world_size
        for source in range(layout.world_size):
            bar_ptr = index.bar_ptr[source]
            lists = bar_words_by_column(bar_ptr, index.bar_col, key_len, index.vertical_width)
            assert all(t.is_contiguous() for t in (lists.column, lists.count, lists.words, lists.ranges))
            num_chunks = lists.words.shape[2]
            columns, words = _expected(bar_ptr, index.bar_col, num_chunks)
            assert any(columns.values()), "the case must have bars"
            for (z, h), distinct in columns.items():
                assert lists.count[z, h] == len(distinct)
                assert lists.column[z, h, : len(distinct)].tolist() == distinct
                assert not lists.column[z, h, len(distinct) :].any()
            got = {
                key: _as_unsigned(int(value))
                for key, value in zip(
                    map(tuple, lists.words.nonzero().tolist()), lists.words[lists.words != 0].tolist()
                )
            }
            assert got == words
            used = (lists.words != 0).any(-1)  # [b, Hq, C, nb]
            ranges = lists.ranges.view(*used.shape[:3], lists.splits, 2)
            for z, h, c in (
                (z, h, c) for z in range(used.shape[0]) for h in range(used.shape[1]) for c in range(num_chunks)
            ):
                parts = ranges[z, h, c].tolist()
                assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), parts
                blocks = used[z, h, c].nonzero().flatten().tolist()
                if blocks:
                    assert parts[0][0] == blocks[0] and parts[-1][1] == blocks[-1] + 1
                else:
                    assert all(first == end for first, end in parts)


def test_splits_give_a_step_enough_programs():
    assert word_splits(1) == 16
    assert word_splits(144) == 8
    assert word_splits(1024) == 1
