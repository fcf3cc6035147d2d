"""tools/bench_attention.py's report: speed-ups pair each row with cuDNN from the same run, ``--report-only``
rebuilds the table and plot from the latest run of an appended JSONL, and the plot has one panel per shape;
its index timings (the deterministic rows' with their bar lists by column)."""

import json

import pytest
import torch
from patterns import random_index
from tool_modules import load_tool

from mtraining_kernels.bar_chunks import BarChunks
from mtraining_kernels.index import convert_index
from mtraining_kernels.layout import Layout

bench_attention = load_tool("bench_attention")

pytest.importorskip("matplotlib")


def row(date, shape, impl, fwd_ms, bwd_ms, seq_len=131072, **extra):
    tflops = {"fwd": 1.0, "bwd": 1.0, "fwd_bwd": 1.0}
    dense = impl.startswith("sdpa") or impl == "mtraining_dense"
    fields = dict(
        gpu="test GPU",
        torch="2.x",
        commit=f"c-{date}",
        date=date,
        shape=shape,
        impl=impl,
        seq_len=seq_len,
        density=1.0 if dense else 0.05,
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        index_ms=0.0 if dense else 2.0,
        dense_equiv_tflops=tflops,
        actual_tflops=tflops,
    )
    if not dense and "top_p" not in extra:
        fields["target_sparsity"] = 0.95
    return fields | extra


OLD, NEW = "2026-01-01T00:00:00+00:00", "2026-01-02T00:00:00+00:00"
ROWS = [
    row(OLD, "qwen2.5-3b", "sdpa_cudnn", 100.0, 300.0),  # an earlier run: 400 ms cuDNN
    row(OLD, "qwen2.5-3b", "mtraining", 10.0, 30.0),
    row(NEW, "qwen2.5-3b", "sdpa_cudnn", 120.0, 360.0),  # the latest run: 480 ms cuDNN
    row(NEW, "qwen2.5-3b", "mtraining", 12.0, 28.0, index_queued_ms=0.5),  # 12x
    row(NEW, "qwen2.5-3b", "mtraining_deterministic", 12.0, 68.0),  # 6x
    row(NEW, "qwen2.5-3b", "mtraining", 20.0, 60.0, top_p=0.9),  # 6x
    row(NEW, "mha", "sdpa_cudnn", 100.0, 300.0, seq_len=32768),
    row(NEW, "mha", "mtraining", 20.0, 30.0, seq_len=32768),
]  # 8x


def test_the_legend_fits_inside_the_figure():
    """A full run's seven labels on one panel (the bench's one-shape runs): every legend entry is drawn inside the
    figure, where three columns across one 5-inch panel ran past both its edges."""
    impls = ["mtraining", "mtraining_deterministic", "mtraining_blocks", "mtraining_dense", "flex_attention"]
    rows = [row(NEW, "qwen2.5-3b", "sdpa_cudnn", 100.0, 300.0)]
    rows += [row(NEW, "qwen2.5-3b", impl, 10.0, 30.0) for impl in impls + ["flex_attention_blocks"]]
    rows += [row(NEW, "qwen2.5-3b", "mtraining", 20.0, 60.0, top_p=0.9)]
    fig = bench_attention.speedup_figure(rows)
    fig.canvas.draw()
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 7
    inside = fig.bbox
    for text in legend.get_texts():
        box = text.get_window_extent()
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0, text.get_text()


def test_report_only_uses_the_latest_run_and_its_own_cudnn(tmp_path):
    jsonl, table, plot = tmp_path / "rows.jsonl", tmp_path / "table.md", tmp_path / "plot.png"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    bench_attention.main(["--report-only", "--jsonl", str(jsonl), "--table", str(table), "--plot", str(plot)])
    text = table.read_text()
    assert f"commit c-{NEW}" in text and f"c-{OLD}" not in text
    body = [line for line in text.splitlines() if line.startswith("| qwen2.5-3b") or line.startswith("| mha")]
    assert len(body) == 6, text
    cells = [line.split(" | ") for line in body]
    all_speedups = {(c[0].lstrip("| "), c[2]): c[12].split("/")[-1] for c in cells}
    assert all_speedups == {
        ("qwen2.5-3b", "sdpa_cudnn"): "–",
        ("qwen2.5-3b", "mtraining"): "12.00",  # 10.00: old run
        ("qwen2.5-3b", "mtraining_deterministic"): "6.00",
        ("qwen2.5-3b", "mtraining (top-P 0.9)"): "6.00",
        ("mha", "sdpa_cudnn"): "–",
        ("mha", "mtraining"): "8.00",
    }, text
    queued = {(c[0].lstrip("| "), c[2]): c[9] for c in cells if c[2] in ("mtraining", "mtraining_deterministic")}
    assert queued == {  # rows from before the queued timing have none
        ("qwen2.5-3b", "mtraining"): "0.50",
        ("qwen2.5-3b", "mtraining_deterministic"): "–",
        ("mha", "mtraining"): "–",
    }, text
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_plot_has_a_panel_per_shape_and_a_colour_per_pattern():
    fig = bench_attention.speedup_figure(bench_attention.latest_run(ROWS))
    panels = {
        ax.get_title(): {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
        for ax in fig.axes
    }
    assert set(panels) == {"mha", "qwen2.5-3b"}
    lines = panels["qwen2.5-3b"]
    assert set(lines) == {"sparsity 0.95", "deterministic sparsity 0.95", "top-P 0.90 (structured q/k)"}
    assert list(lines["sparsity 0.95"].get_ydata()) == pytest.approx([12.0])
    assert list(lines["top-P 0.90 (structured q/k)"].get_ydata()) == pytest.approx([6.0])
    assert lines["deterministic sparsity 0.95"].get_linestyle() == "--"
    assert lines["deterministic sparsity 0.95"].get_color() == lines["sparsity 0.95"].get_color()
    assert lines["top-P 0.90 (structured q/k)"].get_color() != lines["sparsity 0.95"].get_color()
    assert list(panels["mha"]["sparsity 0.95"].get_ydata()) == pytest.approx([8.0])


def test_profile_index_prints_each_step_and_its_host_waits(capsys):
    """--profile's index report: one table per named step, with the host waits it counted (none on a CPU)."""
    import torch

    seq_len = 1024
    q, k = torch.randn(1, seq_len, 2, 32), torch.randn(1, seq_len, 1, 32)
    v_idx = torch.arange(0, seq_len, 16, dtype=torch.int32).expand(1, 2, -1)  # 64 verticals per head
    s_idx = torch.arange(128, dtype=torch.int32).expand(1, 2, -1)  # the 128 nearest diagonals
    convert, estimate = bench_attention.index_steps(q, k, v_idx, s_idx, seq_len)
    bench_attention.profile_index({"conversion": convert, "static estimation": estimate}, "tiny")
    printed = capsys.readouterr().out
    for name in ("conversion", "static estimation"):
        assert f"# index kernel times, {name}, tiny; host waits and copies per call: none" in printed
    assert printed.count("Self CPU") >= 2


def test_the_index_chain_converts_the_index_its_estimation_returns():
    """One call of the chain is the estimation, then the conversion of that estimate (not of the bench's
    pattern): its lists are those of converting the estimated index."""
    import torch

    seq_len = 1024
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, seq_len, 2, 32, generator=generator), torch.randn(1, seq_len, 1, 32, generator=generator)
    v_idx = torch.arange(0, seq_len, 16, dtype=torch.int32).expand(1, 2, -1)
    s_idx = torch.arange(128, dtype=torch.int32).expand(1, 2, -1)
    _, estimate = bench_attention.index_steps(q, k, v_idx, s_idx, seq_len)
    estimated = estimate()
    assert not torch.equal(estimated.v_idx, v_idx)  # random q/k pick other columns than the pattern's
    chained = bench_attention.index_chain(estimate, seq_len)()
    expected = bench_attention.converted_index(estimated.v_idx, estimated.s_idx, seq_len)
    for name in ("blk_ptr", "blk_col", "bar_ptr", "bar_col", "key_ptr", "key_qblock"):
        assert torch.equal(getattr(chained, name), getattr(expected, name)), name


def test_a_run_without_cudnn_rows_writes_no_plot_and_says_so(tmp_path, capsys):
    """An A/B run with every baseline off (``--cudnn-max-len 0``) has nothing to plot against: no figure, a
    note on stderr, no error after the timing."""
    rows = [r for r in bench_attention.latest_run(ROWS) if r["impl"] != "sdpa_cudnn"]
    plot = tmp_path / "speedup.png"
    bench_attention.write_plot(rows, str(plot))
    assert not plot.exists()
    assert "no sdpa_cudnn rows" in capsys.readouterr().err


def test_block_only_rows_compare_with_flex_launched_and_queued(tmp_path):
    """A block-only row against its Flex peer of the same run: × Flex from the launched timings, × Flex queued from
    the queued ones, and the queued fwd+bwd in its own column; a row without queued timings shows none."""
    rows = [
        row(NEW, "qwen2.5-3b", "sdpa_cudnn", 100.0, 300.0, seq_len=32768),
        row(NEW, "qwen2.5-3b", "mtraining_blocks", 1.0, 2.0, seq_len=32768, fwd_queued_ms=0.5, bwd_queued_ms=1.0),
        row(NEW, "qwen2.5-3b", "flex_attention_blocks", 1.5, 1.5, seq_len=32768, fwd_queued_ms=1.0, bwd_queued_ms=1.0),
        row(NEW, "qwen2.5-3b", "mtraining", 1.0, 3.0, seq_len=32768),
    ]
    table = tmp_path / "table.md"
    bench_attention.write_table(rows, str(table))
    cells = {
        c[2]: c for c in (line.split(" | ") for line in table.read_text().splitlines() if line.startswith("| qwen"))
    }
    assert cells["mtraining_blocks"][7] == "1.50" and cells["mtraining_blocks"][13] == "1.50/0.75/1.00"
    assert cells["mtraining_blocks"][14] == "1.33"  # 2.0 ms queued Flex / 1.5 ms queued ours
    assert cells["flex_attention_blocks"][7] == "2.00"
    assert cells["mtraining"][7] == "–" and cells["mtraining"][14] == "–"


def test_row_summary_shows_the_queued_timings_and_the_flex_check():
    """The log line of a row: its queued attention and index timings where it has them, Flex's cross-check."""
    flex = row(NEW, "qwen2.5-3b", "flex_attention_blocks", 1.5, 1.5, seq_len=32768, fwd_queued_ms=1.0)
    flex.update(bwd_queued_ms=1.25, index_queued_ms=0.5, mask_ms=2.0, flex_check={"out": {"rel_rmse": 2e-3}})
    line = bench_attention.row_summary(flex)
    assert "fwd/bwd=1.50/1.50 (queued 1.00/1.25) index=2.00 (queued 0.50) ms" in line
    assert line.endswith("mask=2.00 ms, vs ours max rel RMSE 2.0e-03")
    plain = bench_attention.row_summary(row(NEW, "qwen2.5-3b", "mtraining", 12.0, 28.0))
    assert "fwd/bwd=12.00/28.00 index=2.00 ms" in plain and "queued" not in plain and "mask" not in plain


class SilentTelemetry:
    """A ``gpu_telemetry.Telemetry`` stand-in that got no samples (as without nvidia-smi)."""

    summary: dict = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_queued_attention_timings_stop_at_their_length_limit(monkeypatch):
    """fwd_bwd_timings asks for the launched timing always and the queued one (behind the sleep) only up to
    QUEUED_MAX_LEN."""
    monkeypatch.setattr(bench_attention, "_telemetry", SilentTelemetry)
    leads = []

    def time_fn(lead):
        leads.append(lead)
        return (1.0, 2.0) if lead == 0.0 else (0.5, 1.5)

    limit = bench_attention.QUEUED_MAX_LEN
    short = bench_attention.fwd_bwd_timings(time_fn, limit)
    assert short == dict(fwd_ms=1.0, bwd_ms=2.0, fwd_queued_ms=0.5, bwd_queued_ms=1.5)
    assert leads == [0.0, bench_attention.QUEUE_LEAD_MS]
    assert bench_attention.fwd_bwd_timings(time_fn, 2 * limit) == dict(fwd_ms=1.0, bwd_ms=2.0)
    assert leads[2:] == [0.0]


def test_attention_timings_record_the_clocks_each_ran_at(monkeypatch):
    """Each of the two timings gets the clock and power of the telemetry around it; a timing without samples gets
    no clock fields; the log line shows the clocks a row has."""
    summaries = iter([{"sm_clock_mhz": 1665.0, "power_max_w": 717.0}, {"sm_clock_mhz": 1942.5, "power_max_w": 686.0}])

    class FakeTelemetry:
        def __enter__(self):
            self.summary = next(summaries)
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(bench_attention, "_telemetry", FakeTelemetry)
    timings = bench_attention.fwd_bwd_timings(lambda lead: (1.0, 2.0) if lead == 0.0 else (0.5, 1.5), 1024)
    assert timings == dict(
        fwd_ms=1.0,
        bwd_ms=2.0,
        sm_clock_mhz=1665.0,
        power_max_w=717.0,
        fwd_queued_ms=0.5,
        bwd_queued_ms=1.5,
        sm_clock_queued_mhz=1942.5,
        power_max_queued_w=686.0,
    )
    monkeypatch.setattr(bench_attention, "_telemetry", SilentTelemetry)
    assert bench_attention.fwd_bwd_timings(lambda lead: (1.0, 2.0), 2 * bench_attention.QUEUED_MAX_LEN) == dict(
        fwd_ms=1.0, bwd_ms=2.0
    )
    shown = row(NEW, "qwen2.5-3b", "mtraining", 1.0, 2.0)
    shown.update(timings)
    assert "TFLOP/s at 1665/1942 MHz" in bench_attention.row_summary(shown)


def test_step_timings_record_both_timings_of_each_step_and_their_sums(monkeypatch):
    """Each index step's launch-bound and queued ms under the row's field names, and the index totals."""
    monkeypatch.setattr(bench_attention, "median_ms", lambda step, reps, lead=0.0: step() / (4 if lead else 1))
    timings = bench_attention.step_timings({"convert": lambda: 4.0, "estimate": lambda: 2.0}, 3)
    assert timings == {
        "convert_ms": 4.0,
        "convert_queued_ms": 1.0,
        "estimate_ms": 2.0,
        "estimate_queued_ms": 0.5,
        "index_ms": 6.0,
        "index_queued_ms": 1.5,
    }


def test_deterministic_rows_count_the_bar_lists_by_column_in_their_index(monkeypatch):
    """The deterministic backward's bar chunks are built from the index's lists (a real build, timed) and
    their ms join the index sums; the default row's timings are left as they were."""
    built = []

    def fake_median(step, reps, lead=0.0):
        built.append(step())
        return 3.0 / (4 if lead else 1)

    monkeypatch.setattr(bench_attention, "median_ms", fake_median)
    v_idx, s_idx = random_index(1, 2, 1024, 64, 4, torch.Generator().manual_seed(0), forced=True)
    index = convert_index(v_idx, s_idx, Layout("contiguous", 1), 0, 1024)
    timings = {"convert_ms": 4.0, "estimate_ms": 2.0, "index_ms": 6.0, "index_queued_ms": 1.5}
    got = bench_attention.deterministic_timings(index, 1, timings)
    assert got == dict(timings, bar_chunks_ms=3.0, bar_chunks_queued_ms=0.75, index_ms=9.0, index_queued_ms=2.25)
    assert timings["index_ms"] == 6.0
    chained = dict(timings, index_chain_ms=5.0, index_chain_queued_ms=1.25)
    got = bench_attention.deterministic_timings(index, 1, chained)
    assert (got["index_ms"], got["index_chain_ms"], got["index_chain_queued_ms"]) == (9.0, 8.0, 2.0)
    assert all(isinstance(chunks, BarChunks) and chunks.column.numel() > 0 for chunks in built)
