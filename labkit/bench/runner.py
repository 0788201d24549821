"""Play a workload (labkit.bench.datasets.Request) through a real Engine, one step at a time, and
measure it.

- `run_requests(engine, requests)` returns the recorded run (labkit.viz.Run), with arrivals at
  given steps, one at a time, or in static batches (`static_batch_size`) on the same engine;
- `request_metrics` and `summarize`: per-request and whole-run numbers from the Engine's results;
- `token_times` and `latency_table`: when each output token came, per request, from a recorded run.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pandas as pd

from labkit.bench.datasets import Request
from labkit.trace.recorder import Tracer
from labkit.viz.journey import is_token_event
from labkit.viz.run import Run

if TYPE_CHECKING:
    from labkit.engine import Engine


def add_request(engine: Engine, r: Request, **kwargs: Any) -> str:
    """Submit one workload request to the engine (keyword arguments go to Engine.add_request)."""
    return engine.add_request(
        r.prompt,
        input_ids=r.input_ids,
        messages=r.messages,
        sampling_params=dict(r.sampling_params),
        rid=r.rid,
        **kwargs,
    )


def run_requests(
    engine: Engine,
    requests: list[Request],
    *,
    static_batch_size: int | None = None,
    label: str = "",
    fresh: bool = True,
    sequential: bool = False,
    policy: str | None = None,
) -> Run:
    """Play `requests` through the real `engine`, one `engine.step()` at a time, until all finish.

    A request with arrive_step=k is added after the engine has run k steps (if the engine idles
    before that, the next arrival comes at once: idle steps record nothing); with `sequential` each
    request arrives when the previous one has finished (one at a time). With `fresh`, the run
    starts as on a new engine (Scheduler.reset: empty prefix cache, steps numbered from 1, under
    `policy` or the configured one), and its records are moved out of the engine's tracer into the
    returned Run, so the next run starts clean. Without `fresh`, `policy` (if given) switches the
    policy for this and later runs.

    static_batch_size=B emulates static batching on the same engine: all requests arrive at once
    (their queueing time counts), but they are held here and submitted B at a time, each group only
    when the previous one has completely finished; nothing joins a running batch.
    """
    sched = engine.scheduler
    if sched.has_work():
        raise RuntimeError("the engine still has requests in flight")
    if fresh:
        sched.reset(policy=policy)
        if engine.tracer is not None:
            engine.tracer.clear()
    elif policy is not None:
        sched.set_policy(policy)
    rids = [r.rid for r in requests]
    start = time.perf_counter()
    if static_batch_size:
        held = list(requests)
        while held or sched.has_work():
            if not sched.has_work():
                for r in held[:static_batch_size]:
                    add_request(engine, r, arrival_time=start)
                del held[:static_batch_size]
            engine.step()
    else:
        pending = list(requests) if sequential else sorted(requests, key=lambda r: r.arrive_step)
        steps = 0
        while pending or sched.has_work():
            while pending and (not sched.has_work() or (not sequential and pending[0].arrive_step <= steps)):
                add_request(engine, pending.pop(0))
            engine.step()
            steps += 1
    wall = time.perf_counter() - start
    results = {rid: engine.results.pop(rid) for rid in rids if rid in engine.results}
    if engine.tracer is None:
        tracer = Tracer(record_snapshots=False)
    else:
        tracer = engine.tracer.detach() if fresh else engine.tracer
    return Run(tracer, engine.tokenizer, label, results, engine.config, wall)


def request_metrics(run_or_results: Run | dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per finished request: prompt/completion/cached tokens, TTFT and end-to-end latency (s)."""
    results = run_or_results.results if isinstance(run_or_results, Run) else run_or_results
    metas = {rid: r["meta_info"] for rid, r in results.items()}
    rows = [
        {
            "rid": rid,
            "prompt_tokens": m["prompt_tokens"],
            "completion_tokens": m["completion_tokens"],
            "cached_tokens": m["cached_tokens"],
            "ttft_s": m["ttft"],
            "e2e_s": m["e2e_latency"],
            "retractions": m["retractions"],
        }
        for rid, m in metas.items()
    ]
    return pd.DataFrame(rows)


def summarize(results: dict[str, dict[str, Any]], wall_s: float, prefill_tokens: int | None = None) -> dict[str, Any]:
    """Throughput, cache hit rate, TTFT and end-to-end latency (mean and p90) of a run's results."""
    m = request_metrics(results)
    prompt, out = int(m["prompt_tokens"].sum()), int(m["completion_tokens"].sum())
    row = {
        "requests": len(m), "wall_s": wall_s, "output_tok_s": out / wall_s, "total_tok_s": (prompt + out) / wall_s,
        "cache_hit_rate": m["cached_tokens"].sum() / max(prompt, 1),
        "ttft_mean_s": m["ttft_s"].mean(), "ttft_p90_s": m["ttft_s"].quantile(0.9),
        "e2e_mean_s": m["e2e_s"].mean(), "e2e_p90_s": m["e2e_s"].quantile(0.9),
        "retractions": int(m["retractions"].sum()),
    }  # fmt: skip
    if prefill_tokens is not None:
        row["prefill_tokens"] = prefill_tokens
    return row


def token_times(run: Run) -> pd.DataFrame:
    """When each output token was ready (station 9, detokenize), per request: rid, index, t (s from
    the run's first record) and gap_ms since the request's previous token (NaN for the first)."""
    t0 = run.t0
    rows = [{"rid": e.rid, "t": e.end - t0} for e in run.tracer.events if is_token_event(e)]
    df = pd.DataFrame(rows, columns=["rid", "t"]).sort_values(["rid", "t"], kind="stable")
    df["index"] = df.groupby("rid").cumcount()
    df["gap_ms"] = df.groupby("rid")["t"].diff() * 1e3
    return df.reset_index(drop=True)[["rid", "index", "t", "gap_ms"]]


def latency_table(run: Run) -> pd.DataFrame:
    """Per request: prompt/completion/cached tokens, TTFT, end-to-end latency and the largest and
    mean gap between two of its output tokens (a decode stall shows as a large max gap)."""
    m = request_metrics(run).set_index("rid")
    gaps = token_times(run).groupby("rid")["gap_ms"].agg(["max", "mean"])
    m["max_gap_ms"], m["mean_gap_ms"] = gaps["max"], gaps["mean"]
    m["ttft_ms"], m["e2e_ms"] = m.pop("ttft_s") * 1e3, m.pop("e2e_s") * 1e3
    return m.loc[[r for r in run.rids if r in m.index]].round(1)
