"""Visualizers drawn from recorded runs (an Engine(enable_trace=True) and its Tracer), never from a
separate simulation. Figures are matplotlib Figures (returned, not shown: a notebook displays the
value of a cell), tables are pandas DataFrames.

    run = Run.of(engine)                       # or labkit.bench.runner.run_requests(engine, requests)
    draw_radix_tree(run, step=5)               # the tree as step 5 left it (engine alone: live now)
    draw_timeline(run); draw_memory(run); draw_waiting(run)
    draw_journey(run, rid); journey_latency(run, rid)    # one request's ten stations, TTFT, per-token times
    draw_kv_pool(kv_snapshot(engine))          # request-to-token table and page pool, live
    draw_stations_by_process(from_perfetto("trace.json"))   # a server trace: stations by process
    draw_rank_timeline(run)                    # tensor parallelism: every rank's steps, time in collectives
    draw_expert_load(run, layer=0); expert_load(run); load_imbalance(run)   # MoE: tokens per expert per step
    spec_frame(run); draw_drafts(run, rid)     # speculative decoding: drafts against the target, token by token
    draw_accept_lengths(run); draw_accept_histogram(run); draw_spec_kv(run)   # accepted drafts, KV rollback
    step_costs(run); draw_step_costs(step_costs(run))                     # station 6: what a step costs (03)
    draw_policy_orders(orders, groups); draw_memories([run_a, run_b])      # scheduling policies (notebook 05)
    draw_split_kv(split_partials(q, k, v, 4, scale), out); draw_paged_addressing(...)   # kernels (07)
    draw_graph_steps(r); draw_decode_roofline(r); draw_fused_kernels(r)   # r = load_gpu_results(): GPU recordings
    draw_distributions(logits, settings, tok); draw_penalties(...)       # station 8: filters and penalties (12)
    with record_forwards(engine) as fw: engine.step()                     # packed batches (13): fw[-1] is the step
    draw_packed_batch(fw[-1]); draw_req_to_token(fw[-1]); draw_attention_mask(fw[-1])
    draw_overlap_timeline({"off": e1, "on": e2}); step_phases(run)       # overlap scheduling: host vs device (14)
    draw_token_bytes(tok, {"label": ids}); draw_decode_cost(frame)        # detokenization: split characters (15)
    draw_tiers(run); tier_frame(run)   # hierarchical cache: device and host pools per step, copies between (16)
    StationStepper(run, rid).show(); RunReplayer(run).show()   # ipywidgets, static fallback

How the tree is rebuilt per step: the scheduler's trace hook records a compact TreeSnapshot (nodes
with lock refs) at the end of every step (labkit.trace.snapshot); the step's TreeEvents mark what was
inserted, split or evicted in it.
"""

from labkit.viz.batching import draw_step_costs, step_costs
from labkit.viz.detokenize import draw_decode_cost, draw_token_bytes
from labkit.viz.journey import draw_journey, journey_latency
from labkit.viz.kernels import (
    draw_decode_roofline,
    draw_fused_kernels,
    draw_graph_steps,
    draw_paged_addressing,
    draw_split_kv,
    load_gpu_results,
    split_partials,
)
from labkit.viz.kvpool import (
    describe_request,
    draw_kv_pool,
    fragmentation,
    kv_snapshot,
    page_owners,
    req_to_token_table,
)
from labkit.viz.memory import draw_memory, memory_frame
from labkit.viz.moe import draw_expert_load, expert_load, load_imbalance
from labkit.viz.overlap import draw_overlap_timeline, step_phases
from labkit.viz.packed import record_forwards
from labkit.viz.packed_figures import draw_attention_mask, draw_packed_batch, draw_req_to_token
from labkit.viz.policies import draw_memories, draw_policy_comparison, draw_policy_orders
from labkit.viz.processes import draw_stations_by_process
from labkit.viz.ranks import draw_rank_timeline, rank_steps
from labkit.viz.run import Run
from labkit.viz.sampling import draw_distributions, draw_penalties
from labkit.viz.speculative import (
    draft_runs,
    draw_accept_histogram,
    draw_accept_lengths,
    draw_drafts,
    draw_spec_kv,
    spec_frame,
)
from labkit.viz.tiers import draw_tiers, tier_frame
from labkit.viz.timeline import batch_frame, cells_frame, draw_timeline, draw_timelines
from labkit.viz.tree import draw_radix_tree
from labkit.viz.waiting import draw_waiting, waiting_frame, waiting_table
from labkit.viz.widgets import RunReplayer, StationStepper, display_width, fig_png, widget_frontend


def _register_png_formatter() -> None:
    """Make a returned Figure display as a PNG in IPython even without `%matplotlib inline` (the
    figures here are not pyplot figures, so pyplot's inline hook never sees them)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    from matplotlib.figure import Figure

    png = shell.display_formatter.formatters["image/png"]
    try:
        png.lookup_by_type(Figure)
    except KeyError:
        png.for_type(Figure, _figure_png)


def _figure_png(fig) -> tuple[bytes, dict[str, int]]:
    """The figure's PNG and the width to show it at (sharp, not larger: see style.PIXEL_DENSITY)."""
    data = fig_png(fig)
    return data, {"width": display_width(data)}


_register_png_formatter()

__all__ = [
    "Run", "RunReplayer", "StationStepper", "batch_frame", "cells_frame", "describe_request", "draft_runs",
    "draw_accept_histogram", "draw_accept_lengths", "draw_drafts", "draw_expert_load", "draw_journey",
    "draw_kv_pool", "draw_memory", "draw_policy_comparison", "draw_radix_tree", "draw_rank_timeline",
    "draw_spec_kv", "draw_stations_by_process", "draw_timeline", "draw_timelines", "draw_waiting",
    "expert_load", "fragmentation", "journey_latency", "kv_snapshot", "load_imbalance", "memory_frame",
    "page_owners", "rank_steps", "req_to_token_table", "spec_frame", "waiting_frame", "waiting_table",
    "widget_frontend", "draw_decode_cost", "draw_token_bytes", "draw_decode_roofline", "draw_fused_kernels",
    "draw_graph_steps", "draw_paged_addressing", "draw_split_kv", "load_gpu_results", "split_partials",
    "draw_overlap_timeline", "step_phases", "draw_attention_mask", "draw_packed_batch", "draw_req_to_token",
    "record_forwards", "draw_step_costs", "step_costs", "draw_memories", "draw_policy_orders", "draw_distributions",
    "draw_penalties", "draw_tiers", "tier_frame",
]  # fmt: skip
