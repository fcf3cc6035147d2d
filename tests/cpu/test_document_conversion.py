"""Index conversion of packed documents (DESIGN.md §2.7): vectorised == the rule's loops, and the lists,
masked by doc(i) == doc(j), reproduce the oracle's packed mask for every rank of every layout."""

import pytest
import torch
from document_cases import MIN_SPARSE, packed_documents, random_document_index, random_lengths

from mtraining_kernels.document_conversion import convert_document_index, convert_document_index_slow
from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.documents import Documents
from mtraining_kernels.index import BlockBarIndex, convert_index
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.reference import packed_vertical_slash_mask
from mtraining_kernels.vertical_slash import full_index

FIELDS = ("blk_ptr", "blk_col", "bar_ptr", "bar_col", "key_ptr", "key_qblock")
LAYOUTS = [Layout(kind, world) for world in (1, 2, 3) for kind in ("contiguous", "zigzag", "striped", "skewed")]
LAYOUTS.append(Layout("striped", 2, 256))


def layout_id(layout: Layout) -> str:
    return f"{layout.kind}{layout.granularity if layout.kind == 'striped' else ''}-W{layout.world_size}"


def sequence_length(layout: Layout, at_least: int) -> int:
    unit = layout.unit(BLOCK_SIZE)
    return unit * -(-at_least // unit)


def paint_mask(index: BlockBarIndex, doc_id: torch.Tensor, heads: int) -> torch.Tensor:
    """Expand the lists onto ``[b, Hq, N_loc query rows (local order), N key columns (global order)]`` the way the
    kernels read them: every listed score needs doc(i) == doc(j), the diagonal tile also j ≤ i. Entries are
    counted (an overlap shows as 2); a listed tile or bar with no attended score raises."""
    layout, seq_len, rank, world = index.layout, index.seq_len, index.rank, index.world_size
    batch, nb, local_len = doc_id.shape[0], index.num_local_blocks, seq_len // world
    positions = [layout.global_positions(seq_len, w) for w in range(world)]
    local_docs = [doc_id[:, p] for p in positions]  # [b, N_loc] per rank
    painted = torch.zeros(batch, heads, local_len, world * local_len, dtype=torch.int8)
    causal = torch.ones(BLOCK_SIZE, BLOCK_SIZE, dtype=torch.bool).tril()
    for w in range(world):
        for b in range(batch):
            for h in range(heads):
                for i in range(nb):
                    rows = slice(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)
                    row_docs = local_docs[rank][b, rows]
                    start, end = index.blk_ptr[w, b, h, i], index.blk_ptr[w, b, h, i + 1]
                    tiles = index.blk_col[start:end].view(-1, 2)[:, 0] // 2
                    for j in tiles.tolist():
                        keys = slice(j * BLOCK_SIZE, (j + 1) * BLOCK_SIZE)
                        keep = row_docs[:, None] == local_docs[w][b, keys][None, :]
                        if w == rank and j == i:
                            keep &= causal
                        assert keep.any(), f"tile {j} of source {w} listed for (b={b}, h={h}, i={i}) attends nothing"
                        painted[b, h, rows, w * local_len + j * BLOCK_SIZE : w * local_len + (j + 1) * BLOCK_SIZE] += (
                            keep
                        )
                    start, end = index.bar_ptr[w, b, h, i], index.bar_ptr[w, b, h, i + 1]
                    for column in index.bar_col[start:end].tolist():
                        keep = row_docs == local_docs[w][b, column]
                        assert keep.any(), f"bar {column} of source {w} listed for (b={b}, h={h}, i={i}) has no row"
                        painted[b, h, rows, w * local_len + column] += keep
    in_global_order = torch.empty_like(painted)
    in_global_order[..., torch.cat(positions)] = painted
    return in_global_order


def check_against_oracle(index: DocumentIndex, layout: Layout, message: str) -> None:
    """Fast == slow for every rank, and the painted lists of all ranks are exactly the packed mask."""
    seq_len, heads = index.documents.seq_len, index.num_heads
    oracle = packed_vertical_slash_mask(index)
    for rank in range(layout.world_size):
        fast = convert_document_index(index, layout, rank)
        slow = convert_document_index_slow(index, layout, rank)
        where = f"{message} layout={layout_id(layout)} N={seq_len} rank={rank}"
        for field in (*FIELDS, "doc_ids"):
            ours, loops = getattr(fast, field), getattr(slow, field)
            assert (ours is None and loops is None) or torch.equal(ours, loops), f"{field} differs: {where}"
        assert (fast.seq_len, fast.world_size, fast.rank, fast.layout) == (seq_len, layout.world_size, rank, layout)
        painted = paint_mask(fast, index.documents.doc_id, heads)
        assert int(painted.max()) <= 1, f"listed work overlaps: {where}"
        expected = oracle[:, :, layout.global_positions(seq_len, rank), :]
        assert torch.equal(painted.bool(), expected), f"mask rows differ: {where}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_random_packed_documents_reproduce_the_oracle(layout, seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len = sequence_length(layout, 1024)
    documents = packed_documents([random_lengths(generator, seq_len) for _ in range(2)], seq_len)
    index = random_document_index(generator, documents, heads=2)
    assert index.documents.num_documents.min() > 1
    check_against_oracle(index, layout, f"seed={seed}")


HAND_MADE = {
    # one-token documents on a block boundary, a rank boundary (768 / 2) and the last position
    "one-token documents": [[127, 1, 1, 255, 1, 1, 381, 1]],
    "shorter than 64 and 128, straddling blocks": [[40, 63, 127, 30, 100, 200, 64, 144]],
    "exactly min_sparse_length, dense and sparse mixed": [[MIN_SPARSE, MIN_SPARSE - 1, 300, MIN_SPARSE, 169]],
    "a long document over every rank": [[5, 700, 63], [MIN_SPARSE, 668]],
}


@pytest.mark.parametrize("name", sorted(HAND_MADE))
@pytest.mark.parametrize("layout", [Layout("striped", 3), Layout("zigzag", 3), Layout("contiguous", 2)], ids=layout_id)
def test_hand_made_documents_reproduce_the_oracle(name, layout, seed):
    generator = torch.Generator().manual_seed(seed)
    documents = packed_documents(HAND_MADE[name], 768)
    check_against_oracle(random_document_index(generator, documents, heads=3), layout, f"seed={seed} {name}")


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_one_document_gives_the_unpacked_lists(layout, seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len = sequence_length(layout, 768)
    index = random_document_index(generator, Documents.single(2, seq_len), heads=3, v_width=40, s_width=30)
    for rank in range(layout.world_size):
        packed = convert_document_index(index, layout, rank)
        unpacked = convert_index(index.v_idx[:, 0], index.s_idx[:, 0], layout, rank, seq_len)
        for field in FIELDS:
            assert torch.equal(getattr(packed, field), getattr(unpacked, field)), f"{field}: seed={seed} rank={rank}"
        assert packed.doc_ids is None and packed.step_doc_ids(0) == {}, "one document needs no document mask"


def test_one_dense_document_gives_the_full_causal_lists():
    seq_len, layout = 768, Layout("striped", 3)
    documents = Documents.single(1, seq_len)
    padding = torch.full((1, 1, 2, 1), seq_len, dtype=torch.int32)
    index = DocumentIndex(documents, torch.zeros(1, 1, dtype=torch.bool), padding, padding)
    v_idx, s_idx = full_index(1, 2, seq_len)
    for rank in range(3):
        packed, full = convert_document_index(index, layout, rank), convert_index(v_idx, s_idx, layout, rank, seq_len)
        for field in FIELDS:
            assert torch.equal(getattr(packed, field), getattr(full, field)), f"{field} rank={rank}"


def test_doc_ids_follow_the_layout():
    seq_len, layout = 768, Layout("zigzag", 3)
    documents = packed_documents([[300, 1, 467]], seq_len)
    padding = torch.full((1, 3, 1, 1), seq_len, dtype=torch.int32)
    index = convert_document_index(
        DocumentIndex(documents, torch.zeros(1, 3, dtype=torch.bool), padding, padding), layout, 1
    )
    assert index.doc_ids.shape == (3, 1, 256) and index.doc_ids.dtype == torch.int32
    for w in range(3):
        assert torch.equal(index.doc_ids[w], layout.shard(documents.doc_id, w)), f"rank {w}"
    steps = index.step_doc_ids(2)
    assert torch.equal(steps["query_doc_ids"], index.doc_ids[1]) and torch.equal(steps["key_doc_ids"], index.doc_ids[2])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(index="not an index"), "must be a mtraining_kernels.DocumentIndex"),
        (dict(layout="striped"), "must be a mtraining_kernels.Layout"),
        (dict(layout=Layout("zigzag", 3)), "not divisible by 768"),
        (dict(rank=2), "rank=2 is outside \\[0, 2\\)"),
        (dict(rank=True), "rank=True"),
    ],
)
@pytest.mark.parametrize("convert", [convert_document_index, convert_document_index_slow])
def test_bad_inputs_raise_value_error(convert, change, message):
    documents = packed_documents([[200, 312]], 512)
    padding = torch.full((1, 2, 1, 1), 512, dtype=torch.int32)
    args = dict(
        index=DocumentIndex(documents, torch.zeros(1, 2, dtype=torch.bool), padding, padding),
        layout=Layout("striped", 2),
        rank=1,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        convert(args["index"], args["layout"], args["rank"])
