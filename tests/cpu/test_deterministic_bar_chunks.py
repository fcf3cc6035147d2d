"""The deterministic backward's bars regrouped by column (``mtraining_kernels.bar_chunks``), run by Triton's CPU
interpreter: built once per index with no host sync, the dk/dv they give are bitwise those of the per-call
regrouping they replaced (torch.unique, host-sized lists, a Python loop over GQA members), kept below as
the oracle."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' @triton.jit
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter tests run only on machines without CUDA"
)
pytest.importorskip("triton")

from document_cases import packed_index_with_cross_document_bars
from tool_modules import load_tool
from triton_cases import make_index, make_qkv_dout

from mtraining_kernels import triton_backend
from mtraining_kernels.bar_chunks import BarChunks, bar_chunks_by_column
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.index import BlockBarIndex, convert_index
from mtraining_kernels.interface import sparse_attention
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.triton_bwd import bar_chunk_backward_kernel


# ------------------------------------------------------------- the oracle: the per-call regrouping it replaced
class _OldBarChunks:
    """The former ``triton_backend._BarChunks``: data-sized lists (host syncs), torch.unique dedup."""

    def __init__(self, bar_ptr, bar_col, num_blocks, key_len):
        first, last = triton_backend._entry_range(bar_ptr)
        counts = (bar_ptr[..., 1:] - bar_ptr[..., :-1]).reshape(-1)
        rows = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=last - first)
        cols = bar_col[first:last].long()
        sample_head, qblock = rows // num_blocks, rows % num_blocks
        distinct, slot_of_entry = torch.unique(sample_head * key_len + cols, return_inverse=True)
        self.row = distinct // key_len
        self.column = (distinct % key_len).to(torch.int32)
        per_row = torch.bincount(self.row, minlength=bar_ptr.shape[0] * bar_ptr.shape[1])
        row_first = torch.cumsum(per_row, 0) - per_row
        rank_in_row = torch.arange(distinct.numel()) - row_first[self.row]
        chunks_per_row = (per_row + 63) // 64
        chunk_base = torch.cumsum(chunks_per_row, 0) - chunks_per_row
        chunk_of_slot = chunk_base[self.row] + rank_in_row // 64
        bit_of_slot = rank_in_row % 64
        self.num_chunks = int(chunks_per_row.sum())
        self.head_row = torch.repeat_interleave(torch.arange(per_row.numel()), chunks_per_row)
        chunk_in_row = torch.arange(self.num_chunks) - chunk_base[self.head_row]
        self.first = (row_first[self.head_row] + chunk_in_row * 64).to(torch.int32)
        self.length = torch.clamp(per_row[self.head_row] - chunk_in_row * 64, max=64).to(torch.int32)
        pairs, pair_of_entry = torch.unique(chunk_of_slot[slot_of_entry] * num_blocks + qblock, return_inverse=True)
        self.pair_bits = torch.zeros(pairs.numel(), dtype=torch.int64)
        self.pair_bits.index_add_(
            0, pair_of_entry, torch.bitwise_left_shift(torch.ones_like(bit_of_slot), bit_of_slot)[slot_of_entry]
        )
        self.pair_qblock = (pairs % num_blocks).to(torch.int32)
        self.pair_ptr = torch.zeros(self.num_chunks + 1, dtype=torch.int32)
        self.pair_ptr[1:] = torch.cumsum(torch.bincount(pairs // num_blocks, minlength=self.num_chunks), 0)


def _old_bar_pass(q, k, v, dout, lse, delta, bar_ptr, bar_col, dk, dv, docs, scale):
    """The former deterministic bar pass: the chunk kernel on :class:`_OldBarChunks`, then per GQA member in
    ascending order a gather, add and scatter of its scratch rows into dk/dv."""
    batch, query_len, heads, dim = q.shape
    group = heads // k.shape[2]
    chunks = _OldBarChunks(bar_ptr, bar_col, query_len // BLOCK_SIZE, query_len)
    if chunks.num_chunks == 0:
        return
    scratch_dk = torch.empty(chunks.column.numel(), dim)
    scratch_dv = torch.empty_like(scratch_dk)
    documents, document_flag = triton_backend._document_arguments(*docs, q, query_len, bar_ptr)
    bar_chunk_backward_kernel[(chunks.num_chunks,)](
        q,
        k,
        v,
        dout,
        lse,
        delta,
        scratch_dk,
        scratch_dv,
        torch.tensor([0, chunks.num_chunks], dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        chunks.head_row,
        chunks.first,
        chunks.length,
        chunks.column,
        chunks.pair_ptr,
        chunks.pair_qblock,
        chunks.pair_bits,
        *documents[:2],
        *(stride for t in (q, k, v, dout) for stride in triton_backend._bhs(t)),
        lse.stride(0),
        lse.stride(1),
        documents[2],
        heads,
        group,
        scale,
        scale * triton_backend.LOG2E,
        chunks.column.numel(),
        SPLITS=1,
        **document_flag,
        **triton_backend._tiles(dim),
        **triton_backend.BAR_CHUNK_CONFIG,
    )
    sample, head = chunks.row // heads, chunks.row % heads
    order = torch.sort(head % group, stable=True)
    for picked in order.indices.split(torch.bincount(order.values, minlength=group).tolist()):
        targets = (sample[picked], chunks.column[picked].long(), head[picked] // group)
        for grad, scratch in ((dk, scratch_dk), (dv, scratch_dv)):
            grad.index_put_(targets, grad[targets].add_(scratch[picked]))


# ---------------------------------------------------------------------------------------- cases
def _vertical_slash_case(kind, world, seq_len, heads, kv_heads, batch, pattern, seed):
    generator = torch.Generator().manual_seed(seed)
    v_idx, s_idx = make_index(batch, heads, seq_len, pattern, generator)
    layout = Layout(kind, world)
    indices = [convert_index(v_idx, s_idx, layout, r, seq_len) for r in range(world)]
    return indices, make_qkv_dout(batch, seq_len // world, heads, kv_heads, 64, torch.float16, "cpu", generator)


def _packed_case(kind, world, seq_len, heads, kv_heads, seed):
    generator = torch.Generator().manual_seed(seed)
    document_index = packed_index_with_cross_document_bars(generator, seq_len, heads)
    layout = Layout(kind, world)
    indices = [convert_document_index(document_index, layout, r) for r in range(world)]
    return indices, make_qkv_dout(2, seq_len // world, heads, kv_heads, 64, torch.float16, "cpu", generator)


CASES = {
    # GQA 1:1, one sample, one device
    "contiguous-W1-gqa1": lambda seed: _vertical_slash_case("contiguous", 1, 512, 2, 2, 1, "bars", seed),
    # GQA 4:1, two samples, striped ring of two steps
    "striped-W2-gqa4-b2": lambda seed: _vertical_slash_case("striped", 2, 1024, 4, 1, 2, "bars", seed),
    # rank 0's step reading rank 1 has no bars at all (future keys), rank 1's two steps have some
    "contiguous-W2-gqa2": lambda seed: _vertical_slash_case("contiguous", 2, 512, 4, 2, 1, "mixed", seed),
    # no verticals: an index without a single bar
    "zigzag-W2-no-bars": lambda seed: _vertical_slash_case("zigzag", 2, 512, 4, 1, 1, "slashes", seed),
    "packed-W1-gqa4": lambda seed: _packed_case("contiguous", 1, 512, 4, 1, seed),
    "packed-striped-W2-gqa2": lambda seed: _packed_case("striped", 2, 512, 4, 2, seed),
}


def _steps(indices: list[BlockBarIndex]):
    """(rank, source, index) of every ring step."""
    return [(r, (r - t) % len(indices), index) for r, index in enumerate(indices) for t in range(len(indices))]


def _step_setup(index: BlockBarIndex, rank: int, source: int, q, k, v, generator):
    """The launcher's positional lists and keywords of one step, with a final lse from its forward and
    random delta and dq/dk/dv accumulators."""
    lists = (index.blk_ptr[source], index.blk_col, index.bar_ptr[source], index.bar_col)
    settings = dict(causal_diag=source == rank, softmax_scale=0.125, **index.step_doc_ids(source))
    out = torch.zeros(q.shape)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"))
    triton_backend.block_bar_forward(q, k, v, *lists, out, lse, **settings)
    delta = torch.randn(lse.shape, generator=generator)
    grads = [torch.randn(t.shape, generator=generator) for t in (q, k, v)]
    return lists, settings, lse, delta, grads


def _backward(q, k, v, dout, lse, delta, lists, grads, settings, **keywords):
    dq, dk, dv = (g.clone() for g in grads)
    triton_backend.block_bar_backward(
        q, k, v, dout, lse, delta, *lists, dq, dk, dv, deterministic=True, **settings, **keywords
    )
    return dq, dk, dv


# ---------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", list(CASES))
def test_cached_bar_chunks_give_bitwise_the_former_deterministic_gradients(seed, case, monkeypatch):
    """Every step, each chunk walked by one program: dq/dk/dv with the index's view equal, bitwise, the block
    passes followed by the former regrouping and member loop; and a second call equals the first."""
    monkeypatch.setattr(triton_backend, "_bar_chunk_splits", lambda chunks: 1)
    indices, (q, k, v, dout) = CASES[case](seed)
    generator = torch.Generator().manual_seed(seed)
    for rank, source, index in _steps(indices):
        lists, settings, lse, delta, grads = _step_setup(index, rank, source, q, k, v, generator)
        view = index.bar_chunks(source, k.shape[2])
        ours = _backward(q, k, v, dout, lse, delta, lists, grads, settings, bar_chunks=view)
        no_bar_pass = dataclasses.replace(view, max_chunks=0)
        expected = _backward(q, k, v, dout, lse, delta, lists, grads, settings, bar_chunks=no_bar_pass)
        docs = (settings.get("query_doc_ids"), settings.get("key_doc_ids"))
        _old_bar_pass(q, k, v, dout, lse, delta, *lists[2:], *expected[1:], docs, settings["softmax_scale"])
        again = _backward(q, k, v, dout, lse, delta, lists, grads, settings, bar_chunks=view)
        context = f"seed={seed} {case} rank {rank} source {source}"
        for name, a, b, c in zip(("dq", "dk", "dv"), ours, expected, again):
            assert torch.equal(a, b), f"{context}: {name} differs from the former regrouping"
            assert torch.equal(a, c), f"{context}: {name} differs between two calls"
        assert torch.equal(ours[1], _backward(q, k, v, dout, lse, delta, lists, grads, settings)[1]), context


@pytest.mark.parametrize("case", ["contiguous-W1-gqa1", "packed-striped-W2-gqa2"])
def test_split_chunk_walks_sum_to_the_whole_walks(seed, case, monkeypatch):
    """A chunk's walk split over 4 programs: dk/dv equal the one-program walk up to fp32 rounding and are
    bitwise repeatable."""
    indices, (q, k, v, dout) = CASES[case](seed)
    generator = torch.Generator().manual_seed(seed)
    for rank, source, index in _steps(indices):
        lists, settings, lse, delta, grads = _step_setup(index, rank, source, q, k, v, generator)
        view = index.bar_chunks(source, k.shape[2])
        results = {}
        for splits in (1, 4):
            monkeypatch.setattr(triton_backend, "_bar_chunk_splits", lambda chunks, splits=splits: splits)
            results[splits] = _backward(q, k, v, dout, lse, delta, lists, grads, settings, bar_chunks=view)
        again = _backward(q, k, v, dout, lse, delta, lists, grads, settings, bar_chunks=view)
        context = f"seed={seed} {case} rank {rank} source {source}"
        for name, whole, split in zip(("dk", "dv"), results[1][1:], results[4][1:]):
            assert torch.allclose(split, whole, rtol=1e-5, atol=1e-5), f"{context}: {name}"
        assert all(torch.equal(a, b) for a, b in zip(results[4], again)), f"{context}: not repeatable"


def test_bar_chunk_splits_fill_the_programs_from_the_lists_alone():
    assert [triton_backend._bar_chunk_splits(chunks) for chunks in (1, 40, 80, 128, 200, 256, 5000)] == [
        8,
        8,
        4,
        2,
        2,
        1,
        1,
    ]


def _step_lists(view: BarChunks) -> dict[str, torch.Tensor]:
    """One step's lists, renumbered from 0 (slots, chunks, pairs and targets of the other steps dropped)."""
    slots = view.source_slots[view.source : view.source + 2].tolist()
    chunks = view.source_chunks[view.source : view.source + 2].tolist()
    targets = view.source_targets[view.source : view.source + 2].tolist()
    pair_ptr = view.pair_ptr[chunks[0] : chunks[1] + 1]
    target_ptr = view.target_ptr[targets[0] : targets[1] + 1]
    return {
        "column": view.column[slots[0] : slots[1]],
        "chunk_head": view.chunk_head[chunks[0] : chunks[1]],
        "chunk_first": view.chunk_first[chunks[0] : chunks[1]] - slots[0],
        "chunk_length": view.chunk_length[chunks[0] : chunks[1]],
        "pair_ptr": pair_ptr - pair_ptr[0],
        "pair_qblock": view.pair_qblock[pair_ptr[0] : pair_ptr[-1]],
        "pair_bits": view.pair_bits[pair_ptr[0] : pair_ptr[-1]],
        "target_row": view.target_row[targets[0] : targets[1]],
        "target_ptr": target_ptr - target_ptr[0],
        "target_slot": view.target_slot[target_ptr[0] : target_ptr[-1]] - slots[0],
    }


@pytest.mark.parametrize("case", list(CASES))
def test_the_view_built_once_equals_the_per_call_one_and_the_former_chunks(seed, case):
    indices, (q, k, v, dout) = CASES[case](seed)
    kv_heads, key_len = k.shape[2], k.shape[1]
    for rank, source, index in _steps(indices):
        bar_ptr = index.bar_ptr[source]
        once = _step_lists(index.bar_chunks(source, kv_heads))
        first_last = triton_backend._entry_range(bar_ptr)
        per_call = _step_lists(
            bar_chunks_by_column(bar_ptr[None], index.bar_col, *first_last, key_len, kv_heads, key_len)
        )
        old = _OldBarChunks(bar_ptr, index.bar_col, index.num_local_blocks, key_len)
        former = dict(column=old.column, chunk_head=old.head_row, chunk_first=old.first, chunk_length=old.length)
        former.update(pair_ptr=old.pair_ptr, pair_qblock=old.pair_qblock, pair_bits=old.pair_bits)
        for name, tensor in once.items():
            context = f"seed={seed} {case} rank {rank} source {source} {name}"
            assert torch.equal(tensor, per_call[name]), context
            if name in former:
                assert torch.equal(tensor.long(), former[name].long()), context
        slot_counts = torch.bincount(once["target_slot"].long(), minlength=once["column"].numel())
        assert slot_counts.eq(1).all(), f"seed={seed} {case}: every slot goes to exactly one dk/dv row"


def _step_counts(view: BarChunks) -> tuple[int, int, int]:
    """The real (slots, chunks, targets) of the view's step."""
    offsets = (view.source_slots, view.source_chunks, view.source_targets)
    return tuple(int(t[view.source + 1] - t[view.source]) for t in offsets)


@pytest.mark.parametrize("case", list(CASES))
def test_the_scratch_rows_and_grids_of_every_step_are_within_the_vertical_width_bound(case):
    """With V_loc = min(Vmax, N_loc): real counts ≤ (max_slots, max_chunks, max_targets) ≤ (b·Hq·V_loc,
    b·Hq·⌈V_loc/64⌉, min(b·Hq·V_loc, b·Hkv·N_loc)); the lists of all steps hold at most b·Hq·V slots and
    b·Hq·(V//64 + min(W, V)) chunks, V = min(Vmax, N)."""
    indices, (_, k, _, _) = CASES[case](0)
    batch, key_len, kv_heads = k.shape[:3]
    for rank, source, index in _steps(indices):
        view = index.bar_chunks(source, kv_heads)
        heads = view.shape[0] * view.shape[1]
        step_width = min(index.vertical_width, key_len)
        slots = heads * step_width
        bound = (slots, heads * -(-step_width // 64), min(slots, batch * kv_heads * key_len))
        real, maxima = _step_counts(view), (view.max_slots, view.max_chunks, view.max_targets)
        context = f"{case} rank {rank} source {source}: real {real}, maxima {maxima}, bound {bound}"
        assert all(a <= b <= c for a, b, c in zip(real, maxima, bound)), context
        width = min(index.vertical_width, index.seq_len)
        assert view.column.numel() <= heads * width, case
        assert view.chunk_head.numel() <= heads * (width // 64 + min(index.world_size, width)), case


@pytest.mark.parametrize("kind, world", [("contiguous", 1), ("striped", 2)])
def test_the_bounds_are_near_the_real_counts_on_the_benchmark_pattern(kind, world):
    """Qwen2.5-3B heads (Hq 16, Hkv 2) on ``bench_attention.budget_pattern`` at N = 8192, sparsity 0.9 (Vmax =
    94): the lists of all steps hold at most 1.1× the real slots and 1.5× the real chunks; on one rank the step's
    scratch rows and chunk grid are within 1.1× of its real slots and chunks, its member-sum grid within 1.5× of
    its real targets (the 30 sinks, shared by the 8 query heads of a KV head, count once per head). A ring step's
    bounds may be up to W× looser: its source holds only some of a head's verticals."""
    seq_len, generator = 8192, torch.Generator().manual_seed(0)
    v_idx, s_idx, _ = load_tool("bench_attention").budget_pattern(1, 16, seq_len, 0.9, "cpu", generator)
    for rank in range(world):
        index = convert_index(v_idx, s_idx, Layout(kind, world), rank, seq_len)
        view = index.bar_chunks(0, 2)
        assert view.column.numel() <= 1.1 * int(view.source_slots[-1]), (kind, rank)
        assert view.chunk_head.numel() <= 1.5 * int(view.source_chunks[-1]), (kind, rank)
        if world == 1:
            slots, chunks, targets = _step_counts(view)
            assert view.max_slots <= 1.1 * slots and view.max_chunks <= 1.1 * chunks, (slots, chunks)
            assert view.max_targets <= 1.5 * targets, (view.max_targets, targets)


def test_the_view_is_built_without_reading_a_device_value():
    """Built from meta tensors, which hold no values: any host sync (.item(), .tolist(), int(), a size taken
    from data such as torch.unique's or bincount's) would raise. The former regrouping does."""
    indices, (_, k, _, _) = CASES["striped-W2-gqa4-b2"](0)
    index = indices[0]
    lists = ("blk_ptr", "blk_col", "bar_ptr", "bar_col")
    meta = dataclasses.replace(index, **{name: getattr(index, name).to("meta") for name in lists})
    view = meta.bar_chunks(1, k.shape[2])
    assert view.column.is_meta and view.max_chunks > 0
    with pytest.raises((NotImplementedError, RuntimeError)):
        _OldBarChunks(meta.bar_ptr[1], meta.bar_col, meta.num_local_blocks, index.seq_len // index.world_size)


def test_sparse_attention_deterministic_backward_reads_the_cached_view_and_repeats_bitwise(seed, monkeypatch):
    indices, (q, k, v, dout) = CASES["packed-W1-gqa4"](seed)
    index = indices[0]

    def per_call_regrouping(*args):
        raise AssertionError("the backward regrouped the bars itself instead of reading index.bar_chunks")

    monkeypatch.setattr(triton_backend, "bar_chunks_by_column", per_call_regrouping)
    results = []
    for _ in range(2):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sparse_attention(*inputs, index, backend="triton", deterministic=True)
        results.append(torch.autograd.grad(out, inputs, dout))
    for name, a, b in zip(("dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"seed={seed}: {name} differs between two deterministic backwards"
