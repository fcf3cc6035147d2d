"""tools/bench_ring.py: the model column (the analytic ring time it prints next to an emulated measurement),
and its compute-only rings (the library's ring steps over exchanges that move nothing)."""

from argparse import Namespace

import pytest
import torch
from tool_modules import load_tool

bench_ring = load_tool("bench_ring")

ARGS = Namespace(heads=16, kv_heads=2, head_dim=128)


def topology(inner, outer, node_size, gbps, slowdown):
    return dict(inner=inner, outer=outer, emulated_node_size=node_size, inner_gbps=gbps, outer_slowdown=slowdown)


@pytest.mark.parametrize("inner, outer, node_size", [(2, 1, 1), (1, 2, 1), (4, 2, 4), (8, 1, 4)])
def test_fast_links_predict_the_measured_compute(inner, outer, node_size):
    """With links far faster than compute every hop hides, so the model returns the compute it was given."""
    world = inner * outer
    got = bench_ring.model_fwd_bwd_ms(ARGS, 131072, world, topology(inner, outer, node_size, 1e6, 1.0), 100.0)
    assert got == pytest.approx(100.0, rel=1e-3)


def test_slow_links_add_exposed_time_and_the_hierarchy_hides_some():
    """W = 8 at 128K with a 10x slower outer link: the flat ring (nodes of 4) is link-bound, the hierarchy less."""
    flat = bench_ring.model_fwd_bwd_ms(ARGS, 131072, 8, topology(8, 1, 4, 338.0, 10.0), 5.7)
    hierarchical = bench_ring.model_fwd_bwd_ms(ARGS, 131072, 8, topology(4, 2, 4, 338.0, 10.0), 5.7)
    assert flat > 2 * 5.7 and 5.7 < hierarchical < flat


def _compute_only_rank(rank, world_size, packed=False):
    """On rank 0 only, the benchmark's compute-only sparse and SDPA rings (``packed``: the sparse ring on four
    dense documents); returns the sparse kernel calls' (kernel, source, causal_diag) in order."""
    import torch
    import torch.distributed as dist

    from megatron_mtraining.ring.groups import RingGroups
    from mtraining_kernels import torch_backend
    from mtraining_kernels.index import convert_index
    from mtraining_kernels.layout import Layout
    from mtraining_kernels.vertical_slash import full_index

    if rank != 0:  # a compute-only ring that sent or received anything would wait for this rank forever
        return None
    groups = RingGroups.flat(dist.group.WORLD)
    n, calls = 512, []
    q, dout = torch.randn(1, n // world_size, 2, 16), torch.randn(1, n // world_size, 2, 16)
    k, v = torch.randn(1, n // world_size, 1, 16), torch.randn(1, n // world_size, 1, 16)
    index = convert_index(*full_index(1, 2, n), Layout("striped", world_size), rank, n)
    if packed:
        from document_mixtures import uniform

        from mtraining_kernels.document_conversion import convert_document_index
        from mtraining_kernels.document_index import DocumentIndex

        documents = DocumentIndex.dense(uniform(n, 128), 2)
        index = convert_document_index(documents, Layout("striped", world_size), rank)
        assert index.doc_ids is not None

    def source(blk_ptr):
        return next(s for s in range(world_size) if blk_ptr.data_ptr() == index.blk_ptr[s].data_ptr())

    class Recording:
        def block_bar_forward(self, *args, causal_diag, **kwargs):
            calls.append(("forward", source(args[3]), causal_diag))
            torch_backend.block_bar_forward(*args, causal_diag=causal_diag, **kwargs)

        def block_bar_backward(self, *args, causal_diag, **kwargs):
            calls.append(("backward", source(args[6]), causal_diag))
            torch_backend.block_bar_backward(*args, causal_diag=causal_diag, **kwargs)

        output_delta = staticmethod(torch_backend.output_delta)

    bench_ring.compute_only(Recording(), q, k, v, dout, index, groups, 0.25)
    if not packed:
        bench_ring.sdpa_compute_only("flash", q, k, v, dout, groups, 0.25)
    return calls


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_compute_only_runs_every_step_of_the_ring_without_communication(distributed, packed):
    calls, idle = distributed(_compute_only_rank, 2, packed, timeout=120)
    assert idle is None
    assert calls == [("forward", 0, True), ("forward", 1, False), ("backward", 0, True), ("backward", 1, False)]


# ---------------------------------------------------------------------------------------- document mixtures
SMALL = ["--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--min-sparse-length", "256"]


def test_mixtures_are_parsed_and_unknown_ones_refused(capsys):
    assert bench_ring.parse_args([]).mixtures == ["none"]
    args = bench_ring.parse_args(["--mixtures", "none", "prolong", "uniform4k", "single"])
    assert args.mixtures == ["none", "prolong", "uniform4k", "single"] and args.min_sparse_length == 4096
    with pytest.raises(SystemExit):
        bench_ring.parse_args(["--mixtures", "books"])
    assert "invalid choice: 'books'" in capsys.readouterr().err


def test_packed_patterns_carry_the_mixtures_documents_and_the_dense_baseline_has_their_mask():
    from document_mixtures import MIXTURES

    from mtraining_kernels.document_index import DocumentIndex
    from mtraining_kernels.layout import Layout

    args, n = bench_ring.parse_args(SMALL), 8192
    sparse, dense = bench_ring.mixture_patterns(args, "prolong", n, far_lines=8)
    documents = MIXTURES["prolong"](n, 0)
    for pattern in (sparse, dense):
        assert torch.equal(pattern.documents.documents.starts, documents.starts)
        assert pattern.num_documents == int(documents.num_documents[0]) > 2
    reference = DocumentIndex.dense(documents, 2)
    assert not dense.sparse and not dense.documents.sparse.any()
    assert torch.equal(dense.documents.v_idx, reference.v_idx) and torch.equal(dense.documents.s_idx, reference.s_idx)
    assert sparse.sparse and torch.equal(sparse.documents.sparse[0], documents.lengths[0] >= 256)
    layout = Layout("striped", 2)
    assert dense.density(layout) == 1.0 and 0 < sparse.density(layout) < 0.9
    assert dense.report(layout) is None and sparse.report(layout).worker_imbalance >= 1.0
    for pattern in (sparse, dense):
        lists = pattern.lists(layout, 1, "cpu")
        assert lists.doc_ids is not None and lists.rank == 1  # the documents reach the ring


def test_one_document_gives_the_unpacked_lists():
    """PACKED.md: one document spanning the sequence is today's unpacked pattern, so its ring lists are too."""
    from realistic_pattern import realistic_pattern

    from mtraining_kernels.layout import Layout

    args, n, lines = bench_ring.parse_args(SMALL), 4096, 6
    (single, _) = bench_ring.mixture_patterns(args, "single", n, far_lines=lines)
    v_idx, s_idx = realistic_pattern(n, 2, far_slashes=lines, far_verticals=lines, seed=n)
    (unpacked,) = bench_ring.mixture_patterns(args, "none", n, lines, unpacked=(v_idx, s_idx, 0.1))
    layout = Layout("striped", 2)
    packed_lists, unpacked_lists = single.lists(layout, 0, "cpu"), unpacked.lists(layout, 0, "cpu")
    assert packed_lists.doc_ids is None
    for name in ("blk_ptr", "blk_col", "bar_ptr", "bar_col"):
        for a, b in zip(getattr(packed_lists, name), getattr(unpacked_lists, name)):
            assert torch.equal(a, b), name
    assert unpacked.density(layout) == 0.1 and 0 < single.density(layout) < 1


def test_unpacked_dense_baseline_only_up_to_dense_max_len():
    args = bench_ring.parse_args([*SMALL, "--dense-max-len", "2048"])
    from realistic_pattern import realistic_pattern

    pattern = (*realistic_pattern(2048, 2, far_slashes=2, far_verticals=2), 0.2)
    assert [p.name for p in bench_ring.mixture_patterns(args, "none", 2048, 2, pattern)] == ["sparse", "dense"]
    pattern = (*realistic_pattern(4096, 2, far_slashes=2, far_verticals=2), 0.2)
    assert [p.name for p in bench_ring.mixture_patterns(args, "none", 4096, 2, pattern)] == ["sparse"]
