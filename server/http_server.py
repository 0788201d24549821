"""The FastAPI app (stations 1 and 10): OpenAI-compatible and native endpoints over the
TokenizerManager, API-key check, and errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from labkit.io_struct import GenerateReqInput
from labkit.server.body_limit import BodySizeLimitMiddleware
from labkit.server.errors import APIError, install_error_handlers, server_unavailable
from labkit.server.metrics import ServerMetrics
from labkit.server.openai_api import Choice, OpenAIServing, finish_fields, sse, submit_or_raise, trace_http
from labkit.server.protocol import AbortRequest, ChatCompletionRequest, CompletionRequest, GenerateRequest
from labkit.server.server_args import ServerArgs
from labkit.server.tokenizer_manager import ServerDeadError, TokenizerManager

T = TypeVar("T")
HEALTH_TIMEOUT_S = 20.0
HEALTH_FRESH_S = 5.0  # a request that finished this recently proves the generation path alive


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would wrap streaming bodies): stamps the receive
    time (station 1) and checks the API key on every path but /health."""

    def __init__(self, app, api_key: str | None):
        self.app, self.key = app, api_key.encode() if api_key else None

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Exactly one Authorization header (two would be ambiguous), `Bearer <key>` with the scheme
        in any case (RFC 7235)."""
        if self.key is None:
            return True
        given = [value for name, value in headers if name == b"authorization"]
        if len(given) != 1:
            return False
        scheme, _, token = given[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {})["received"] = time.perf_counter()
            if scope["path"] != "/health" and not self.authorized(scope["headers"]):
                await APIError(
                    401,
                    "invalid or missing API key (one header: Authorization: Bearer <key>)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                ).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AppRuntime(Protocol):
    """What the app serves with: launch.ServerRuntime in the server, inprocess.InProcessServer in a notebook."""

    args: ServerArgs
    tm: TokenizerManager | None  # None until the scheduler is up
    ready: bool
    model_name: str
    created: int  # unix time, reported by /v1/models

    async def run(self) -> None:
        """Started as a task by the app's lifespan (start-up) and cancelled at shutdown."""


def create_app(runtime: AppRuntime) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        task = asyncio.create_task(runtime.run())
        yield
        task.cancel()

    app = FastAPI(title="labkit", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(APIKeyMiddleware, api_key=runtime.args.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=runtime.args.max_request_bytes)  # outermost

    def tm() -> TokenizerManager:
        if runtime.tm is None or not runtime.ready:
            raise APIError(503, "the server is starting", code="server_starting")
        if runtime.tm.dead:
            raise server_unavailable(runtime.tm.dead)
        return runtime.tm

    def openai() -> OpenAIServing:
        return OpenAIServing(tm(), runtime.model_name)

    async def generation_ok(manager: TokenizerManager) -> Response:
        if await manager.generate_one_token(HEALTH_TIMEOUT_S):
            return Response(status_code=200)
        raise APIError(503, "the generation path did not answer", code="server_unavailable")

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what many load balancers probe with
    async def health() -> Response:
        manager = tm()
        if time.perf_counter() - manager.last_finish_time < HEALTH_FRESH_S:
            return Response(status_code=200)
        return await generation_ok(manager)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return await generation_ok(tm())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": runtime.model_name,
                        "object": "model",
                        "created": runtime.created,
                        "owned_by": "labkit",
                        "max_model_len": tm().limits.context_len,
                    }
                ],
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        raw.state.handler_entered = time.perf_counter()
        return await openai().chat(req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        raw.state.handler_entered = time.perf_counter()
        return await openai().completion(req, raw)

    @app.post("/generate")
    async def generate(req: GenerateRequest, raw: Request) -> Response:
        raw.state.handler_entered = time.perf_counter()
        manager = tm()
        parsed = time.perf_counter()
        [state] = await submit_or_raise(
            manager,
            [
                GenerateReqInput(
                    text=req.text, input_ids=req.input_ids, sampling_params=req.labkit_sampling_params(), rid=req.rid
                )
            ],
        )
        trace_http(manager, raw, [state.rid], parsed)
        choice = Choice(0, 0, state)

        def body(shown: Choice) -> dict:
            """`shown`'s text, ids and logprobs (the whole choice's, or one streamed chunk's); the counts
            are always the whole choice's."""
            return {
                "text": shown.text if manager.tokenizer is not None else None,  # no tokenizer, no text
                "output_ids": shown.token_ids,
                "meta_info": {
                    "id": state.rid,
                    "prompt_tokens": state.prompt_tokens,
                    "completion_tokens": len(choice.token_ids),
                    "cached_tokens": choice.cached_tokens,
                    **choice.spec.meta_info(),
                    **finish_fields(choice.finish),
                    "e2e_latency": time.perf_counter() - state.created,
                    **native_logprobs(shown),
                },
            }

        if req.stream:
            incremental = runtime.args.incremental_streaming_output

            async def events():
                try:
                    async for out in manager.stream(state):
                        choice.add(out)
                        shown = choice
                        if incremental:
                            shown = Choice(0, 0, state)
                            shown.add(out)
                        yield sse(body(shown))
                except ServerDeadError as e:
                    yield sse(server_unavailable(e).body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        try:
            async for out in manager.stream(state, raw.is_disconnected):
                choice.add(out)
        except ServerDeadError as e:
            raise server_unavailable(e) from None
        return JSONResponse(body(choice)) if choice.finish is not None else Response(status_code=499)

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        manager = tm()
        info = await _answer(manager.control("get_info"))
        workers = await _answer(manager.all_stats())
        return JSONResponse(
            {
                "server_args": runtime.args.to_dict(),
                "model": runtime.model_name,
                **manager.info,
                **info.data,
                "in_flight": sum(w["in_flight"] for w in workers),
                "dp_routed_requests": [sum(counts) for counts in zip(*(w["dp_routed_requests"] for w in workers))],
                "tokenizer_worker": manager.worker,  # the one that answered
                "tokenizer_workers": [
                    {key: w[key] for key in ("worker", "pid", "in_flight")}
                    | {"requests_total": w["metrics"]["counters"]["requests_total"]}
                    for w in sorted(workers, key=lambda w: w["worker"])
                ],
            }
        )

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> JSONResponse:
        out = await _answer(tm().control("flush_cache"))
        if not out.ok:
            raise APIError(400, out.message, code="requests_running")
        return JSONResponse({"message": "cache flushed"})

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> JSONResponse:
        """Abort a request by its rid, or every choice of an OpenAI response by the response id;
        answers with the rids the scheduler aborted."""
        return JSONResponse({"aborted": await _answer(tm().abort(req.rid))})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        if not runtime.args.enable_metrics:
            raise APIError(404, "metrics are off; start the server with --enable-metrics")
        manager = tm()
        data = (await _answer(manager.control("get_info"))).data
        totals = ServerMetrics.total([w["metrics"] for w in await _answer(manager.all_stats())])
        m = totals.counters
        gauges = {
            "num_running_reqs": ("Requests in the running batch", data["running"]),
            "num_queued_reqs": ("Requests in the waiting queue", data["waiting"]),
            "token_usage": ("Share of KV slots held by requests", data["token_usage"]),
            "cache_hit_rate": (
                "Cached prompt tokens / prompt tokens, since start",
                m["cached_tokens_total"] / max(m["prompt_tokens_total"], 1),
            ),
            "spec_accept_rate": (
                "Speculative decoding: accepted draft tokens / draft tokens, since start",
                m["spec_accepted_tokens_total"] / max(m["spec_draft_tokens_total"], 1),
            ),
        }
        return PlainTextResponse(totals.render(gauges), media_type="text/plain; version=0.0.4")

    return app


async def _answer(question: Awaitable[T]) -> T:
    """The answer of the scheduler or the other tokenizer workers; a 503 if they do not give one."""
    try:
        return await question
    except (ServerDeadError, asyncio.TimeoutError) as e:
        raise APIError(503, f"the server did not answer: {e or 'timeout'}", code="server_unavailable") from None


def native_logprobs(choice: Choice) -> dict[str, Any]:
    """SGLang's /generate logprob fields, when they were asked for: per output token (logprob,
    token id, None) and its top alternatives in the same shape (the None is SGLang's token text,
    which it only fills with return_text_in_logprobs); with logprob_start_len, the prompt tokens' too
    (the prompt's first token has a None logprob and None alternatives)."""
    if not choice.logprobs and not choice.prompt_logprobs:
        return {}
    out: dict[str, Any] = {
        "output_token_logprobs": [[lp, tok, None] for tok, lp, _ in choice.logprobs],
        "output_top_logprobs": [[[lp, t, None] for t, lp in (top or [])] for _, _, top in choice.logprobs],
    }
    if choice.prompt_logprobs:
        out["input_token_logprobs"] = [[lp, tok, None] for tok, lp, _ in choice.prompt_logprobs]
        out["input_top_logprobs"] = [
            None if top is None else [[lp, t, None] for t, lp in top] for _, _, top in choice.prompt_logprobs
        ]
    return out
