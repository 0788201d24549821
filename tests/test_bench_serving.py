"""The serving benchmark client: datasets, metrics math, SSE streaming and timing against a mock server,
the arrival schedule, the concurrency limit, conversations sent turn after turn, the prefix cache hit
rate, and the engine backend and CLI on a tiny random-weight model."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import statistics

import httpx
import pytest

from labkit.bench import datasets, serving
from labkit.bench.backends import (
    HttpTarget,
    RequestOutput,
    arrival_times,
    decode_json,
    first_model,
    run_engine,
    run_http,
    sse_data,
)
from labkit.bench.datasets import BenchRequest
from labkit.config import EngineConfig


class WordTokenizer:
    """Stand-in tokenizer: one token per whitespace-separated word, a trivial chat template."""

    chat_template = "<role> content ... <assistant>"  # what apply_chat_template renders

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}> {m['content']} " for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [len(w) for w in text.split()]}

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


# ---- datasets ------------------------------------------------------------------------------
def test_random_requests_have_exact_lengths_and_are_seeded():
    reqs = datasets.random_requests(20, 32, 8, 1.0, vocab_size=300, seed=3)
    assert all(len(r.prompt) == r.prompt_len == 32 and r.output_len == 8 and r.ignore_eos for r in reqs)
    assert all(datasets.FIRST_ID <= t < 300 for r in reqs for t in r.prompt)
    assert reqs == datasets.random_requests(20, 32, 8, 1.0, vocab_size=300, seed=3)
    assert reqs != datasets.random_requests(20, 32, 8, 1.0, vocab_size=300, seed=4)
    ranged = datasets.random_requests(50, 32, 8, 0.5, vocab_size=300, seed=3)
    assert all(16 <= len(r.prompt) == r.prompt_len <= 32 and 4 <= r.output_len <= 8 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 5
    with pytest.raises(ValueError):
        datasets.random_requests(1, 8, 8, 1.0, vocab_size=50)


def test_shared_prefix_groups_share_their_system_prompt():
    reqs = datasets.shared_prefix_requests(3, 4, 20, 5, 7, vocab_size=1000, seed=0)
    assert len(reqs) == 12 and all(r.prompt_len == len(r.prompt) == 25 and r.output_len == 7 for r in reqs)
    groups = collections.Counter(tuple(r.prompt[:20]) for r in reqs)
    assert sorted(groups.values()) == [4, 4, 4]
    assert len({tuple(r.prompt[20:]) for r in reqs}) == 12
    assert len({tuple(r.prompt[:20]) for r in reqs[:4]}) > 1  # shuffled: groups interleave


def test_multiturn_file_loads_and_later_turns_extend_earlier_ones():
    convs = datasets.load_conversations()
    assert len(convs) >= 18 and all(2 <= len(c) <= 4 for c in convs)
    assert all(t["user"].strip() and t["assistant"].strip() for c in convs for t in c)
    reqs = datasets.multiturn_requests(WordTokenizer(), max_tokens=32)
    assert len(reqs) == sum(map(len, convs))
    assert all(r.is_chat and r.output_len == 32 and not r.ignore_eos for r in reqs)
    n_turns = [len(r.prompt) // 2 + 1 for r in reqs]
    assert n_turns == sorted(n_turns)  # round by round
    by_first = collections.defaultdict(list)
    for r in reqs:
        by_first[r.prompt[0]["content"]].append(r)
    for turns, conv in zip(by_first.values(), convs):
        for k, (prev, cur) in enumerate(zip(turns, turns[1:])):
            assert cur.prompt[: len(prev.prompt)] == prev.prompt
            assert cur.prompt[len(prev.prompt)] == {"role": "assistant", "content": conv[k]["assistant"]}
            assert cur.prompt_len > prev.prompt_len
    assert len(datasets.multiturn_requests(WordTokenizer(), 32, num_prompts=5)) == 5


# ---- metrics -------------------------------------------------------------------------------
def test_metrics_match_hand_computed_values():
    outs = [
        RequestOutput(True, prompt_len=10, output_len=5, ttft=0.1, itl=[0.05, 0.05, 0.1, 0.1], latency=0.4),
        RequestOutput(True, prompt_len=20, output_len=1, ttft=0.2, latency=0.2),
        RequestOutput(False, error="boom", prompt_len=30),
    ]
    m = serving.compute_metrics(outs, duration=2.0)
    assert (m.completed, m.failed, m.total_input_tokens, m.total_output_tokens) == (2, 1, 30, 6)
    assert (m.request_throughput, m.input_throughput, m.output_throughput, m.total_throughput) == (1, 15, 3, 18)
    approx = lambda s: pytest.approx((s.mean, s.median, s.p99))  # noqa: E731 (a local shorthand)
    assert approx(m.ttft_ms) == (150, 150, 100 + 0.99 * 100)
    assert approx(m.tpot_ms) == (75, 75, 75)  # (0.4 - 0.1) / 4; the 1-token request is left out
    assert approx(m.itl_ms) == (75, 75, 100)
    assert approx(m.e2e_ms) == (300, 300, 200 + 0.99 * 200)
    assert serving.Stats.of_ms([]) == serving.Stats(0.0, 0.0, 0.0)
    table = serving.format_metrics(m, "t")
    assert "Failed requests:" in table and "199.00" in table and "75.00" in table
    assert m.total_cached_tokens is None and m.cache_hit_rate is None  # nothing reported it
    assert "Prefix cache hit rate:" in table and "n/a" in table


def test_cache_hit_rate_is_cached_over_prompt_tokens_of_the_completed_requests_that_report_it():
    outs = [
        RequestOutput(True, prompt_len=100, output_len=1, cached_tokens=60),
        RequestOutput(True, prompt_len=50, output_len=1, cached_tokens=0),
        RequestOutput(True, prompt_len=70, output_len=1),  # a server that does not send the count
        RequestOutput(False, error="boom", prompt_len=30, cached_tokens=30),
    ]
    m = serving.compute_metrics(outs, duration=1.0)
    assert m.total_cached_tokens == 60 and m.cache_hit_rate == pytest.approx(60 / 150)
    assert m.total_input_tokens == 220  # every completed request still counts towards throughput
    assert "0.400" in serving.format_metrics(m, "t")


# ---- HTTP: SSE streaming against a mock server ---------------------------------------------
GAP = 0.03


def sse_app(chat: bool, usage: bool = True, seen: list | None = None, state: dict | None = None):
    """A mock OpenAI server streaming real SSE bytes: 3 text pieces GAP apart, a usage chunk, [DONE]."""

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if seen is not None:
            seen.append((request.url.path, body))
        if state is not None:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])

        def event(text: str | None) -> bytes:
            if chat:
                choice = {"index": 0, "delta": {"role": "assistant"} if text is None else {"content": text}}
            else:
                choice = {"index": 0, "text": text or ""}
            return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()

        async def stream():
            yield event(None)  # a role-only / empty chunk: must not count as the first token
            for i, piece in enumerate(["Hel", "lo", " world"]):
                await asyncio.sleep(GAP)
                data = event(piece)
                if i == 1:  # one event split across network reads
                    yield data[:7]
                    data = data[7:]
                yield data
            if usage:
                final = {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 99,
                        "completion_tokens": body["max_tokens"],
                        "prompt_tokens_details": {"cached_tokens": 42},
                    },
                }
                yield f"data: {json.dumps(final)}\n\n".encode()
            if state is not None:
                state["now"] -= 1
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def run_mock(transport, reqs, chat=False, arrivals=None, max_concurrency=None, tokenizer=None, api=None):
    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
            target = HttpTarget("http://mock", "m", api or ("chat" if chat else "completions"), tokenizer)
            return await run_http(client, target, reqs, arrivals or [0.0] * len(reqs), max_concurrency)

    return asyncio.run(go())


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_request_is_parsed_and_timed(chat):
    seen: list = []
    req = BenchRequest([{"role": "user", "content": "hi"}] if chat else [101, 102, 103], 3, 4)
    (out,), duration = run_mock(sse_app(chat, seen=seen), [req], chat=chat)
    assert out.success, out.error
    assert out.text == "Hello world" and (out.prompt_len, out.output_len, out.cached_tokens) == (99, 4, 42)
    assert out.ttft >= GAP and len(out.itl) == 2 and all(gap >= GAP * 0.8 for gap in out.itl)
    assert out.latency >= out.ttft + sum(out.itl) and duration >= out.latency
    path, body = seen[0]
    assert path == ("/v1/chat/completions" if chat else "/v1/completions")
    assert body["messages" if chat else "prompt"] == req.prompt
    assert {k: body[k] for k in ("model", "max_tokens", "temperature", "stream", "ignore_eos")} == {
        "model": "m",
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    assert body["stream_options"] == {"include_usage": True}


def test_without_usage_tokens_are_counted_and_prompt_forms_are_converted():
    req = BenchRequest([101, 102], 2, 4)
    (out,), _ = run_mock(sse_app(False, usage=False), [req])
    assert out.success and (out.prompt_len, out.output_len) == (2, 3)  # no tokenizer: one per piece
    assert out.cached_tokens is None
    (out,), _ = run_mock(sse_app(False, usage=False), [req], tokenizer=WordTokenizer())
    assert out.output_len == 2  # "Hello world": two words
    target = HttpTarget("http://x", "m", "chat", WordTokenizer())
    assert target.body(req)["messages"] == [{"role": "user", "content": "w101 w102"}]
    chat_req = BenchRequest([{"role": "user", "content": "a bc"}], 5, 4, ignore_eos=False)
    body = HttpTarget("http://x", "m", "completions", WordTokenizer()).body(chat_req)
    assert body["prompt"] == [6, 1, 2, 11] and body["ignore_eos"] is False


def test_sse_payloads_are_the_same_wherever_the_stream_is_cut():
    raw = b': comment\r\ndata: {"a": 1}\r\n\r\nevent: x\ndata:{"b": NaN}\n\ndata: [DONE]'

    async def payloads(cut: int) -> list[bytes]:
        async def parts():
            yield raw[:cut]
            yield raw[cut:]

        resp = httpx.Response(200, content=parts())
        return [p async for p in sse_data(resp)]

    for cut in range(len(raw) + 1):
        assert asyncio.run(payloads(cut)) == [b'{"a": 1}', b'{"b": NaN}', b"[DONE]"], cut
    assert decode_json(b'{"a": [1, "x"]}') == {"a": [1, "x"]}
    assert math.isnan(decode_json(b'{"b": NaN}')["b"])  # msgspec refuses NaN; json reads it


def test_failed_requests_are_recorded_not_dropped():
    def handler(request: httpx.Request) -> httpx.Response:
        kind = json.loads(request.content)["prompt"][0]
        if kind == 1:
            return httpx.Response(500, json={"error": {"message": "bad"}})
        if kind == 2:
            return httpx.Response(200, content=b'data: {"error": {"message": "oom"}}\n\n')
        if kind == 3:
            return httpx.Response(200, content=b'data: {"choices": [{"text": "x"}]}\n\n')  # no [DONE]
        raise httpx.ConnectError("refused")

    reqs = [BenchRequest([k], 1, 2) for k in (1, 2, 3, 4)]
    outs, duration = run_mock(httpx.MockTransport(handler), reqs)
    assert not any(o.success for o in outs)
    assert [
        "HTTP 500" in outs[0].error,
        "oom" in outs[1].error,
        "[DONE]" in outs[2].error,
        "ConnectError" in outs[3].error,
    ] == [True] * 4
    assert serving.compute_metrics(outs, duration).failed == 4


def test_first_model_asks_v1_models():
    transport = httpx.MockTransport(lambda r: httpx.Response(200, json={"data": [{"id": "smol"}, {"id": "b"}]}))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await first_model(client, "http://mock/")

    assert asyncio.run(go()) == "smol"


# ---- schedule and concurrency --------------------------------------------------------------
def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    times = arrival_times(20000, 50.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential: sd = mean
    assert times == arrival_times(20000, 50.0, seed=1) != arrival_times(20000, 50.0, seed=2)
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def peak_overlap(outs: list[RequestOutput]) -> int:
    events = sorted([(o.start + o.latency, -1) for o in outs] + [(o.start, 1) for o in outs])
    level, peak = 0, 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def test_http_respects_max_concurrency_and_arrival_times():
    state = {"now": 0, "peak": 0}
    reqs = [BenchRequest([100 + i], 1, 3) for i in range(9)]
    outs, _ = run_mock(sse_app(False, state=state), reqs, max_concurrency=3)
    assert all(o.success for o in outs) and state["peak"] == 3 and peak_overlap(outs) <= 3
    arrivals = [0.0, 0.05, 0.15]
    outs, _ = run_mock(sse_app(False), reqs[:3], arrivals=arrivals)
    assert all(o.start >= a for o, a in zip(outs, arrivals))


def assert_turns_follow_their_replies(reqs: list[BenchRequest], outs: list[RequestOutput]) -> None:
    """Each later turn was sent only after the previous turn of its conversation finished."""
    start = {(r.conversation, r.turn): o.start for r, o in zip(reqs, outs)}
    end = {(r.conversation, r.turn): o.start + o.latency for r, o in zip(reqs, outs)}
    later = [key for key in start if key[1] > 0]
    assert later and all(start[c, k] >= end[c, k - 1] for c, k in later)


def test_http_sends_a_turn_only_after_the_reply_to_the_one_before():
    state = {"now": 0, "peak": 0}
    reqs = datasets.multiturn_random_requests(4, 3, 8, 2, 2, 3, vocab_size=300)
    outs, duration = run_mock(sse_app(False, state=state), reqs)  # no concurrency limit
    assert all(o.success for o in outs)
    assert_turns_follow_their_replies(reqs, outs)
    assert state["peak"] == 4  # every conversation in flight at once, one turn each
    assert duration >= 3 * 3 * GAP  # three turns, one after the other


# ---- the engine backend and the CLI, on a tiny random-weight model --------------------------
@pytest.fixture(scope="module")
def tiny_engine():
    from labkit import Engine

    return Engine(model_path="tiny-llama", load_format="dummy", max_total_tokens=2048)


def test_engine_backend_times_every_token_within_limits(tiny_engine):
    reqs = datasets.random_requests(6, 16, 5, 1.0, tiny_engine.model_runner.vocab_size, seed=0)
    done = []
    outs, duration = run_engine(tiny_engine, reqs, [0.0] * 6, max_concurrency=2, on_done=lambda: done.append(1))
    assert len(done) == 6 and all(o.success for o in outs)
    assert all(o.prompt_len == 16 and o.output_len == 5 and len(o.itl) == 4 for o in outs)
    assert all(0 < o.ttft <= o.latency and o.latency >= o.ttft + sum(o.itl) * 0.99 for o in outs)
    assert peak_overlap(outs) == 2 and duration >= max(o.start + o.latency for o in outs)
    arrivals = [0.0, 0.05, 0.1]
    outs, _ = run_engine(tiny_engine, reqs[:3], arrivals)
    assert all(o.success and o.start >= a for o, a in zip(outs, arrivals))
    assert not tiny_engine.scheduler.has_work() and not tiny_engine.results


def test_engine_backend_sends_turns_in_order_and_reports_their_cache_hits(tiny_engine):
    tiny_engine.flush_cache()
    reqs = datasets.multiturn_random_requests(6, 3, 24, 4, 4, 3, tiny_engine.model_runner.vocab_size)
    outs, duration = run_engine(tiny_engine, reqs, [0.0] * len(reqs))  # no concurrency limit
    assert all(o.success for o in outs)
    assert_turns_follow_their_replies(reqs, outs)
    # the pool holds every history: each later turn finds the whole prompt of the one before cached
    prompt = {(r.conversation, r.turn): r.prompt_len for r in reqs}
    assert all(o.cached_tokens >= prompt[r.conversation, r.turn - 1] for r, o in zip(reqs, outs) if r.turn)
    m = serving.compute_metrics(outs, duration)
    assert m.total_cached_tokens == sum(o.cached_tokens for o in outs)
    assert m.cache_hit_rate == m.total_cached_tokens / m.total_input_tokens >= 0.5
    # a pool far smaller than the 6 histories (6 x 44 tokens) loses them between turns
    from labkit import Engine

    small = Engine(model_path="tiny-llama", load_format="dummy", max_total_tokens=140)
    small_outs, small_duration = run_engine(small, reqs, [0.0] * len(reqs), max_concurrency=2)
    assert all(o.success for o in small_outs)
    assert_turns_follow_their_replies(reqs, small_outs)
    small_rate = serving.compute_metrics(small_outs, small_duration).cache_hit_rate
    assert small_rate is not None and 0.0 <= small_rate < m.cache_hit_rate


def test_engine_options_are_engine_config_fields_with_their_help():
    by_dest = {a.dest: a for a in serving.build_parser()._actions}
    for f in dataclasses.fields(EngineConfig):
        if f.name != "enable_trace":  # a benchmark runs untraced
            assert by_dest[f.name].help == f.metadata["help"], f.name
    assert "enable_trace" not in by_dest
    assert serving.engine_config(serving.parse_args([])) == EngineConfig()  # every default is the config's
    hicache = [
        "--enable-hierarchical-cache",
        "--hicache-size",
        "2.5",
        "--hicache-write-policy",
        "write_through",
        "--hicache-storage-dir",
        "/tmp/kv",
        "--hicache-storage-block",
        "128",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--mem-fraction-static",
        "0.8",
        "--kv-memory-gb",
        "0.5",
    ]
    config = serving.engine_config(serving.parse_args(hicache))
    assert config == EngineConfig(
        enable_hierarchical_cache=True,
        hicache_size=2.5,
        hicache_write_policy="write_through",
        hicache_storage_dir="/tmp/kv",
        hicache_storage_block=128,
        kv_cache_dtype="fp8_e4m3",
        mem_fraction_static=0.8,
        kv_memory_gb=0.5,
    )
    for bad in (["--hicache-write-policy", "write_sometimes"], ["--kv-cache-dtype", "int3"], ["--tp-size", "x"]):
        with pytest.raises(SystemExit):
            serving.parse_args(bad)


def test_cli_engine_backend_appends_json_lines(tmp_path, capsys):
    path = tmp_path / "out.jsonl"
    common = [
        "--backend",
        "engine",
        "--model-path",
        "tiny-llama",
        "--load-format",
        "dummy",
        "--max-total-tokens",
        "1024",
        "--disable-tqdm",
        "--output-file",
        str(path),
        "--max-concurrency",
        "2",
    ]
    serving.main(common + ["--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "3"])
    serving.main(
        common
        + [
            "--dataset",
            "shared-prefix",
            "--gsp-num-groups",
            "2",
            "--gsp-prompts-per-group",
            "2",
            "--gsp-system-prompt-len",
            "8",
            "--gsp-question-len",
            "4",
            "--gsp-output-len",
            "2",
            "--request-rate",
            "100",
        ]
    )
    mt = ["--mt-num-conversations", "3", "--mt-turns", "2", "--mt-system-len", "16", "--mt-user-len", "4"]
    serving.main(common + ["--dataset", "multiturn-random", *mt, "--mt-assistant-len", "4", "--mt-output-len", "2"])
    first, second, third = [json.loads(line) for line in path.read_text().splitlines()]
    assert first["metrics"]["completed"] == 4 and first["metrics"]["total_output_tokens"] == 12
    assert first["args"]["backend"] == "engine" and first["args"]["request_rate"] == "inf"
    assert second["metrics"]["completed"] == 4 and second["metrics"]["total_input_tokens"] == 48
    m = third["metrics"]
    assert (m["completed"], m["total_input_tokens"], m["total_output_tokens"]) == (6, 3 * 20 + 3 * 28, 12)
    # the second turns find the first turns' prompts cached (the warm-up's cache was flushed)
    assert 3 * 20 <= m["total_cached_tokens"] < m["total_input_tokens"]
    assert m["cache_hit_rate"] == m["total_cached_tokens"] / m["total_input_tokens"]
    printed = capsys.readouterr().out
    assert printed.count("Mean TTFT (ms):") == 3 and "engine / shared-prefix / rate 100.0" in printed
    assert printed.count("Prefix cache hit rate:") == 3
