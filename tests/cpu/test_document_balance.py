"""Packed balance diagnostics (DESIGN.md §2.7): analytic counts == the conversion rule counted tile by tile,
the rule's tiles and bars cover the packed mask, one document == unpacked, and the mixture generators."""

import pytest
import torch
from tool_modules import load_tool

from megatron_mtraining.attention_stats import document_work_density
from megatron_mtraining.balance import document_balance_report, document_source_work, source_work
from mtraining_kernels.document_conversion import convert_document_index
from mtraining_kernels.document_index import DocumentIndex
from mtraining_kernels.documents import Documents
from mtraining_kernels.layout import BLOCK_SIZE, Layout
from mtraining_kernels.reference import packed_vertical_slash_mask

mixtures = load_tool("document_mixtures")
realistic_pattern = load_tool("realistic_pattern").realistic_pattern

LAYOUTS = (
    Layout("contiguous", 1),
    Layout("contiguous", 3),
    Layout("zigzag", 2),
    Layout("zigzag", 4),
    Layout("striped", 2),
    Layout("striped", 4),
    Layout("striped", 2, 256),
)


def random_documents(generator: torch.Generator, batch: int, seq_len: int) -> Documents:
    """Starts drawn to straddle blocks and ranks: random cuts, a few one-token documents, one sample whole."""
    samples = []
    for sample in range(batch):
        cuts = torch.randint(1, seq_len, (int(torch.randint(0, 12, (), generator=generator)),), generator=generator)
        if sample == 1:
            cuts = torch.cat([cuts, torch.tensor([BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, seq_len - 1])])
        samples.append(torch.cat([torch.zeros(1, dtype=torch.long), cuts]).unique().tolist())
    if batch > 2:
        samples[2] = [0]
    slots = max(len(starts) for starts in samples)
    starts = torch.full((batch, slots), seq_len, dtype=torch.long)
    for row, values in enumerate(samples):
        starts[row, : len(values)] = torch.tensor(values)
    return Documents(starts, seq_len)


def random_document_index(generator: torch.Generator, documents: Documents, heads: int) -> DocumentIndex:
    """Random sparse flags and, per sparse document and head, random verticals inside it and slashes below L."""
    seq_len, lengths = documents.seq_len, documents.lengths
    sparse = (torch.rand(lengths.shape, generator=generator) < 0.7) & (lengths > 0)
    width = 24
    v_idx = torch.full((*lengths.shape, heads, width), seq_len, dtype=torch.int32)
    s_idx = torch.full_like(v_idx, seq_len)
    for sample, document in sparse.nonzero().tolist():
        start, length = int(documents.starts[sample, document]), int(lengths[sample, document])
        for head in range(heads):
            for lists, low in ((v_idx, start), (s_idx, 0)):
                count = int(torch.randint(0, min(width, length) + 1, (), generator=generator))
                chosen = torch.randperm(length, generator=generator)[:count].sort().values + low
                lists[sample, document, head, :count] = chosen.int()
    return DocumentIndex(documents, sparse, v_idx, s_idx)


def rule_tiles_and_bars(doc_index: DocumentIndex, sample: int, head: int) -> tuple[set, set]:
    """The §2.7 conversion rule, tile by tile: listed tiles {(qb, kb)} and bars {(qb, vertical)}."""
    documents, seq_len = doc_index.documents, doc_index.documents.seq_len
    num_blocks = seq_len // BLOCK_SIZE
    doc_of = documents.doc_id[sample].tolist()
    present = [set(doc_of[k * BLOCK_SIZE : (k + 1) * BLOCK_SIZE]) for k in range(num_blocks)]
    sparse = doc_index.sparse[sample].tolist()
    hits = {}
    for document, is_sparse in enumerate(sparse):
        if is_sparse:
            slashes = [s for s in doc_index.s_idx[sample, document, head].tolist() if s < seq_len]
            hits[document] = {
                delta
                for delta in range(1, num_blocks)
                if any((delta - 1) * BLOCK_SIZE < s < (delta + 1) * BLOCK_SIZE for s in slashes)
            }

    def on(document: int, qb: int, kb: int) -> bool:
        return not sparse[document] or qb == kb or qb - kb in hits[document]

    listed = {
        (qb, kb)
        for qb in range(num_blocks)
        for kb in range(qb + 1)
        if any(on(document, qb, kb) for document in present[qb] & present[kb])
    }
    bars = set()
    for document in hits:
        for vertical in doc_index.v_idx[sample, document, head].tolist():
            if vertical == seq_len:
                continue
            kb = vertical // BLOCK_SIZE
            for qb in range(kb + 1, num_blocks):
                if document in present[qb] and not on(document, qb, kb):
                    bars.add((qb, vertical))
    return listed, bars


def rule_work(rule: dict, layout: Layout, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and bars per (query rank, source rank, b, Hq), int64 ``[W, W, b, Hq]``, of the rule's
    ``{(sample, head): (listed tiles, bars)}``."""
    world = layout.world_size
    owner = layout.to_local(torch.arange(0, seq_len, BLOCK_SIZE), seq_len)[0].tolist()
    batch, heads = (max(key) + 1 for key in zip(*rule))
    blocks = torch.zeros(world, world, batch, heads, dtype=torch.long)
    bars = torch.zeros_like(blocks)
    for (sample, head), (listed, bar_set) in rule.items():
        for qb, kb in listed:
            blocks[owner[qb], owner[kb], sample, head] += 1
        for qb, vertical in bar_set:
            bars[owner[qb], owner[vertical // BLOCK_SIZE], sample, head] += 1
    return blocks, bars


@pytest.mark.parametrize("case", range(12))
def test_analytic_counts_equal_the_conversion_rule(case, seed):
    generator = torch.Generator().manual_seed(seed + case)
    seq_len = (8, 16, 24, 32)[case % 4] * BLOCK_SIZE
    documents = random_documents(generator, 3, seq_len)
    doc_index = random_document_index(generator, documents, 2)
    rule = {(sample, head): rule_tiles_and_bars(doc_index, sample, head) for sample in range(3) for head in range(2)}
    for layout in LAYOUTS:
        if seq_len % layout.unit(BLOCK_SIZE):
            continue
        blocks, bars = document_source_work(doc_index, layout)
        expected_blocks, expected_bars = rule_work(rule, layout, seq_len)
        where = f"seed={seed} case={case} layout={layout} starts={documents.starts.tolist()}"
        assert torch.equal(blocks, expected_blocks), f"blocks: {where}"
        assert torch.equal(bars, expected_bars), f"bars: {where}"


def test_rule_tiles_and_bars_cover_the_packed_mask_exactly(seed):
    generator = torch.Generator().manual_seed(seed)
    seq_len = 12 * BLOCK_SIZE
    doc_index = random_document_index(generator, random_documents(generator, 2, seq_len), 2)
    mask = packed_vertical_slash_mask(doc_index)  # [b, Hq, N, N]
    num_blocks = seq_len // BLOCK_SIZE
    tiles = mask.view(2, 2, num_blocks, BLOCK_SIZE, num_blocks, BLOCK_SIZE)
    for sample in range(2):
        for head in range(2):
            listed, bars = rule_tiles_and_bars(doc_index, sample, head)
            nonempty = tiles[sample, head].any(dim=(1, 3))  # [qb, kb]
            assert all(nonempty[tile] for tile in listed), f"a listed tile attends nothing: seed={seed}"
            row_columns = mask[sample, head].view(num_blocks, BLOCK_SIZE, seq_len).any(1)  # [qb, j]
            outside = {(qb, j) for qb, j in row_columns.nonzero().tolist() if (qb, j // BLOCK_SIZE) not in listed}
            assert outside == bars, f"mask outside listed tiles != bars: seed={seed} sample={sample} head={head}"


def test_work_density_is_the_lists_work_over_all_documents_dense(seed):
    """``document_work_density``: the converted lists' blocks and bars (every rank and step) over those of the same
    documents all dense; 1.0 when every document is dense."""
    generator = torch.Generator().manual_seed(seed)
    seq_len, layout = 16 * BLOCK_SIZE, Layout("striped", 2)
    doc_index = random_document_index(generator, random_documents(generator, 3, seq_len), 2)
    dense = DocumentIndex.dense(doc_index.documents, doc_index.num_heads)

    def listed_work(index: DocumentIndex) -> float:
        lists = [convert_document_index(index, layout, rank) for rank in range(layout.world_size)]
        return sum(part.blk_col.numel() / 2 + part.bar_col.numel() / BLOCK_SIZE for part in lists)

    expected = listed_work(doc_index) / listed_work(dense)
    assert document_work_density(doc_index, layout) == pytest.approx(expected, rel=1e-12), f"seed={seed}"
    assert document_work_density(dense, layout) == 1.0


@pytest.mark.parametrize("layout", [Layout("contiguous", 4), Layout("zigzag", 4), Layout("striped", 4)])
def test_one_document_equals_the_unpacked_count(layout, seed):
    seq_len, heads = 64 * BLOCK_SIZE, 3
    v_idx, s_idx = realistic_pattern(seq_len, heads, 2, far_slashes=40, far_verticals=60, seed=seed)
    doc_index = DocumentIndex(
        Documents.single(2, seq_len), torch.ones(2, 1, dtype=torch.bool), v_idx[:, None], s_idx[:, None]
    )
    packed, unpacked = document_source_work(doc_index, layout), source_work(v_idx, s_idx, layout, seq_len)
    assert torch.equal(packed[0], unpacked[0]) and torch.equal(packed[1], unpacked[1]), f"seed={seed}"
    generated = mixtures.realistic_document_index(
        mixtures.single(seq_len), heads, min_sparse_length=4096, far_slashes=40, far_verticals=60, seed=seed
    )
    expected = realistic_pattern(seq_len, heads, far_slashes=40, far_verticals=60, seed=seed)
    assert torch.equal(generated.v_idx[:, 0], expected[0]) and torch.equal(generated.s_idx[:, 0], expected[1])


def two_dense_documents(seq_len: int, second_start: int) -> DocumentIndex:
    """One sample of two dense documents, one head: lists of padding only."""
    documents = Documents(torch.tensor([[0, second_start]]), seq_len)
    padding = torch.full((1, 2, 1, 1), seq_len, dtype=torch.int32)
    return DocumentIndex(documents, torch.zeros(1, 2, dtype=torch.bool), padding, padding)


def test_dense_documents_count_their_block_triangles():
    # dense documents of 3 and 5 blocks, W = 1: 6 + 15 tiles, no bars; cost is blocks
    report = document_balance_report(two_dense_documents(8 * BLOCK_SIZE, 3 * BLOCK_SIZE), Layout("contiguous", 1))
    assert int(report.blocks) == 21 and int(report.bars) == 0 and float(report.cost) == 21.0


def test_step_imbalance_skips_steps_where_no_rank_works():
    # dense documents of 4 blocks, each inside one rank of a contiguous W = 2: step 1 is idle
    report = document_balance_report(two_dense_documents(8 * BLOCK_SIZE, 4 * BLOCK_SIZE), Layout("contiguous", 2))
    assert report.blocks.tolist() == [[10, 0], [10, 0]]
    assert report.step_imbalance == 1.0 and report.worker_imbalance == 1.0 and report.critical_path_ratio == 1.0


def test_prolong_like_mixture(seed):
    for seq_len in (512 * 1024, 128 * 1024, 32 * 1024):
        documents = mixtures.prolong_like(seq_len, batch=2, seed=seed)
        scale = min(1.0, seq_len / (128 * 1024))
        for lengths in documents.lengths.tolist():
            lengths = [length for length in lengths if length]
            long = [length for length in lengths if length >= 64 * 1024 * scale]
            short = [length for length in lengths if length < 64 * 1024 * scale]
            assert sum(lengths) == seq_len and sum(long) == seq_len // 2, f"seed={seed} N={seq_len} {lengths}"
            assert all(length <= 32 * 1024 * scale for length in short), f"seed={seed} N={seq_len} {lengths}"
            assert sum(length < 1024 * scale for length in short) <= 1, f"one short document is cut: {lengths}"
        if seq_len <= 128 * 1024:
            assert (documents.lengths == seq_len // 2).sum(1).tolist() == [1, 1], "below 128K: one long N/2 document"
    first, again = mixtures.prolong_like(512 * 1024, seed=seed), mixtures.prolong_like(512 * 1024, seed=seed)
    other = mixtures.prolong_like(512 * 1024, seed=seed + 1)
    assert torch.equal(first.starts, again.starts), f"seed={seed}"
    assert first.lengths.tolist() != other.lengths.tolist(), f"seed={seed}"


def test_uniform_and_single_mixtures():
    assert mixtures.uniform(16384, 4096, batch=2).lengths.tolist() == [[4096] * 4] * 2
    assert mixtures.uniform(10000, 4096).lengths.tolist() == [[4096, 4096, 1808]]
    assert mixtures.single(8192, batch=3).lengths.tolist() == [[8192]] * 3


def test_realistic_document_index_scales_counts_per_document(seed):
    seq_len, heads = 64 * BLOCK_SIZE, 2
    documents = Documents(torch.tensor([[0, 4096, 4096 + 2048, 4096 + 2048 + 1000]]), seq_len)
    doc_index = mixtures.realistic_document_index(
        documents, heads, min_sparse_length=2048, far_slashes=800, far_verticals=400, seed=seed
    )
    assert doc_index.sparse.tolist() == [[True, True, False, False]]
    for document, (start, length) in enumerate(((0, 4096), (4096, 2048))):
        verticals, slashes = doc_index.v_idx[0, document], doc_index.s_idx[0, document]
        assert bool((verticals[:, :30] == torch.arange(start, start + 30)).all()), f"sinks: seed={seed}"
        assert bool((slashes[:, :100] == torch.arange(100)).all()), f"window: seed={seed}"
        far_v, far_s = round(400 * length / seq_len), round(800 * length / seq_len)
        assert ((verticals < seq_len).sum(-1) == 30 + far_v).all() and (
            (slashes < seq_len).sum(-1) == 100 + far_s
        ).all()
    assert bool((doc_index.v_idx[0, 2:] == seq_len).all() and (doc_index.s_idx[0, 2:] == seq_len).all()), "dense"
    with pytest.raises(ValueError, match="min_sparse_length"):
        mixtures.realistic_document_index(documents, heads, min_sparse_length=64)


def test_budget_document_index_is_the_attention_benchmarks_pattern_per_document(seed):
    """One document spanning the sequence is ``budget_pattern`` of N tokens; a document of a partial block keeps
    only entries inside it; every sparse document reaches the target sparsity (its forced entries allowing)."""
    seq_len, heads, sparsity = 32 * BLOCK_SIZE, 2, 0.9
    budget_pattern = load_tool("bench_attention").budget_pattern
    whole = mixtures.budget_document_index(
        Documents.single(1, seq_len), heads, sparsity=sparsity, min_sparse_length=256, seed=seed
    )
    v_idx, s_idx, _ = budget_pattern(1, heads, seq_len, sparsity, "cpu", torch.Generator().manual_seed(seed))
    assert torch.equal(whole.v_idx[:, 0], v_idx) and torch.equal(whole.s_idx[:, 0], s_idx), f"seed={seed}"

    documents = Documents(torch.tensor([[0, 2000, 2000 + 1500]]), seq_len)  # 2000, 1500 and 596 tokens
    packed = mixtures.budget_document_index(documents, heads, sparsity=sparsity, min_sparse_length=1000, seed=seed)
    assert packed.sparse.tolist() == [[True, True, False]]
    for document, (start, length) in enumerate(((0, 2000), (2000, 1500))):
        verticals, slashes = packed.v_idx[0, document], packed.s_idx[0, document]
        real_v = verticals[verticals < seq_len]
        assert bool(((real_v >= start) & (real_v < start + length)).all()), f"seed={seed} document {document}"
        assert bool((slashes[slashes < seq_len] < length).all()), f"seed={seed} document {document}"
        assert bool((verticals[:, :30] == torch.arange(start, start + 30)).all()), f"sinks: seed={seed}"
    assert bool((packed.v_idx[0, 2] == seq_len).all() and (packed.s_idx[0, 2] == seq_len).all()), "dense"
    layout = Layout("contiguous", 1)
    assert document_work_density(whole, layout) < 1.0 - sparsity + 0.05, f"seed={seed}"


def test_reordered_documents_keep_their_own_patterns(seed):
    """``reorder_documents`` packs the same documents in another order: each keeps its length, its sparse flag,
    its slashes and its verticals relative to its start; the identical order balances like the original."""
    generator = torch.Generator().manual_seed(seed)
    seq_len = 16 * BLOCK_SIZE
    documents = mixtures.prolong_like(seq_len, 1, seed)
    doc_index = mixtures.realistic_document_index(documents, 2, min_sparse_length=256, seed=seed)
    count = int(documents.num_documents[0])
    assert count >= 3 and bool(doc_index.sparse.any()), "the mixture needs several documents, some sparse"
    order = torch.randperm(count, generator=generator).tolist()
    moved = mixtures.reorder_documents(doc_index, 0, order)
    for new, old in enumerate(order):
        assert int(moved.documents.lengths[0, new]) == int(documents.lengths[0, old])
        assert bool(moved.sparse[0, new]) == bool(doc_index.sparse[0, old])
        assert torch.equal(moved.s_idx[0, new], doc_index.s_idx[0, old])
        relative = [
            torch.where(index.v_idx[0, slot] < seq_len, index.v_idx[0, slot] - index.documents.starts[0, slot], -1)
            for index, slot in ((moved, new), (doc_index, old))
        ]
        assert torch.equal(*relative), f"seed={seed}: document {old}'s verticals did not move with it"
    same = mixtures.reorder_documents(doc_index, 0, list(range(count)))
    layout = Layout("striped", 4)
    assert torch.equal(document_balance_report(same, layout).cost, document_balance_report(doc_index, layout).cost)
    with pytest.raises(ValueError, match="permutation"):
        mixtures.reorder_documents(doc_index, 0, [0] * count)


def test_analyze_balance_prints_the_spread_over_document_orders(capsys):
    """``tools/analyze_balance.py --document-orders`` runs and prints best <= median <= worst of each layout."""
    analyze_balance = load_tool("analyze_balance")
    analyze_balance.main(
        ["--seq-len", "16384", "--world-size", "4", "--heads", "2", "--mixture", "prolong", "--document-orders", "3"]
    )
    printed = capsys.readouterr().out
    assert "3 random orders of the" in printed, printed
    metrics = ("worker_imbalance", "step_imbalance", "critical_path_ratio")
    rows = [line.split() for line in printed.splitlines() if line.split()[1:2] and line.split()[1] in metrics]
    assert [(row[0], row[1]) for row in rows] == [
        (kind, metric) for kind in ("striped", "skewed") for metric in metrics
    ], printed
    for row in rows:
        best, median, worst = float(row[2]), float(row[4]), float(row[6])
        assert 1.0 <= best <= median <= worst, row
    assert "skewed planned" in printed, printed
    with pytest.raises(SystemExit, match="needs --mixture"):
        analyze_balance.main(["--seq-len", "16384", "--world-size", "4", "--heads", "2", "--document-orders", "2"])
