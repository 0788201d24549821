"""Notebook 05's views: the policy comparison (medians and spread of repeats beside the counts), the
order each policy makes of one queue, memory charts on shared axes, rows coloured by group."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer, ErrorbarContainer

from labkit import Engine
from labkit.bench.datasets import shared_prefix_workload
from labkit.bench.policies import policy_orders
from labkit.bench.runner import run_requests
from labkit.viz import draw_timelines
from labkit.viz.policies import draw_memories, draw_policy_comparison, draw_policy_orders, group_colors, mark_groups


def render(fig) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"


def summary_frame() -> pd.DataFrame:
    """A policy_summary(...)-shaped table: two workloads, two policies, counts and timed medians."""
    rows = []
    for w, base in (("shared", 1.0), ("random", 2.0)):
        for p, k in (("fcfs", 1.0), ("lpm", 0.5)):
            rows.append({
                "workload": w, "policy": p, "repeats": 5, "prefill_tokens": int(1000 * k * base),
                "cache_hit_rate": 1 - k, "forward_passes": 20, "total_tok_s": 100 / k,
                "total_tok_s_min": 80 / k, "total_tok_s_max": 130 / k, "ttft_mean_s": 0.3 * k,
                "ttft_mean_s_min": 0.2 * k, "ttft_mean_s_max": 0.5 * k,
            })  # fmt: skip
    return pd.DataFrame(rows)


def test_policy_comparison_draws_medians_with_whiskers_only_for_timed_metrics():
    df = summary_frame()
    fig = draw_policy_comparison(df, title="t")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 5  # e2e_mean_s is not in the table: left out
    # gid: bars-<metric>-<workload> (ax.containers also lists each bar's ErrorbarContainer)
    bars = {c.patches[0].get_gid(): c for ax in panels for c in ax.containers if isinstance(c, BarContainer)}
    lpm_shared = df[(df["workload"] == "shared") & (df["policy"] == "lpm")].iloc[0]
    timed = bars["bars-total_tok_s-shared"]
    assert timed.patches[1].get_height() == pytest.approx(lpm_shared["total_tok_s"])  # the median
    assert timed.errorbar is not None
    whisker = timed.errorbar.lines[2][0].get_segments()[1]  # lpm's: from its min to its max
    assert [y for _, y in whisker] == pytest.approx([lpm_shared["total_tok_s_min"], lpm_shared["total_tok_s_max"]])
    counted = bars["bars-prefill_tokens-random"]
    assert counted.errorbar is None and counted.patches[0].get_height() == 2000
    assert "median of 5 runs" in panels[3].get_title(loc="left") and "median" not in panels[0].get_title(loc="left")
    render(fig)


def test_policy_comparison_of_single_runs_has_no_whiskers():
    df = summary_frame().drop(columns=[c for c in summary_frame() if c.endswith(("_min", "_max"))] + ["repeats"])
    fig = draw_policy_comparison(df)
    assert all(c.errorbar is None for ax in fig.axes for c in ax.containers if isinstance(c, BarContainer))
    assert not any(isinstance(c, ErrorbarContainer) for ax in fig.axes for c in ax.containers)


@pytest.fixture(scope="module")
def shared_runs(tiny):
    """The tiny shared-prefix workload under fcfs and lpm on a traced engine whose pool is short."""
    engine = Engine(enable_trace=True, max_total_tokens=96, max_running_requests=2, **tiny)
    reqs = shared_prefix_workload(
        num_groups=3, per_group=2, prefix_len=24, question_len=4, output_len=(2, 6), vocab_size=256
    )
    runs = [run_requests(engine, reqs, policy=p, label=p) for p in ("fcfs", "lpm")]
    return engine, reqs, runs


def test_policy_orders_figure_has_a_cell_per_request_coloured_by_group(shared_runs):
    engine, reqs, _ = shared_runs
    run_requests(engine, reqs[:1])  # g0's prefix in the cache
    orders = policy_orders(engine, reqs[1:], ["fcfs", "lpm"])
    groups = {r.rid: r.group for r in reqs}
    fig = draw_policy_orders(orders, groups)
    cells = {p.get_gid(): p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("order-")}
    assert len(cells) == orders.size
    colors = group_colors(groups)
    for policy in orders.columns:
        for pos, text in enumerate(orders[policy]):
            rid = text.split(" (")[0]
            assert to_hex(cells[f"order-{policy}-{pos}"].get_facecolor()) == to_hex(colors[groups[rid]])
    assert orders["lpm"][0].startswith("g0-q1")  # the cached group first
    render(fig)


def test_memories_share_both_axes_and_span_the_longest_run(shared_runs):
    _, _, runs = shared_runs
    fig = draw_memories(runs)
    axes = fig.axes
    assert len(axes) == 2 and axes[0].get_xlim() == axes[1].get_xlim() and axes[0].get_ylim() == axes[1].get_ylim()
    last = max(r.steps[-1].step for r in runs)
    assert axes[0].get_xlim()[1] == pytest.approx(last + 0.5)
    assert axes[1].get_legend() is None and axes[0].get_legend() is not None
    render(fig)


def test_mark_groups_colours_timeline_rows_by_group(shared_runs):
    _, reqs, runs = shared_runs
    groups = {r.rid: r.group for r in reqs}
    fig = mark_groups(draw_timelines(runs, row_order="schedule"), groups)
    colors = group_colors(groups)
    labels = [t for ax in fig.axes for t in ax.get_yticklabels()]
    assert len(labels) == 2 * len(reqs)
    for t in labels:
        assert to_hex(t.get_color()) == to_hex(colors[groups[t.get_text()]])
