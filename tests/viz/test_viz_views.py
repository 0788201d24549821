"""The static views, checked against the records of a real run and the live engine objects."""

from __future__ import annotations

import io

import pytest

from labkit import Engine
from labkit.bench.datasets import Request
from labkit.bench.runner import run_requests
from labkit.viz import (
    batch_frame,
    cells_frame,
    draw_kv_pool,
    draw_memory,
    draw_radix_tree,
    draw_timeline,
    draw_timelines,
    draw_waiting,
    kv_snapshot,
    memory_frame,
    page_owners,
    req_to_token_table,
    waiting_frame,
    waiting_table,
)
from labkit.viz.memory import CATEGORIES
from labkit.viz.run import Run


def render(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"
    return buf.getvalue()


# ---- radix tree -----------------------------------------------------------------------------------
def test_snapshots_agree_with_the_pool_accounting(tiny_run):
    """Per step, the recorded tree's evictable/protected tokens are what the scheduler counted."""
    assert [s.step for s in tiny_run.tracer.snapshots] == tiny_run.step_ids
    for s in tiny_run.steps:
        tree = tiny_run.tree_at(s.step)
        assert (tree.evictable, tree.protected) == (s.pool.evictable, s.pool.protected), s.step


def test_tree_figure_has_one_box_per_radix_node(tiny_run):
    steps = [s.step for s in tiny_run.steps]
    changed = [k for k in steps if tiny_run.tree_events(k)]
    for k in sorted({steps[0], steps[-1], *changed[:: max(1, len(changed) // 6)]}):
        fig = draw_radix_tree(tiny_run, step=k)
        snap = tiny_run.tree_at(k)
        ax = fig.axes[0]
        boxes = [p for p in ax.patches if (p.get_gid() or "").startswith("node-")]
        assert sorted(int(p.get_gid()[5:]) for p in boxes) == sorted(n.id for n in snap.nodes)
        ghosts = {int(p.get_gid()[8:]) for p in ax.patches if (p.get_gid() or "").startswith("evicted-")}
        assert ghosts == {e.node_id for e in tiny_run.tree_events(k) if e.kind == "evict"}
    evict_step = next(k for k in steps if any(e.kind == "evict" for e in tiny_run.tree_events(k)))
    render(draw_radix_tree(tiny_run, step=evict_step))


def test_live_tree_is_the_cache_now(tiny_engine, tiny_run):
    fig = draw_radix_tree(tiny_engine)
    assert set(fig.labkit_nodes) == {n.id for n in tiny_engine.tree_cache.nodes()}


def test_tree_of_a_few_hundred_nodes_stays_bounded(tiny):
    engine = Engine(enable_trace=True, max_total_tokens=8192, **tiny)
    for a in range(20):  # a three-level tree: 20 x 4 x 3 leaves, ~340 nodes
        for b in range(4):
            for c in range(3):
                engine.add_request(
                    input_ids=[10 + a] * 3 + [50 + b] * 2 + [100 + c, 3 + a + b], sampling_params={"max_new_tokens": 1}
                )
    engine.run_until_done()
    fig = draw_radix_tree(engine)
    n = sum(1 for _ in engine.tree_cache.nodes())
    assert n > 250 and len(fig.labkit_nodes) == n
    assert fig.get_figheight() < 45  # rows shrink instead of growing without bound
    render(fig)


# ---- timeline -------------------------------------------------------------------------------------
def test_timeline_has_one_row_per_request(tiny_run):
    rids = [r for r in tiny_run.results]
    assert sorted(tiny_run.rids) == sorted(rids)
    for x in ("step", "time"):
        fig = draw_timeline(tiny_run, x=x)
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert labels == tiny_run.rids
    fig = draw_timelines([tiny_run, tiny_run], ["a", "b"])
    assert all(len(ax.get_yticklabels()) == len(rids) for ax in fig.axes)
    render(fig)


def test_timeline_rows_in_schedule_order_follow_the_first_computing_step(tiny_run):
    fig = draw_timeline(tiny_run, row_order="schedule")
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    cells = cells_frame(tiny_run)
    first = cells[cells["phase"].isin(["prefill", "decode"])].groupby("rid")["step"].min()
    assert sorted(labels) == sorted(tiny_run.rids)
    assert [first[r] for r in labels] == sorted(first[r] for r in labels)
    with pytest.raises(ValueError, match="row_order"):
        draw_timeline(tiny_run, row_order="alphabetical")


def test_timeline_ticks_every_output_token(tiny_run):
    """A tick per (request, step) that gave it tokens; together they are each request's output."""
    cells = cells_frame(tiny_run)
    for rid, res in tiny_run.results.items():
        assert cells[cells["rid"] == rid]["tokens_out"].sum() == res["meta_info"]["completion_tokens"], rid
    chunked = {(s.chunked_rid, s.step) for s in tiny_run.steps if s.chunked_rid}
    assert chunked and all(out == 0 for out in cells.set_index(["rid", "step"]).loc[list(chunked), "tokens_out"])
    assert set(cells[cells["phase"].isin(["queued", "stalled"])]["tokens_out"]) == {0}
    for x in ("step", "time"):
        ax = draw_timeline(tiny_run, x=x).axes[0]
        ticks = [c for c in ax.collections if c.get_gid() == "tokens"]
        assert len(ticks) == 1 and len(ticks[0].get_segments()) == (cells["tokens_out"] > 0).sum()
    ax = draw_timeline(tiny_run, show_tokens=False).axes[0]
    assert not [c for c in ax.collections if c.get_gid() == "tokens"]


def test_mixed_steps_are_labelled_with_their_decode_count(tiny, tiny_run):
    """A MIXED step's decodes are a sliver on its chunk: the batch panel writes '+n' over it, and
    the chunk's label in the Gantt chart says it too (the same form on every chunk, where it fits)."""
    engine = Engine(enable_trace=True, chunked_prefill_size=24, enable_mixed_chunk=True, **tiny)
    reqs = [
        Request(f"r{i}", input_ids=list(range(10, 10 + n)), sampling_params={"max_new_tokens": 12, "ignore_eos": True})
        for i, n in enumerate([5, 6, 100])
    ]
    reqs[2].arrive_step = 2
    run = run_requests(engine, reqs, label="mixed")
    mixed = batch_frame(run).query("forward_mode == 'MIXED'")
    assert len(mixed) >= 3 and set(mixed["decode_tokens"]) == {2}
    for x in ("step", "time"):
        fig = draw_timeline(run, x=x)
        gantt, batch = fig.axes[0], fig.axes[1]
        # by step every MIXED bar is as wide and gets its label; in time, those too short go without
        above = [t.get_text() for t in batch.texts]
        chunks = [t.get_text() for t in gantt.texts if "+" in t.get_text()]
        long, short = [f"{p} + 2 dec" for p in mixed["prefill_tokens"]], [f"{p}+2" for p in mixed["prefill_tokens"]]
        if x == "step":
            assert above in (["+2 dec"] * len(mixed), ["+2"] * len(mixed)), above
            assert chunks in (long, short), chunks
        else:
            assert len(set(above)) <= 1 and set(above) <= {"+2 dec", "+2"}, above
            assert set(chunks) <= set(long) or set(chunks) <= set(short), chunks
        legend = [t.get_text() for t in batch.get_legend().get_texts()]
        assert any("MIXED" in t for t in legend)
        render(fig)
    # draw_timelines keeps one legend, which explains '+n' when any of its runs has MIXED steps
    fig = draw_timelines([tiny_run, run], ["plain", "mixed"])
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1 and any("rode along" in t.get_text() for t in legends[0].get_texts())
    assert not any("rode along" in t.get_text() for t in draw_timeline(tiny_run).axes[0].get_legend().get_texts())


def test_timeline_cells_follow_the_step_records(tiny_run):
    cells = cells_frame(tiny_run)
    assert set(cells["phase"]) == {"queued", "prefill", "decode", "stalled"}
    for s in tiny_run.steps:  # exactly the batch's requests compute in a step
        computing = cells[(cells["step"] == s.step) & cells["phase"].isin(["prefill", "decode"])]
        assert sorted(computing["rid"]) == sorted(s.rids)
        assert computing["tokens"].sum() == s.num_tokens
    for rid, res in tiny_run.results.items():  # the prompt is computed, less what was cached
        prefill = cells[(cells["rid"] == rid) & (cells["phase"] == "prefill")]["tokens"].sum()
        meta = res["meta_info"]
        assert prefill >= meta["prompt_tokens"] - meta["cached_tokens"]
        decodes = (cells[(cells["rid"] == rid)]["phase"] == "decode").sum()
        # every finished prefill (the first, and one after each retraction) samples a token too
        assert decodes + 1 + meta["retractions"] == meta["completion_tokens"]
    frame = batch_frame(tiny_run)
    assert (frame["prefill_tokens"] + frame["decode_tokens"]).tolist() == [s.num_tokens for s in tiny_run.steps]


# ---- memory ---------------------------------------------------------------------------------------
def test_memory_categories_sum_to_the_pool_every_step(tiny_run):
    df = memory_frame(tiny_run)
    assert len(df) == len(tiny_run.steps)
    assert (df[list(CATEGORIES)].sum(axis=1) == df["total"]).all()
    assert df["evicted_tokens"].sum() == sum(e.num_tokens for e in tiny_run.tracer.tree_events if e.kind == "evict")
    assert any(df["retracted"].map(len))
    fig = draw_memory(tiny_run)
    layers = [c for c in fig.axes[0].collections if (c.get_gid() or "").startswith("mem-")]
    assert [c.get_gid() for c in layers] == [f"mem-{c}" for c in CATEGORIES]
    assert layers[-1].get_paths()[0].vertices[:, 1].max() == df["total"].iloc[0]  # the stack tops out at the pool
    render(fig)


# ---- request-to-token table and page pool ---------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
def test_req_to_token_view_marks_shared_slots(page_size, tiny):
    engine = Engine(enable_trace=True, max_total_tokens=256, page_size=page_size, **tiny)
    prefix = list(range(10, 30))
    params = {"max_new_tokens": 8, "ignore_eos": True}
    engine.add_request(input_ids=prefix + [40, 41], sampling_params=params, rid="a")
    engine.step()
    engine.add_request(input_ids=prefix + [50, 51, 52], sampling_params=params, rid="b")
    engine.add_request(input_ids=prefix + [60], sampling_params=params, rid="c")
    for _ in range(3):
        engine.step()
    snap = kv_snapshot(engine)
    table = req_to_token_table(snap)
    assert sorted(set(table["rid"])) == ["a", "b", "c"]
    for r in snap.requests:  # the table is the live req_to_token row
        row = engine.req_to_token_pool.req_to_token[r.req_pool_idx, : len(r.slots)].tolist()
        assert table[table["rid"] == r.rid]["slot"].tolist() == row
    shared = table[table["owner"] == "shared"]
    aligned = len(prefix) // page_size * page_size
    assert set(shared["position"]) == set(range(aligned))  # the common prefix, whole pages only
    assert (shared.groupby("position")["slot"].nunique() == 1).all()  # one slot for all readers
    fig = draw_kv_pool(snap)
    gids = [p.get_gid() or "" for p in fig.axes[0].patches]
    assert sum(g.startswith("shared-") for g in gids) == len(shared)
    pages = page_owners(snap)
    assert "unaccounted" not in set(pages["owner"])
    assert (pages["owner"] == "free").sum() * page_size == engine.allocator.available_size()
    assert (pages["owner"] == "shared").sum() == aligned // page_size
    render(fig)


# ---- why still waiting ----------------------------------------------------------------------------
def test_waiting_view_lists_the_blocked_requests_of_each_step(tiny_run):
    df = waiting_frame(tiny_run)
    cats = set()
    for s in tiny_run.steps:
        rows = df[df["step"] == s.step]
        assert set(s.blocked) <= set(rows["rid"])
        for rid, reason in s.blocked.items():
            assert rows[rows["rid"] == rid]["reason"].iloc[0] == reason
        snap = tiny_run.snapshot(s.step)
        assert {w.rid for w in snap.waiting} <= set(rows["rid"])
        cats |= set(rows["category"])
    assert {"running-request cap", "KV memory", "retracted this step"} <= cats
    assert "other" not in cats
    step = next(s.step for s in tiny_run.steps if len(s.blocked) >= 2)
    table = waiting_table(tiny_run, step)
    assert set(table["rid"]) >= set(tiny_run.step_record(step).blocked)
    fig = draw_waiting(tiny_run)
    bars = [p.get_gid() for p in fig.axes[0].patches if (p.get_gid() or "").startswith("wait-")]
    assert len(bars) == len(df)
    render(fig)


def test_run_of_requires_a_trace(tiny):
    with pytest.raises(ValueError):
        Run.of(Engine(max_total_tokens=64, **tiny))
