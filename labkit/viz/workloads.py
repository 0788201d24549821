"""Workloads and run helpers shared by the notebooks and benchmarks/test_bench_policies.py.

- `Request` and generators: `shared_prefix_workload` and `random_workload` (token ids, for any model,
  including random-weight ones) and `chat_requests` (chat messages, for the embedded model).
- `run_requests(engine, requests)` plays requests through a real Engine step by step (arrivals at
  given steps) and returns the recorded `Run`; `static_batch_size=B` emulates static batching with
  the same engine (see `run_requests`).
- `bench_policies(...)` runs one workload under several scheduling policies on one engine and
  returns a pandas table of throughput, cache hit rate, TTFT and end-to-end latency.
- `mini_model_path()`: a small random-weight Llama config (written to a temp file) whose forward is
  cheap on CPU but not free, for scheduling experiments where the generated text does not matter.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from labkit.trace.recorder import Tracer
from labkit.viz.run import Run

MINI_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}  # fmt: skip


def mini_model_path() -> str:
    """Path of a JSON config for MINI_LLAMA (use with load_format="dummy")."""
    path = Path(tempfile.gettempdir()) / "labkit-mini-llama.json"
    text = json.dumps(MINI_LLAMA)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return str(path)


@dataclass
class Request:
    """One request of a workload. Exactly one of input_ids / messages / prompt."""

    rid: str
    input_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    arrive_step: int = 0  # engine steps run before it arrives (0: before the first)
    group: str | None = None  # e.g. which shared prefix it uses


def shared_prefix_workload(
    num_groups: int = 6,
    per_group: int = 4,
    prefix_len: int = 256,
    question_len: int = 16,
    output_len: tuple[int, int] = (8, 24),
    vocab_size: int = 2048,
    interleave: bool = True,
    seed: int = 0,
) -> list[Request]:
    """Groups of requests that share a long prefix (a system prompt, few-shot examples, a document)
    and differ in a short question. `interleave` sends them round-robin over the groups (g0, g1, ...,
    g0, g1, ...), the arrival order in which first-come-first-served keeps losing its prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab_size) for _ in range(prefix_len)] for _ in range(num_groups)]
    reqs = []
    for g in range(num_groups):
        for q in range(per_group):
            ids = prefixes[g] + [rng.randrange(3, vocab_size) for _ in range(question_len)]
            reqs.append(
                Request(f"g{g}-q{q}", input_ids=ids, group=f"g{g}", sampling_params=_length_params(rng, output_len))
            )
    if interleave:
        reqs.sort(key=lambda r: (int(r.rid.split("-q")[1]), r.rid))
    return reqs


def random_workload(
    num: int = 24,
    input_len: tuple[int, int] = (32, 384),
    output_len: tuple[int, int] = (8, 24),
    vocab_size: int = 2048,
    seed: int = 0,
) -> list[Request]:
    """Independent requests with random tokens (nothing to share) and random lengths."""
    rng = random.Random(seed)
    return [
        Request(
            f"r{i}",
            input_ids=[rng.randrange(3, vocab_size) for _ in range(rng.randint(*input_len))],
            sampling_params=_length_params(rng, output_len),
        )
        for i in range(num)
    ]


def _length_params(rng: random.Random, output_len: tuple[int, int]) -> dict[str, Any]:
    # ignore_eos: the output length is the workload's, not the (random) model's choice
    return {"temperature": 0, "max_new_tokens": rng.randint(*output_len), "ignore_eos": True}


def chat_requests(
    system_prompts: list[str], questions: list[str], max_new_tokens: int = 16, prefix: str = "req"
) -> list[Request]:
    """One chat request per (system prompt, question), system prompts round-robin over questions."""
    out = []
    for i, q in enumerate(questions):
        system = system_prompts[i % len(system_prompts)]
        out.append(
            Request(
                f"{prefix}-{i}",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens},
                group=f"system-{i % len(system_prompts)}",
            )
        )
    return out


# ---- running ---------------------------------------------------------------------------------------
def _add(engine, r: Request) -> str:
    return engine.add_request(
        r.prompt, input_ids=r.input_ids, messages=r.messages, sampling_params=dict(r.sampling_params), rid=r.rid
    )


def reset_scheduler(engine) -> None:
    """Start the next run as a fresh engine would: empty prefix cache, the scheduler's new-token
    ratio at its initial value (it decays during a run and would change admissions otherwise)."""
    from labkit.scheduler.scheduler import INIT_NEW_TOKEN_RATIO

    engine.flush_cache()
    engine.scheduler.new_token_ratio = INIT_NEW_TOKEN_RATIO * engine.config.schedule_conservativeness


def _detach(tracer: Tracer | None) -> Tracer | None:
    """A copy of the tracer's records; the engine's tracer is emptied for the next run."""
    if tracer is None:
        return None
    copy = Tracer(tracer.max_tokens, tracer.record_snapshots)
    copy.events, copy.steps = list(tracer.events), list(tracer.steps)
    copy.tree_events, copy.snapshots = list(tracer.tree_events), list(tracer.snapshots)
    tracer.clear()
    return copy


def run_requests(
    engine,
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
    starts from an empty prefix cache (reset_scheduler) and numbers its steps from 1, and its
    records are moved out of the engine's tracer into the returned Run, so the next run starts clean.

    static_batch_size=B emulates static batching on the same engine: all requests arrive at once
    (their queueing time counts), but they are held outside the scheduler and released B at a time,
    each group only when the previous one has completely finished; nothing joins a running batch.
    `policy` switches the engine's scheduling policy (by its registered name) before the run.
    """
    sched = engine.scheduler
    if sched.has_work():
        raise RuntimeError("the engine still has requests in flight")
    if policy is not None:
        from labkit.scheduler.schedule_policy import make_policy

        sched.policy = make_policy(policy, engine.config.random_seed)
    if fresh:
        reset_scheduler(engine)
        sched.step_id = 0
        if engine.tracer is not None:
            engine.tracer.clear()
    rids = [r.rid for r in requests]
    start = time.perf_counter()
    if static_batch_size:
        for r in requests:
            _add(engine, r)
        held = list(sched.waiting_queue)
        sched.waiting_queue.clear()
        while held or sched.has_work():
            if not sched.has_work():
                sched.waiting_queue.extend(held[:static_batch_size])
                del held[:static_batch_size]
            engine.step()
    else:
        pending = list(requests) if sequential else sorted(requests, key=lambda r: r.arrive_step)
        steps = 0
        while pending or sched.has_work():
            while pending and (not sched.has_work() or (not sequential and pending[0].arrive_step <= steps)):
                _add(engine, pending.pop(0))
            engine.step()
            steps += 1
    wall = time.perf_counter() - start
    results = {rid: engine.results.pop(rid) for rid in rids if rid in engine.results}
    tracer = (_detach(engine.tracer) if fresh else engine.tracer) or Tracer(record_snapshots=False)
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


def run_policy(engine, policy: str, requests: list[Request], seed: int = 0) -> dict[str, Any]:
    """One run of `requests` (all arriving at once) under `policy` on `engine`, from a cold cache
    (reset_scheduler).
    Returns summarize(...) plus the policy name and the prompt tokens actually computed."""
    from labkit.scheduler.schedule_policy import make_policy

    sched = engine.scheduler
    if sched.has_work():
        raise RuntimeError("the engine still has requests in flight")
    reset_scheduler(engine)
    sched.policy = make_policy(policy, seed)
    prefill = 0
    start = time.perf_counter()
    for r in requests:
        _add(engine, r)
    while sched.has_work():
        step = engine.step()
        if step.forward_mode == "EXTEND":  # (bench engines run without mixed chunking)
            prefill += sum(step.extend_lens)
    wall = time.perf_counter() - start
    results = {r.rid: engine.results.pop(r.rid) for r in requests}
    return {"policy": policy, **summarize(results, wall, prefill)}


def bench_policies(
    engine, workloads: dict[str, list[Request]], policies: list[str] | None = None, repeats: int = 1
) -> pd.DataFrame:
    """Every policy on every workload (cold cache each time); with repeats > 1 the best wall time of
    the repeats is kept (scheduling is deterministic, only the clock varies). Returns a table."""
    from labkit.scheduler.schedule_policy import POLICIES

    policies = policies or sorted(POLICIES)
    rows = []
    for wname, reqs in workloads.items():
        for p in policies:
            runs = [run_policy(engine, p, reqs) for _ in range(repeats)]
            best = min(runs, key=lambda r: r["wall_s"])
            rows.append({"workload": wname, **best})
    return pd.DataFrame(rows)


def token_times(run: Run) -> pd.DataFrame:
    """When each output token was ready (station 9, detokenize), per request: rid, index, t (s from
    the run's first record) and gap_ms since the request's previous token (NaN for the first)."""
    from labkit.viz.journey import is_token_event

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


def policy_orders(engine, requests: list[Request], policies: list[str]) -> pd.DataFrame:
    """The order in which each policy would take `requests` from the waiting queue, given what the
    engine's radix cache holds now. The requests are queued, matched against the cache (as the
    scheduler does before sorting), sorted by each policy, and aborted again; nothing runs. Returns
    one column per policy (the rids in order) and the cached prefix length of each position's rid."""
    from labkit.scheduler.schedule_policy import make_policy

    sched = engine.scheduler
    if sched.has_work():
        raise RuntimeError("the engine still has requests in flight")
    for r in requests:
        _add(engine, r)
    queue = list(sched.waiting_queue)
    try:
        for req in queue:
            req.init_next_round_input(engine.tree_cache)
        cached = {req.rid: len(req.prefix_indices) for req in queue}
        cols = {}
        for name in policies:
            order = list(queue)
            make_policy(name, engine.config.random_seed).sort(order, engine.tree_cache)
            cols[name] = [f"{r.rid} ({cached[r.rid]})" for r in order]
    finally:
        for req in queue:
            engine.abort(req.rid)
        engine.step()  # releases nothing (waiting requests hold no memory) but reports the aborts
        for req in queue:
            engine.results.pop(req.rid, None)
    df = pd.DataFrame(cols)
    df.index.name = "position"
    return df
