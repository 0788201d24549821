"""The tier views (labkit.viz.tiers, and the radix tree's host-tier nodes), checked against the records
of real runs of the tiny random-weight model with a host tier and a disk tier."""

from __future__ import annotations

import io

import pytest
from matplotlib.colors import to_hex

from labkit import Engine
from labkit.bench.datasets import Request
from labkit.bench.runner import run_requests
from labkit.viz import draw_radix_tree
from labkit.viz.tiers import HOST_CATEGORIES, HOST_ONLY, MOVES, draw_tiers, tier_frame

GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def render(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"
    return buf.getvalue()


def prefix_workload() -> list[Request]:
    """Five 20-token prefixes one after another through a 64-token pool, then the first again: the
    device offloads the old ones to the host, and the last request loads its prefix back."""
    reqs = [Request(f"p{i}", input_ids=[10 + i] * 16 + [100 + i] * 4, sampling_params=GREEDY) for i in range(5)]
    return [*reqs, Request("p0-again", input_ids=[10] * 16 + [100] * 4, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def tier_engine(tiny):
    return Engine(enable_trace=True, max_total_tokens=64, enable_hierarchical_cache=True, **tiny)


@pytest.fixture(scope="module")
def tier_run(tier_engine):
    run = run_requests(tier_engine, prefix_workload(), sequential=True, label="tiers")
    kinds = {e.kind for e in run.tracer.tree_events}
    assert {"write_host", "offload", "load_back"} <= kinds, "the fixture run must offload and load back"
    return run


def test_tier_frame_is_the_step_records_and_the_tree_events(tier_engine, tier_run):
    frame = tier_frame(tier_run)
    assert frame["step"].tolist() == tier_run.step_ids
    for row, s in zip(frame.itertuples(), tier_run.steps):
        assert s.host_pool is not None
        assert [getattr(row, f"host_{c}") for c in HOST_CATEGORIES] == [
            getattr(s.host_pool, c) for c in HOST_CATEGORIES
        ]
        assert row.free == s.pool.free and row.evictable == s.pool.evictable
        for kind, column in MOVES.items():
            moved = sum(e.num_tokens for e in tier_run.tree_events(s.step) if e.kind == kind)
            assert getattr(row, column) == moved, (s.step, kind)
    stats = tier_engine.tree_cache.stats  # the engine's cache was built for this run alone
    assert frame["written_to_host"].sum() == stats.written_to_host > 0
    assert frame["loaded_back"].sum() == stats.loaded_back > 0
    assert tier_run.results["p0-again"]["meta_info"]["cached_tokens"] == 19  # all but the last prompt token


def test_tier_figure_draws_both_pools_and_a_bar_per_step_that_copied(tier_run):
    fig = draw_tiers(tier_run)
    frame = tier_frame(tier_run)
    dev, copies, host = fig.axes[:3]
    assert {c.get_gid() for c in dev.collections} >= {"device-free", "device-evictable"}
    assert {c.get_gid() for c in host.collections} == {f"host-{c}" for c in HOST_CATEGORIES}
    for column in ("written_to_host", "loaded_back"):
        bars = [p for p in copies.patches if p.get_gid() == f"copy-{column}"]
        assert sorted(round(p.get_x() + p.get_width() / 2) for p in bars) == frame.step[frame[column] > 0].tolist()
        assert sum(abs(p.get_height()) for p in bars) == frame[column].sum()
    marks = [line for line in dev.lines if line.get_gid() == "mark-offloaded"]
    assert [int(m.get_xdata()[0]) for m in marks] == frame.step[frame.offloaded > 0].tolist()
    render(fig)


def test_tier_views_refuse_a_run_without_a_host_tier(tiny_run):
    with pytest.raises(ValueError, match="no host tier"):
        tier_frame(tiny_run)


def test_tree_fills_host_only_nodes_and_strips_device_nodes_with_a_host_copy(tier_run):
    admitted = next(s.step for s in tier_run.steps if "p0-again" in s.rids)
    for step in (admitted - 1, admitted):
        snap = tier_run.tree_at(step)
        fig = draw_radix_tree(tier_run, step=step)
        ax = fig.axes[0]
        for n in snap.nodes[1:]:
            box = fig.labkit_nodes[n.id]
            assert (to_hex(box.get_facecolor()) == HOST_ONLY) == (n.tier == "host"), (step, n)
        strips = {int(p.get_gid()[10:]) for p in ax.patches if (p.get_gid() or "").startswith("host-copy-")}
        assert strips == {n.id for n in snap.nodes if n.tier == "device+host"}
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "host only (off the device)" in labels
        render(fig)
    before = tier_run.tree_at(admitted - 1)
    assert any(n.tier == "host" for n in before.nodes), "p0's prefix waits on the host before it comes back"
    loaded = {e.node_id for e in tier_run.tree_events(admitted) if e.kind == "load_back"}
    texts = " ".join(t.get_text() for t in draw_radix_tree(tier_run, step=admitted).axes[0].texts)
    assert loaded and all(f"LOADED #{i}" in texts or f"LOADED SPLIT #{i}" in texts for i in loaded)


def test_a_device_only_tree_keeps_its_legend(tiny_run):
    fig = draw_radix_tree(tiny_run)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(labels) == 5 and not any("host" in label for label in labels)
    assert not any((p.get_gid() or "").startswith("host-copy-") for p in fig.axes[0].patches)


def test_a_restarted_engine_reads_the_disk_tier_and_the_views_show_it(tiny, tmp_path):
    opts = dict(
        enable_hierarchical_cache=True, max_total_tokens=64, hicache_storage_dir=str(tmp_path), hicache_storage_block=8
    )
    prompt = list(range(20, 45))  # 25 tokens: 24 can match, three blocks of 8
    first = Engine(**opts, **tiny).generate(input_ids=prompt, sampling_params=GREEDY)
    restarted = Engine(enable_trace=True, **opts, **tiny)
    run = run_requests(restarted, [Request("again", input_ids=prompt, sampling_params=GREEDY)], label="restart")
    assert run.results["again"]["output_ids"] == first["output_ids"]
    frame = tier_frame(run)
    assert frame["read_from_disk"].sum() == restarted.tree_cache.stats.read_from_disk == 24
    step = int(frame.step[frame.read_from_disk > 0].iloc[0])
    texts = " ".join(t.get_text() for t in draw_radix_tree(run, step=step).axes[0].texts)
    assert "FROM DISK" in texts
    render(draw_tiers(run))
