"""The bars regrouped by column for the one-pass backward (``mtraining_kernels.bar_words``), built by Triton's CPU
interpreter, against a direct regrouping of the same lists in Python: every row's distinct columns, each
(chunk, query block) membership word, and each chunk's bounds: its first and past-the-last query block with a
nonzero word."""

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

from mtraining_kernels.bar_words import (
    BAR_WORD_COLUMNS,
    MAX_WALK,
    MIN_WALK,
    PROGRAMS_PER_MULTIPROCESSOR,
    bar_words_by_column,
    walk_length,
)
from mtraining_kernels.index import convert_index
from mtraining_kernels.layout import Layout


def _expected(bar_ptr, bar_col, num_chunks):
    """(columns per row z·Hq + h, words [b·Hq, C, nb, 2] as Python ints) regrouped by hand."""
    batch, heads, num_blocks = bar_ptr.shape[0], bar_ptr.shape[1], bar_ptr.shape[2] - 1
    columns, words = {}, {}
    for z in range(batch):
        for h in range(heads):
            lists = [bar_col[bar_ptr[z, h, i] : bar_ptr[z, h, i + 1]].tolist() for i in range(num_blocks)]
            distinct = sorted({c for cols in lists for c in cols})
            columns[z * heads + h] = distinct
            slot = {c: s for s, c in enumerate(distinct)}
            for i, cols in enumerate(lists):
                for c in cols:
                    chunk, bit = divmod(slot[c], BAR_WORD_COLUMNS)
                    key = (z * heads + h, chunk, i, bit // 64)
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
            lists = bar_words_by_column(bar_ptr, index.bar_col, key_len, index.vertical_width, 4)
            assert all(t.is_contiguous() for t in (lists.column, lists.count, lists.words, lists.bounds))
            num_chunks = lists.words.shape[1]
            columns, words = _expected(bar_ptr, index.bar_col, num_chunks)
            assert any(columns.values()), "the case must have bars"
            for row, distinct in columns.items():
                assert lists.count[row] == len(distinct)
                assert lists.column[row, : len(distinct)].tolist() == distinct
                assert not lists.column[row, len(distinct) :].any()
            got = {
                key: _as_unsigned(int(value))
                for key, value in zip(
                    map(tuple, lists.words.nonzero().tolist()), lists.words[lists.words != 0].tolist()
                )
            }
            assert got == words
            _check_bounds(lists, num_blocks=bar_ptr.shape[-1] - 1)


def _check_bounds(lists, num_blocks):
    """Each chunk's bounds are (nb − its first, its end) over the blocks with a nonzero word, (0, 0) without."""
    used = (lists.words != 0).any(-1)  # [rows, C, nb]
    rows, num_chunks = used.shape[:2]
    assert lists.bounds.shape == (rows, num_chunks, 2)
    for row in range(rows):
        for chunk in range(num_chunks):
            blocks = used[row, chunk].nonzero().flatten().tolist()
            expected = [num_blocks - blocks[0], blocks[-1] + 1] if blocks else [0, 0]
            assert lists.bounds[row, chunk].tolist() == expected, (row, chunk)


@pytest.mark.parametrize("multiprocessors", [1, 132])
def test_a_chunk_with_bars_in_every_block_walks_them_all(multiprocessors):
    """One row whose only chunk has bars in every query block: its bounds span the sequence, in segments of
    the shortest walk."""
    num_blocks = 64
    bar_ptr = torch.arange(num_blocks + 1, dtype=torch.int32).view(1, 1, -1)
    bar_col = torch.zeros(num_blocks, dtype=torch.int32)  # column 0 in every block
    lists = bar_words_by_column(bar_ptr, bar_col, num_blocks * 128, 1, multiprocessors)
    assert lists.walk == MIN_WALK
    assert lists.bounds.tolist() == [[[num_blocks, num_blocks]]]
    _check_bounds(lists, num_blocks)


def test_walk_length_bounds_the_programs_per_multiprocessor():
    assert walk_length(16 * 9, 1024, 132) == 32  # 128K: 16 rows of 9 chunks
    assert walk_length(16 * 33, 4096, 132) == MAX_WALK  # 512K
    assert walk_length(16 * 3, 256, 132) == MIN_WALK  # 32K
    for chunk_rows, num_blocks in ((16 * 9, 1024), (48, 256), (7, 3000)):
        walk = walk_length(chunk_rows, num_blocks, 132)
        assert walk == MAX_WALK or chunk_rows * -(-num_blocks // walk) <= PROGRAMS_PER_MULTIPROCESSOR * 132
