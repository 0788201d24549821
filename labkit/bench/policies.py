"""Scheduling policies compared on one engine (benchmarks/test_bench_policies.py, notebook 05).

- `run_policy(engine, policy, requests)`: one cold-cache run under a policy, summarized;
- `bench_policies(engine, workloads, policies)`: every policy on every workload, as a table;
- `policy_orders(engine, requests, policies)`: the order each policy would admit requests in;
- `mini_model_path()`: a small random-weight Llama config (written to a temp file) whose forward is
  cheap on CPU but not free, for scheduling experiments where the generated text does not matter.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from labkit.bench.datasets import Request
from labkit.bench.runner import add_request, summarize
from labkit.scheduler.schedule_policy import POLICIES

if TYPE_CHECKING:
    from labkit.engine import Engine

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


def run_policy(engine: Engine, policy: str, requests: list[Request], seed: int = 0) -> dict[str, Any]:
    """One run of `requests` (all arriving at once) under `policy` on `engine`, started as on a new
    engine (Scheduler.reset: cold cache). Returns summarize(...) plus the policy name and the prompt
    tokens actually computed."""
    sched = engine.scheduler
    sched.reset(policy=policy, seed=seed)
    prefill = 0
    start = time.perf_counter()
    for r in requests:
        add_request(engine, r)
    while sched.has_work():
        step = engine.step()
        if step.forward_mode == "EXTEND":  # (bench engines run without mixed chunking)
            prefill += sum(step.extend_lens)
    wall = time.perf_counter() - start
    results = {r.rid: engine.results.pop(r.rid) for r in requests}
    return {"policy": policy, **summarize(results, wall, prefill)}


def bench_policies(
    engine: Engine, workloads: dict[str, list[Request]], policies: list[str] | None = None, repeats: int = 1
) -> pd.DataFrame:
    """Every policy on every workload (cold cache each time); with repeats > 1 the best wall time of
    the repeats is kept (scheduling is deterministic, only the clock varies). Returns a table."""
    policies = policies or sorted(POLICIES)
    rows = []
    for wname, reqs in workloads.items():
        for p in policies:
            runs = [run_policy(engine, p, reqs) for _ in range(repeats)]
            best = min(runs, key=lambda r: r["wall_s"])
            rows.append({"workload": wname, **best})
    return pd.DataFrame(rows)


def policy_orders(engine: Engine, requests: list[Request], policies: list[str]) -> pd.DataFrame:
    """The order in which each policy would take `requests` from the waiting queue, given what the
    engine's prefix cache holds now (Scheduler.waiting_order). The requests are queued, ordered and
    aborted again; nothing runs. Returns one column per policy: the rids in order, each with its
    cached prefix length."""
    sched = engine.scheduler
    if sched.has_work():
        raise RuntimeError("the engine still has requests in flight")
    rids = [add_request(engine, r) for r in requests]
    try:
        cols = {
            name: [f"{req.rid} ({len(req.prefix_indices)})" for req in sched.waiting_order(name)] for name in policies
        }
    finally:
        for rid in rids:
            engine.abort(rid)
        engine.step()  # releases nothing (waiting requests hold no memory) but reports the aborts
        for rid in rids:
            engine.results.pop(rid, None)
    df = pd.DataFrame(cols)
    df.index.name = "position"
    return df
