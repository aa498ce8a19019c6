"""The bench figure: one colour and marker per impl in every panel, unfinished cases marked, a
memory floor, labelled log ticks, peer ÷ ours ratios at the largest common N, missing peers named.
"""

from __future__ import annotations

import pytest

from fgrpo_kernels.benchmarks.plots import STYLE, figure
from fgrpo_kernels.benchmarks.report import COLUMNS
from fgrpo_kernels.benchmarks.workload import memory_floor

pytest.importorskip("matplotlib")

MIB = {"eager": 1500.0, "liger": 200.0, "ours": 60.0, "compile": 1100.0}
MS = {"eager": 3000.0, "liger": 2000.0, "ours": 1000.0, "compile": 1500.0}


def rec(impl, n, status="ok", workload="logprobs", scale=1.0):
    r = dict.fromkeys(COLUMNS)
    ok = status == "ok"
    r.update(impl=impl, workload=workload, tokens=n, vocab=32768, hidden=128, dtype="float32",
             status=status, batch=8, seq_len=n // 8, device="cpu")  # fmt: skip
    r["pass"] = "fwd+bwd"
    r["time_ms"] = MS[impl] * n / 4096 * scale if ok else None
    grows = impl in ("eager", "compile")  # materialising: memory ∝ N
    r["peak_mem_mib"] = MIB[impl] * (n / 4096 if grows else 1) if ok else None
    return r


@pytest.fixture(scope="module")
def fig():
    rows = []
    for workload in ("logprobs", "grpo"):
        rows += [rec("ours", n, workload=workload) for n in (4096, 16384, 65536)]
        rows += [rec("eager", 4096, workload=workload), rec("eager", 16384, "oom", workload)]
        rows += [rec("liger", n, workload=workload, scale=1.3) for n in (4096, 16384)]
    rows += [rec("compile", 4096), rec("compile", 16384, "timeout")]
    rows += [rec("trl", 4096, "unavailable")]
    figure_ = figure(rows, title="test run")
    figure_.canvas.draw()
    yield figure_
    import matplotlib.pyplot as plt

    plt.close(figure_)


def lines(ax, suffix=None):
    return [
        line for line in ax.get_lines()
        if line.get_gid() and (suffix is None or line.get_gid().endswith(suffix))
    ]  # fmt: skip


def test_two_rows_of_panels_one_per_workload(fig):
    axes = fig.axes
    assert len(axes) == 4  # memory and time × (logprobs, grpo)
    titles = [ax.get_title() for ax in axes[:2]]
    assert titles[0].startswith("logprobs, fwd+bwd") and titles[1].startswith("grpo, fwd+bwd")
    assert all("lower is better" in ax.get_ylabel() for ax in (axes[0], axes[2]))


def test_one_colour_and_marker_per_impl_in_every_panel(fig):
    seen = {}
    for ax in fig.axes:
        for line in lines(ax, ":ok"):
            impl = line.get_gid().split(":")[0]
            look = (line.get_color(), line.get_marker())
            assert look == STYLE[impl][:2], (impl, look)
            seen.setdefault(impl, set()).add(look)
    assert set(seen) == {"eager", "liger", "ours", "compile"}
    assert all(len(looks) == 1 for looks in seen.values())
    colours = [STYLE[i][0] for i in STYLE]
    assert len(set(colours)) == len(colours)  # no two impls share a colour


def test_unfinished_cases_are_marked_at_their_n(fig):
    for ax in fig.axes:
        marks = {line.get_gid(): line.get_xdata()[0] for line in lines(ax, ":oom")}
        assert marks == {"eager:oom": 16384}
        assert "oom" in [t.get_text() for t in ax.texts]
    first = fig.axes[0]
    assert [line.get_xdata()[0] for line in lines(first, ":timeout")] == [16384]


def test_memory_floor_line(fig):
    for ax in fig.axes[:2]:
        (floor,) = lines(ax, "floor")
        xs = list(floor.get_xdata())
        assert xs == [4096, 16384, 65536]
        want = [memory_floor("fwd+bwd", n, 128, 32768, "float32") / 2**20 for n in xs]
        assert list(floor.get_ydata()) == pytest.approx(want)
    assert not lines(fig.axes[2], "floor")  # time panels have none


def test_ratios_at_the_largest_common_n(fig):
    memory, time = fig.axes[0], fig.axes[2]
    texts = {a.get_gid(): a for a in memory.texts if a.get_gid()}
    # eager ran only at 4096; liger up to 16384
    assert texts["eager:ratio"].xy[0] == 4096 and texts["eager:ratio"].get_text() == "25×"
    assert texts["liger:ratio"].xy[0] == 16384 and texts["liger:ratio"].get_text() == "3.3×"
    times = {a.get_gid(): a.get_text() for a in time.texts if a.get_gid()}
    assert times["liger:ratio"] == "2.6×" and times["compile:ratio"] == "1.5×"


def test_log_axes_have_labelled_ticks(fig):
    for ax in fig.axes:
        lo, hi = ax.get_ylim()
        labels = [t.get_text() for t in ax.get_yticklabels() if lo <= t.get_position()[1] <= hi]
        assert len([s for s in labels if s]) >= 2, labels
        xs = [t.get_text() for t in ax.get_xticklabels()]
        assert xs == ["4k", "16k", "64k"]


def test_legend_names_impls_and_missing_peers(fig):
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    for impl in ("eager", "compile", "liger", "ours"):
        assert STYLE[impl][2] in labels
    assert "TRL" not in labels and "did not finish" in labels
    assert "Not installed: trl" in fig._suptitle.get_text()


def test_ratio_labels_at_one_n_never_overlap():
    """Three peers 1.35× apart at 16k on panels spanning 3+ decades: a gap in data units (30 %)
    is less than a line of text there, so the labels are kept apart in display units."""
    rows = [rec("ours", n) for n in (4096, 16384, 65536)]
    crowd = {"trl": (10000.0, 4000.0), "cce": (7400.0, 2960.0), "verl": (5500.0, 2200.0)}
    for impl, (ms, mib) in crowd.items():
        r = rec("ours", 16384)
        r.update(impl=impl, time_ms=ms, peak_mem_mib=mib)
        rows.append(r)
    rows[0]["time_ms"], rows[2]["time_ms"] = 100.0, 40000.0  # a time axis of 2.6 decades
    fig_ = figure(rows)
    fig_.canvas.draw()
    renderer = fig_.canvas.get_renderer()
    try:
        for ax in fig_.axes:
            labels = [t for t in ax.texts if (t.get_gid() or "").endswith(":ratio")]
            assert sorted(t.get_gid() for t in labels) == ["cce:ratio", "trl:ratio", "verl:ratio"]
            boxes = [t.get_window_extent(renderer) for t in labels]
            for i, a in enumerate(boxes):
                assert not any(a.overlaps(b) for b in boxes[i + 1 :]), [t.get_gid() for t in labels]
            assert all(t.xy[0] == 16384 for t in labels)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig_)
