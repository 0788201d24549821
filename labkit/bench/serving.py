"""Online serving benchmark: TTFT, TPOT, ITL, end-to-end latency and throughput under a request load.

    python -m labkit.bench.serving [--backend openai|openai-chat|generate|engine] [--base-url http://127.0.0.1:30000]
        [--dataset random|shared-prefix|multiturn|multiturn-random] [--num-prompts 100] [--request-rate inf]
        [--max-concurrency N] [--output-file results.jsonl] ...

openai and openai-chat stream from any OpenAI-compatible server (/v1/completions, /v1/chat/completions);
generate streams token ids in and out of labkit's (SGLang's) native /generate, for servers without a
tokenizer (--skip-tokenizer-init) and to leave detokenizing out of the measurement;
engine runs the same requests through labkit's in-process Engine, stepped by hand, as a baseline with no
server in between (it takes every EngineConfig option, the hierarchical cache's included). Arrivals are a
seeded Poisson process (--request-rate; inf sends all at once), with at most --max-concurrency requests in
flight. Random, shared-prefix and multiturn-random prompts are token ids with exact lengths and EOS
ignored; multiturn prompts are chat messages from data/multiturn_chat.json, capped by
--multiturn-max-tokens. multiturn-random is --mt-num-conversations chats of --mt-turns turns, each turn
sent only once the previous turn of its chat finished, all chats concurrent up to --max-concurrency.
The prefix cache hit rate is cached prompt tokens / prompt tokens (HTTP: the server's
usage.prompt_tokens_details.cached_tokens). --output-file appends one JSON object (args, metrics,
errors) per run as a line."""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from labkit.bench import datasets
from labkit.bench.backends import (
    HttpTarget,
    RequestOutput,
    arrival_times,
    bench_client,
    first_model,
    run_engine,
    run_http,
    server_info,
)
from labkit.bench.client_processes import run_http_processes
from labkit.config import HICACHE_WRITE_POLICIES, KV_CACHE_DTYPES, EngineConfig, add_field_options
from labkit.scheduler.schedule_policy import POLICIES


@dataclass
class Stats:
    mean: float
    median: float
    p99: float

    @classmethod
    def of_ms(cls, seconds: list[float]) -> Stats:
        """Mean, median and p99 (linear interpolation) in milliseconds; zeros when there is no sample."""
        if not seconds:
            return cls(0.0, 0.0, 0.0)
        ms = np.asarray(seconds) * 1e3
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


@dataclass
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int  # of completed requests
    total_output_tokens: int
    total_cached_tokens: int | None  # prompt tokens served from the prefix cache; None: not reported
    cache_hit_rate: float | None  # cached / prompt tokens, of the completed requests that report it
    request_throughput: float  # completed requests / s
    input_throughput: float  # tokens / s
    output_throughput: float
    total_throughput: float
    ttft_ms: Stats
    tpot_ms: Stats  # (e2e - ttft) / (completion tokens - 1), requests with more than one token
    itl_ms: Stats  # every gap between consecutive chunks, all requests pooled
    e2e_ms: Stats


def compute_metrics(outputs: list[RequestOutput], duration: float) -> BenchMetrics:
    done = [o for o in outputs if o.success]
    n_in = sum(o.prompt_len for o in done)
    n_out = sum(o.output_len for o in done)
    reported = [o for o in done if o.cached_tokens is not None]
    n_cached = sum(o.cached_tokens or 0 for o in reported) if reported else None
    n_in_reported = sum(o.prompt_len for o in reported)
    return BenchMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        duration_s=duration,
        total_input_tokens=n_in,
        total_output_tokens=n_out,
        total_cached_tokens=n_cached,
        cache_hit_rate=n_cached / n_in_reported if n_cached is not None and n_in_reported else None,
        request_throughput=len(done) / duration,
        input_throughput=n_in / duration,
        output_throughput=n_out / duration,
        total_throughput=(n_in + n_out) / duration,
        ttft_ms=Stats.of_ms([o.ttft for o in done]),
        tpot_ms=Stats.of_ms([(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1]),
        itl_ms=Stats.of_ms([gap for o in done for gap in o.itl]),
        e2e_ms=Stats.of_ms([o.latency for o in done]),
    )


def format_metrics(m: BenchMetrics, title: str) -> str:
    rows = [
        ("Completed requests", m.completed),
        ("Failed requests", m.failed),
        ("Duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", m.total_input_tokens),
        ("Total output tokens", m.total_output_tokens),
        ("Total cached tokens", "n/a" if m.total_cached_tokens is None else m.total_cached_tokens),
        ("Prefix cache hit rate", "n/a" if m.cache_hit_rate is None else f"{m.cache_hit_rate:.3f}"),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
        ("Input token throughput (tok/s)", f"{m.input_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{m.total_throughput:.2f}"),
    ]
    for name, s in (("TTFT", m.ttft_ms), ("TPOT", m.tpot_ms), ("ITL", m.itl_ms), ("E2E latency", m.e2e_ms)):
        rows += [(f"{stat} {name} (ms)", f"{getattr(s, stat.lower()):.2f}") for stat in ("Mean", "Median", "P99")]
    return "\n".join([f" {title} ".center(52, "="), *(f"{k + ':':<40}{v:>12}" for k, v in rows), "=" * 52])


def build_requests(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> list[datasets.BenchRequest]:
    if args.dataset == "random":
        return datasets.random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            vocab_size,
            args.seed,
        )
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_requests(
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
            vocab_size,
            args.seed,
        )
    if args.dataset == "multiturn-random":
        return datasets.multiturn_random_requests(
            args.mt_num_conversations,
            args.mt_turns,
            args.mt_system_len,
            args.mt_user_len,
            args.mt_assistant_len,
            args.mt_output_len,
            vocab_size,
            args.seed,
        )
    return datasets.multiturn_requests(tokenizer, args.multiturn_max_tokens, args.num_prompts, args.multiturn_file)


def progress(args: argparse.Namespace, total: int) -> tqdm:
    return tqdm(total=total, disable=args.disable_tqdm, desc="requests")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine backend's config: the EngineConfig fields parse_args adds under their own names."""
    return EngineConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    )


def bench_engine(args: argparse.Namespace) -> tuple[list[RequestOutput], float]:
    from labkit import Engine

    engine = Engine(engine_config(args))
    requests = build_requests(args, engine.tokenizer, engine.model_runner.vocab_size)
    if args.warmup_requests:
        warm, _ = run_engine(engine, requests[:1] * args.warmup_requests, [0.0] * args.warmup_requests)
        _check_warmup(warm)
        engine.flush_cache()  # the warm-up prompt must not give the first real request a cache hit
    with progress(args, len(requests)) as bar:
        return run_engine(
            engine,
            requests,
            arrival_times(len(requests), args.request_rate, args.seed),
            args.max_concurrency,
            lambda: bar.update(1),
        )


HTTP_BACKENDS = {"openai": "completions", "openai-chat": "chat", "generate": "generate"}  # backend -> HttpTarget.api


async def bench_http(args: argparse.Namespace) -> tuple[list[RequestOutput], float]:
    from labkit.model_loader.loader import load_tokenizer

    api = HTTP_BACKENDS[args.backend]
    if args.client_processes < 1:
        raise SystemExit(f"--client-processes must be >= 1, got {args.client_processes}")
    # generate sends token ids: a tokenizer only renders chat prompts, and the ids span the model's vocabulary
    tokenizer = load_tokenizer(args.tokenizer) if api != "generate" or args.tokenizer else None
    if tokenizer is None and api != "generate":
        raise SystemExit(f"no tokenizer in {args.tokenizer}")
    async with bench_client() as client:
        target = HttpTarget(args.base_url, args.model or "", api, tokenizer, args.api_key)
        if api == "generate":
            info = await server_info(client, target)
            vocab_size = info["limits"]["vocab_size"]
            target.incremental = bool(info["server_args"].get("incremental_streaming_output"))
        else:
            vocab_size = len(tokenizer)
            target.model = args.model or await first_model(client, args.base_url, args.api_key)
        requests = build_requests(args, tokenizer, vocab_size)
        if args.warmup_requests:
            n = args.warmup_requests
            warm, _ = await run_http(client, target, requests[:1] * n, [0.0] * n)
            _check_warmup(warm)
        if args.flush_cache:
            (await client.post(args.base_url.rstrip("/") + "/flush_cache", headers=target.headers)).raise_for_status()
        arrivals = arrival_times(len(requests), args.request_rate, args.seed)
        if args.client_processes > 1:
            return await asyncio.to_thread(
                run_http_processes, target, requests, arrivals, args.max_concurrency, args.client_processes
            )
        with progress(args, len(requests)) as bar:
            return await run_http(client, target, requests, arrivals, args.max_concurrency, lambda: bar.update(1))


def _check_warmup(outputs: list[RequestOutput]) -> None:
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise SystemExit(f"warm-up request failed: {failed[0]}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    add = ap.add_argument
    add(
        "--backend",
        choices=[*HTTP_BACKENDS, "engine"],
        default="openai",
        help="/v1/completions, /v1/chat/completions, /generate with token ids (needs no tokenizer: "
        "for a server started with --skip-tokenizer-init), or labkit's in-process Engine",
    )
    add("--base-url", default="http://127.0.0.1:30000", help="server root (HTTP backends)")
    add("--model", help="model name to send; None: the first of GET /v1/models")
    add("--api-key", help="sent as a Bearer token")
    add(
        "--tokenizer",
        help="HF directory to build and count prompts with (HTTP backends); "
        "None: the embedded SmolLM2's. The engine backend uses the engine's",
    )
    add("--flush-cache", action="store_true", help="POST /flush_cache after the warm-up (HTTP backends)")
    add(
        "--dataset",
        choices=["random", "shared-prefix", "multiturn", "multiturn-random"],
        default="random",
        help="workload",
    )
    add(
        "--num-prompts",
        type=int,
        default=100,
        help="random: requests; multiturn: at most this many (not used by shared-prefix, multiturn-random)",
    )
    add("--random-input-len", type=int, default=256, help="prompt tokens")
    add("--random-output-len", type=int, default=64, help="output tokens (EOS ignored)")
    add("--random-range-ratio", type=float, default=1.0, help="lengths uniform in [ratio*len, len]; 1: exact")
    add("--gsp-num-groups", type=int, default=8, help="shared-prefix: groups (one system prompt each)")
    add("--gsp-prompts-per-group", type=int, default=8, help="shared-prefix: questions per group")
    add("--gsp-system-prompt-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    add("--gsp-question-len", type=int, default=64, help="shared-prefix: question tokens")
    add("--gsp-output-len", type=int, default=64, help="shared-prefix: output tokens (EOS ignored)")
    add("--multiturn-file", default=str(datasets.MULTITURN_FILE), help="multiturn conversations")
    add("--multiturn-max-tokens", type=int, default=64, help="multiturn: max_tokens cap (EOS honoured)")
    add("--mt-num-conversations", type=int, default=16, help="multiturn-random: conversations")
    add("--mt-turns", type=int, default=4, help="multiturn-random: user turns per conversation")
    add("--mt-system-len", type=int, default=512, help="multiturn-random: system prompt tokens, per conversation")
    add("--mt-user-len", type=int, default=32, help="multiturn-random: tokens each user turn adds")
    add("--mt-assistant-len", type=int, default=32, help="multiturn-random: tokens of each recorded reply")
    add("--mt-output-len", type=int, default=16, help="multiturn-random: output tokens (EOS ignored)")
    add("--request-rate", type=float, default=float("inf"), help="Poisson arrivals, req/s; inf: all at once")
    add("--max-concurrency", type=int, help="at most this many requests in flight; None: no limit")
    add(
        "--client-processes",
        type=int,
        default=1,
        help="HTTP backends: send the requests from this many processes (a conversation's turns from one), "
        "each with its share of --max-concurrency: one Python client cannot parse tens of thousands of "
        "chunks a second",
    )
    add("--seed", type=int, default=0, help="seeds the datasets and the arrival times")
    add("--warmup-requests", type=int, default=1, help="copies of the first request sent first, not measured")
    add("--output-file", help="append the result (args, metrics, errors) to this file as one JSON line")
    add("--disable-tqdm", action="store_true", help="no progress bar")
    _add_engine_options(ap.add_argument_group("engine backend (fields of labkit.config.EngineConfig)"))
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


_HIDDEN_ENGINE_FIELDS = {"enable_trace"}  # a benchmark measures the engine untraced


def _add_engine_options(group: argparse._ArgumentGroup) -> None:
    """One option per EngineConfig field, its help the field's `help` metadata, as the server's. The
    policy names are read now (a policy registered before counts); the Engine checks the other names
    (backends, drafters) as it starts."""
    choices = {
        "schedule_policy": sorted(POLICIES),
        "kv_cache_dtype": list(KV_CACHE_DTYPES),
        "hicache_write_policy": list(HICACHE_WRITE_POLICIES),
    }
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in _HIDDEN_ENGINE_FIELDS]
    add_field_options(group, fields, choices)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    outputs, duration = bench_engine(args) if args.backend == "engine" else asyncio.run(bench_http(args))
    metrics = compute_metrics(outputs, duration)
    title = f"{args.backend} / {args.dataset} / rate {args.request_rate} / concurrency {args.max_concurrency}"
    print(format_metrics(metrics, title))
    errors = collections.Counter(o.error for o in outputs if not o.success)
    for error, count in errors.most_common(5):
        print(f"{count} x {error}")
    # inf (the default request rate) as a string: the line stays strict JSON
    settings = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in vars(args).items()}
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "args": settings,
        "metrics": dataclasses.asdict(metrics),
        "errors": dict(errors),
    }
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
