"""Scheduling policies compared on one engine (benchmarks/test_bench_policies.py, notebook 05).

- `run_policy(engine, policy, requests)`: one cold-cache run under a policy, summarized;
- `bench_policies(engine, workloads, policies, repeats)`: every policy on every workload, each
  `repeats` times (round-robin), one row per run; `policy_summary(runs)`: per workload and policy,
  the token counts (the same in every repeat) beside the median, min and max of each timing;
- `queue_table(engine, requests)`: what a policy sees of `requests` queued now (cached prefix,
  tokens left to prefill, max_new_tokens); `policy_orders(engine, requests, policies)`: the order
  each policy would admit them in;
- `check_policy(cls)`: asserts that `cls` is a correct least-prefill-first policy (notebook 05's
  build-it exercise): the scheduler's contract and the order, on a real engine;
- `mini_model_path()`: a small random-weight Llama config (written to a temp file) whose forward is
  cheap on CPU but not free, for scheduling experiments where the generated text does not matter.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd

from labkit.bench.datasets import Request, random_ids
from labkit.bench.runner import add_request, run_requests, summarize
from labkit.mem_cache.base_prefix_cache import BasePrefixCache
from labkit.scheduler.schedule_batch import Req
from labkit.scheduler.schedule_policy import POLICIES, SchedulePolicy

if TYPE_CHECKING:
    from labkit.engine import Engine
    from labkit.scheduler.scheduler import Scheduler

MINI_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": 2048, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}  # fmt: skip

# What a run measures: the counts follow from the scheduling decisions alone (the same in every
# repeat), the timings from the clock (they vary from run to run).
COUNTS = ("requests", "prefill_tokens", "cache_hit_rate", "retractions", "forward_passes")
TIMINGS = ("wall_s", "output_tok_s", "total_tok_s", "ttft_mean_s", "ttft_p90_s", "e2e_mean_s", "e2e_p90_s")


def mini_model_path() -> str:
    """Path of a JSON config for MINI_LLAMA (use with load_format="dummy")."""
    path = Path(tempfile.gettempdir()) / "labkit-mini-llama.json"
    text = json.dumps(MINI_LLAMA)
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return str(path)


def run_policy(engine: Engine, policy: str, requests: list[Request], seed: int = 0) -> dict[str, Any]:
    """One run of `requests` (all arriving at once) under `policy` on `engine`, started as on a new
    engine (Scheduler.reset: cold cache). Returns summarize(...) plus the policy name, the prompt
    tokens actually computed (prefill_tokens) and the steps that ran a batch (forward_passes)."""
    sched = engine.scheduler
    sched.reset(policy=policy, seed=seed)
    prefill = forwards = 0
    start = time.perf_counter()
    for r in requests:
        add_request(engine, r)
    while sched.has_work():
        step = engine.step()
        forwards += bool(step.rids)
        if step.forward_mode == "EXTEND":  # (bench engines run without mixed chunking)
            prefill += sum(step.extend_lens)
    wall = time.perf_counter() - start
    results = {r.rid: engine.results.pop(r.rid) for r in requests}
    return {"policy": policy, **summarize(results, wall, prefill), "forward_passes": forwards}


def bench_policies(
    engine: Engine, workloads: dict[str, list[Request]], policies: list[str] | None = None, repeats: int = 1
) -> pd.DataFrame:
    """Every policy on every workload, each run from a cold cache, `repeats` times. The repeats go
    round-robin (every workload and policy once, then again), so a slow moment of the machine hits
    them all alike. Returns one row per run (workload, policy, repeat, then run_policy's numbers),
    sorted by workload and policy; policy_summary(...) condenses the repeats."""
    policies = policies or sorted(POLICIES)
    rows = [
        {"workload": wname, "repeat": rep, **run_policy(engine, p, reqs)}
        for rep in range(repeats)
        for wname, reqs in workloads.items()
        for p in policies
    ]
    w_at, p_at = {w: i for i, w in enumerate(workloads)}, {p: i for i, p in enumerate(policies)}
    rows.sort(key=lambda r: (w_at[r["workload"]], p_at[r["policy"]], r["repeat"]))
    return pd.DataFrame(rows)


def policy_summary(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, policy) of a bench_policies(...) table: `repeats`, the COUNTS (taken
    once: ValueError if they differ between repeats, since scheduling is deterministic), and per
    timing its median (under its own name) with the min and max of the repeats (`<name>_min`,
    `<name>_max`)."""
    rows = []
    for (workload, policy), g in runs.groupby(["workload", "policy"], sort=False):
        row: dict[str, Any] = {"workload": workload, "policy": policy, "repeats": len(g)}
        for col in COUNTS:
            values = g[col].unique()
            if len(values) != 1:
                raise ValueError(f"{workload}/{policy}: {col} differs between repeats: {sorted(values)}")
            row[col] = values[0]
        for col in TIMINGS:
            row[col], row[f"{col}_min"], row[f"{col}_max"] = g[col].median(), g[col].min(), g[col].max()
        rows.append(row)
    return pd.DataFrame(rows)


@contextmanager
def _queued(engine: Engine, requests: list[Request]) -> Iterator[Scheduler]:
    """`requests` in the engine's waiting queue for the duration, then aborted again (nothing runs;
    waiting requests hold no memory)."""
    sched = engine.scheduler
    if sched.has_work():
        raise RuntimeError("the engine still has requests in flight")
    rids = [add_request(engine, r) for r in requests]
    try:
        yield sched
    finally:
        for rid in rids:
            engine.abort(rid)
        engine.step()  # releases nothing but reports the aborts
        for rid in rids:
            engine.results.pop(rid, None)


def queue_table(engine: Engine, requests: list[Request]) -> pd.DataFrame:
    """`requests` as a policy would see them if they were queued now, in arrival order: each matched
    against the engine's radix cache as a step does (Req.init_next_round_input). Columns: rid, group
    (when the requests have one), prompt_tokens, cached (the matched prefix: lpm sorts by it),
    to_prefill (prompt minus cached), max_new_tokens (lof sorts by it)."""
    group = {r.rid: r.group for r in requests}
    with _queued(engine, requests) as sched:
        sched.waiting_order("fcfs")  # matches every waiting request, as a step would
        rows = [
            {
                "rid": req.rid,
                **({"group": group[req.rid]} if any(group.values()) else {}),
                "prompt_tokens": len(req.origin_input_ids),
                "cached": len(req.prefix_indices),
                "to_prefill": req.extend_input_len,
                "max_new_tokens": req.sampling_params.max_new_tokens,
            }
            for req in sched.waiting_queue
        ]
    return pd.DataFrame(rows).set_index("rid")


def policy_orders(engine: Engine, requests: list[Request], policies: list[str]) -> pd.DataFrame:
    """The order in which each policy would take `requests` from the waiting queue, given what the
    engine's prefix cache holds now (Scheduler.waiting_order). The requests are queued, ordered and
    aborted again; nothing runs. Returns one column per policy: the rids in order, each with its
    cached prefix length."""
    with _queued(engine, requests) as sched:
        cols = {
            name: [f"{req.rid} ({len(req.prefix_indices)})" for req in sched.waiting_order(name)] for name in policies
        }
    df = pd.DataFrame(cols)
    df.index.name = "position"
    return df


# ---- the build-it check of notebook 05 -------------------------------------------------------------
class _Watched(SchedulePolicy):
    """Runs `inner` (the policy under test) as the scheduler would, and asserts the contract of
    SchedulePolicy on every call: the same requests come back, and the cache is left as it was.
    Each call's order goes to `orders`."""

    inner_cls: ClassVar[type[SchedulePolicy]]
    orders: ClassVar[list[list[str]]]

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.inner = self.inner_cls(seed)

    def sort(self, waiting: list[Req], tree_cache: BasePrefixCache) -> None:
        before = Counter(map(id, waiting))
        cache = (tree_cache.evictable_size(), tree_cache.protected_size())
        self.inner.sort(waiting, tree_cache)
        assert Counter(map(id, waiting)) == before, (
            "sort must only reorder the waiting list in place: requests were dropped, added or duplicated"
        )
        assert (tree_cache.evictable_size(), tree_cache.protected_size()) == cache, "sort changed the cache"
        self.orders.append([r.rid for r in waiting])


def _check_scenario(vocab_size: int) -> tuple[list[Request], list[Request]]:
    """Two requests that put prefixes in the cache, then five queued ones whose least-prefill order
    differs from arrival order, from longest-prefix-first and from shortest-prompt-first, with a tie
    (check-b and check-e: 20 tokens each) that arrival order breaks."""
    rng = random.Random(5)
    x, y = random_ids(rng, 80, vocab_size), random_ids(rng, 60, vocab_size)
    params = {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0}
    # The warm prompts end in a token below FIRST_ID, which no queued prompt has at that position:
    # each queued match stops exactly at the end of x or y.
    warm = [Request(f"warm-{n}", input_ids=p + [3], sampling_params=params) for n, p in (("x", x), ("y", y))]
    prompts = {
        "check-a": random_ids(rng, 40, vocab_size),  # nothing cached: 40 to prefill
        "check-b": x + random_ids(rng, 20, vocab_size),  # 80 cached: 20 to prefill
        "check-c": random_ids(rng, 30, vocab_size),  # 30
        "check-d": y + random_ids(rng, 60, vocab_size),  # 60 cached: 60 to prefill
        "check-e": random_ids(rng, 20, vocab_size),  # 20, arrives after check-b
    }
    queued = [Request(rid, input_ids=ids, sampling_params=params) for rid, ids in prompts.items()]
    return warm, queued


def check_policy(cls: type[SchedulePolicy], engine: Engine | None = None) -> pd.DataFrame:
    """Assert that `cls` is a correct **least-prefill-first** policy: the waiting request with the
    fewest prompt tokens still to compute (prompt minus cached prefix) first, ties in arrival order.

    On `engine` (default: a new one on MINI_LLAMA; a failed check may leave an engine unusable), it
    puts two prefixes in the radix cache, queues five requests, and runs them to the end under
    `cls` (registered for the duration). It asserts the scheduler's contract at every sort (the
    same requests come back, the cache is untouched), that the first sort (over the warm cache)
    gave the least-prefill order, that every request finished, and that a second run makes the
    same decisions. Returns the queue: what each request had cached, its tokens to prefill, and its
    position in the expected and in `cls`'s order."""
    if engine is None:
        from labkit.engine import Engine  # at call time: importing this module does not load the engine

        engine = Engine(model_path=mini_model_path(), load_format="dummy", max_total_tokens=1024)
    name = f"check-{cls.__name__}"
    attrs = {"needs_prefix_match": cls.needs_prefix_match, "inner_cls": cls, "orders": []}
    watched: type[_Watched] = type(f"Watched{cls.__name__}", (_Watched,), attrs)
    warm, queued = _check_scenario(vocab_size=256)  # ids every test model has
    POLICIES[name] = watched
    try:
        runs = []
        for _ in range(2):  # the second run must repeat the first one's decisions
            watched.orders = []
            run_requests(engine, warm)  # fresh: an empty cache, then the two prefixes
            table = queue_table(engine, queued)
            engine.scheduler.set_policy(name)
            for r in queued:
                add_request(engine, r)
            while engine.scheduler.has_work():
                engine.step()
            results = {r.rid: engine.results.pop(r.rid, None) for r in queued}
            missing = [rid for rid, out in results.items() if out is None or out["meta_info"]["completion_tokens"] != 2]
            assert not missing, f"these requests did not finish their 2 tokens: {missing}"
            runs.append(list(watched.orders))
        engine.scheduler.reset()  # an empty cache and the configured policy again
    finally:
        del POLICIES[name]
    assert runs[0], "the policy never sorted the queue"
    expected = sorted(table.index, key=lambda rid: (table.loc[rid, "to_prefill"], list(table.index).index(rid)))
    got = runs[0][0]
    table["expected"] = [expected.index(rid) for rid in table.index]
    table["yours"] = [got.index(rid) if rid in got else -1 for rid in table.index]
    hint = (
        ""
        if cls.needs_prefix_match
        else "\n(the scheduler matches the waiting requests against the cache before sort only for a policy "
        "that sets needs_prefix_match = True: without it, prefix_indices and extend_input_len are not current)"
    )
    assert got == expected, (
        f"over the warm cache the order should be {expected} (fewest tokens to prefill first, ties in "
        f"arrival order), yours was {got}:\n{table.to_string()}{hint}"
    )
    assert runs[0] == runs[1], f"two runs from the same state sorted differently: {runs[0]} and {runs[1]}"
    print(f"{cls.__name__}: the contract holds in every sort, the order is least-prefill-first, every request finished")
    return table
