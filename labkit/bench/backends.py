"""Ways to run a benchmark's requests, each on the same arrival schedule and concurrency limit:
an OpenAI-compatible server over streaming HTTP (completions or chat), or labkit's in-process Engine.
Each returns one `RequestOutput` per request, in request order, and the run's duration. Both send a
conversation's turn only after its previous turn finished (`datasets.previous_turns`), so a turn never
starts before its arrival time nor before the reply it follows."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from labkit.bench.datasets import BenchRequest, chat_prompt_ids, previous_turns


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0  # completion tokens
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache; None: not reported
    start: float = 0.0  # when it was sent, seconds after the run began
    ttft: float = 0.0  # seconds to the first non-empty piece of text (engine: first token)
    itl: list[float] = field(default_factory=list)  # gaps between later chunks (engine: tokens)
    latency: float = 0.0  # end to end, seconds
    text: str = ""


def arrival_times(n: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send offsets (s) of a Poisson process of `request_rate` req/s, the first at 0; inf: all at 0."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


# ---- HTTP: OpenAI-compatible, or labkit's (SGLang's) native /generate ------------------------------
HTTP_APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}


@dataclass
class StreamSeen:
    """What one request's stream has told so far."""

    text: str = ""
    pieces: int = 0  # chunks that carried output
    tokens: int = 0  # output ids (generate)
    usage: dict[str, Any] = field(default_factory=dict)  # OpenAI's usage shape


@dataclass
class HttpTarget:
    base_url: str
    model: str
    api: str = "completions"  # a key of HTTP_APIS; generate sends token ids and reads token ids back
    tokenizer: Any = None  # renders chat prompts for completions/generate, decodes ids for chat, counts tokens
    api_key: str | None = None
    incremental: bool = False  # generate: each chunk holds only its new ids and text (else all so far)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + HTTP_APIS[self.api]

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def body(self, req: BenchRequest) -> dict[str, Any]:
        if self.api == "chat":  # token-id prompts go as their decoded text (the server re-tokenizes it)
            prompt: dict[str, Any] = {
                "messages": req.prompt
                if req.is_chat
                else [{"role": "user", "content": self._need_tokenizer().decode(req.prompt)}]
            }
        else:  # chat prompts go as the ids of their chat template, so prompt lengths stay exact
            ids = chat_prompt_ids(self._need_tokenizer(), req.prompt) if req.is_chat else req.prompt
            prompt = {"input_ids" if self.api == "generate" else "prompt": ids}
        if self.api == "generate":
            params = {"max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": req.ignore_eos}
            return {**prompt, "sampling_params": params, "stream": True}
        return {
            "model": self.model,
            **prompt,
            "max_tokens": req.output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": req.ignore_eos,
        }

    def advance(self, chunk: dict[str, Any], seen: StreamSeen) -> bool:
        """Fold one streamed chunk into `seen`; whether it carried new output."""
        if self.api == "generate":
            ids, meta, text = chunk.get("output_ids") or [], chunk.get("meta_info") or {}, chunk.get("text") or ""
            grew = bool(ids) if self.incremental else len(ids) > seen.tokens
            if self.incremental:
                seen.tokens, seen.text = seen.tokens + len(ids), seen.text + text
            else:
                seen.tokens, seen.text = len(ids), text
            seen.usage = {
                "prompt_tokens": meta.get("prompt_tokens"),
                "completion_tokens": meta.get("completion_tokens"),
                "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens")},
            }
        else:
            seen.usage = chunk.get("usage") or seen.usage
            piece = chunk_text(chunk, self.api == "chat")
            seen.text += piece
            grew = bool(piece)
        seen.pieces += grew
        return grew

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this prompt form needs a tokenizer (--tokenizer)")
        return self.tokenizer

    def count_tokens(self, text: str, pieces: int) -> int:
        if self.tokenizer is None:
            return pieces
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    """The text one streamed OpenAI chunk carries ("" for the final usage-only chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def bench_client() -> httpx.AsyncClient:
    """The benchmark's HTTP client: no timeout, and no cap on connections (the benchmark's own
    --max-concurrency is the only limit on requests in flight)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=None, limits=limits)


async def send_request(client: httpx.AsyncClient, target: HttpTarget, req: BenchRequest, t0: float) -> RequestOutput:
    """One streaming request; timings from the arrival of SSE lines. Any failure is recorded, not raised.
    The body (for chat prompts: template and tokenizer) is built before the clock starts."""
    out = RequestOutput(prompt_len=req.prompt_len)
    seen = StreamSeen()
    try:
        body = target.body(req)
        start = time.perf_counter()
        out.start = start - t0
        async with client.stream("POST", target.url, json=body, headers=target.headers) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}")
            done, last = False, start
            async for data in sse_data(resp):
                if data == b"[DONE]":
                    done = True
                    break
                chunk = decode_json(data)
                if chunk.get("error"):
                    raise RuntimeError(f"server error: {chunk['error']}")
                if target.advance(chunk, seen):
                    now = time.perf_counter()
                    if seen.pieces > 1:
                        out.itl.append(now - last)
                    else:
                        out.ttft = now - start
                    last = now
            if not done:
                raise RuntimeError("stream ended before data: [DONE]")
        out.latency = time.perf_counter() - start
        if not seen.pieces:
            out.ttft = out.latency
        out.text = seen.text
        out.prompt_len = seen.usage.get("prompt_tokens") or req.prompt_len
        out.output_len = seen.usage.get("completion_tokens") or target.count_tokens(out.text, seen.pieces)
        out.cached_tokens = (seen.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out.success = True
    except Exception as e:  # noqa: BLE001 - one bad request must not end the benchmark
        out.error = f"{type(e).__name__}: {e}"
    return out


async def sse_data(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The payloads of a streamed response's SSE `data:` lines as they arrive, stripped. Bytes, split by
    hand: at tens of thousands of chunks a second the client's own CPU time is part of what is measured."""
    rest = b""
    async for part in resp.aiter_bytes():
        *lines, rest = (rest + part).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):  # skip blank event separators, comments, other SSE fields
                yield line[5:].strip()
    if rest.startswith(b"data:"):
        yield rest[5:].strip()


def decode_json(data: bytes) -> Any:
    """msgspec's decoder (several times json's speed); json's for what it refuses (NaN, Infinity)."""
    try:
        return _JSON.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)


_JSON = msgspec.json.Decoder()


async def run_http(
    client: httpx.AsyncClient,
    target: HttpTarget,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_concurrency: int | None = None,
    on_done: Callable[[], None] | None = None,
) -> tuple[list[RequestOutput], float]:
    """Send each request at its arrival offset, once its previous turn finished (a conversation's turns
    are a chain), at most `max_concurrency` in flight; a turn waiting for its reply takes no slot."""
    _check_arrivals(requests, arrivals)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    previous = previous_turns(requests)
    finished = [asyncio.Event() for _ in requests]
    t0 = time.perf_counter()

    async def one(i: int, at: float) -> RequestOutput:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        if (p := previous[i]) is not None:
            await finished[p].wait()
        async with gate:
            out = await send_request(client, target, requests[i], t0)
        finished[i].set()
        if on_done is not None:
            on_done()
        return out

    outs = await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    return list(outs), time.perf_counter() - t0


async def first_model(client: httpx.AsyncClient, base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at GET /v1/models."""
    resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=auth_headers(api_key))
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def server_info(client: httpx.AsyncClient, target: HttpTarget) -> dict[str, Any]:
    """labkit's GET /get_server_info (the model's vocabulary size is under limits)."""
    resp = await client.get(target.base_url.rstrip("/") + "/get_server_info", headers=target.headers)
    resp.raise_for_status()
    return resp.json()


# ---- labkit's Engine, in process --------------------------------------------------------------
def engine_add(engine: Any, req: BenchRequest) -> str:
    params = {"max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": req.ignore_eos}
    prompt = {"messages": req.prompt} if req.is_chat else {"input_ids": req.prompt}
    return engine.add_request(**prompt, sampling_params=params)


def run_engine(
    engine: Any,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_concurrency: int | None = None,
    on_done: Callable[[], None] | None = None,
) -> tuple[list[RequestOutput], float]:
    """Drive `engine.step()` by hand. Between steps, admit the requests that are ready (arrival time
    passed, previous turn finished), in the order they became ready, while a concurrency slot is free;
    after each step, timestamp the tokens it produced."""
    _check_arrivals(requests, arrivals)
    outs = [RequestOutput(prompt_len=r.prompt_len) for r in requests]
    previous = previous_turns(requests)
    limit = max_concurrency or len(requests)
    ready: collections.deque[int] = collections.deque()  # request indices
    held: dict[int, list[int]] = collections.defaultdict(list)  # index -> arrived turns waiting for it
    done = [False] * len(requests)
    in_flight: dict[str, int] = {}  # rid -> request index
    last: dict[str, float] = {}  # rid -> perf_counter of its latest token
    nxt = 0  # the next request to arrive
    t0 = time.perf_counter()

    def finish(i: int) -> None:
        done[i] = True
        ready.extend(held.pop(i, []))
        if on_done is not None:
            on_done()

    while nxt < len(requests) or ready or in_flight:
        while nxt < len(requests) and t0 + arrivals[nxt] <= time.perf_counter():
            p = previous[nxt]
            (ready if p is None or done[p] else held[p]).append(nxt)
            nxt += 1
        while ready and len(in_flight) < limit:
            i = ready.popleft()
            outs[i].start = time.perf_counter() - t0
            try:
                in_flight[engine_add(engine, requests[i])] = i
            except ValueError as e:
                outs[i].error = f"ValueError: {e}"
                finish(i)
        if not in_flight:
            if nxt < len(requests):  # nothing ready either: every later request waits for an arrival
                time.sleep(max(0.0, t0 + arrivals[nxt] - time.perf_counter()))
            continue
        step = engine.step(count_pool=False)
        now = time.perf_counter()
        for rid in step.new_tokens:
            out = outs[in_flight[rid]]
            if rid in last:
                out.itl.append(now - last[rid])
            else:
                out.ttft = now - t0 - out.start
            last[rid] = now
        for rid in step.finished:
            i = in_flight.pop(rid)
            out = outs[i]
            result = engine.results.pop(rid)
            meta = result["meta_info"]
            out.latency = now - t0 - out.start
            out.prompt_len, out.output_len = meta["prompt_tokens"], meta["completion_tokens"]
            out.cached_tokens = meta["cached_tokens"]
            out.text = result["text"] or ""
            out.success = meta["finish_reason"]["type"] != "abort"
            if not out.success:
                out.error = f"aborted: {meta['finish_reason']}"
            if last.pop(rid, None) is None:
                out.ttft = out.latency
            finish(i)
    return outs, time.perf_counter() - t0


def _check_arrivals(requests: list[BenchRequest], arrivals: list[float]) -> None:
    if len(arrivals) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
