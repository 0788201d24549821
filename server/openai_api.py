"""The OpenAI-compatible endpoints' logic (stations 2 and 10): requests -> GenerateReqInputs ->
TokenizerManager -> OpenAI JSON, whole or as Server-Sent Events."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from labkit.io_struct import GenerateReqInput, ReqOutput
from labkit.server.errors import APIError, server_unavailable
from labkit.server.protocol import ChatCompletionRequest, CompletionRequest
from labkit.server.tokenizer_manager import QueueFullError, ReqState, ServerDeadError, TokenizerManager
from labkit.server.tool_calls import ToolOutput, chat_prompt
from labkit.speculative.verify import SpecState
from labkit.trace.events import Station

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
# JSON has no -inf: a token a grammar rules out (log 0) is written as this (vLLM's convention), so the
# answer stays valid JSON and a number where OpenAI's schema wants one.
LOGPROB_FLOOR = -9999.0


def _json_logprob(lp: float) -> float:
    return lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares false: floored too


def _json_tops(top: list[tuple[int, float]] | None) -> list[tuple[int, float]] | None:
    return None if top is None else [(t, _json_logprob(lp)) for t, lp in top]


@dataclass
class Choice:
    """One choice's accumulated result (non-streaming) and bookkeeping."""

    index: int
    prompt_index: int
    state: ReqState
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list[tuple[int, float]] | None]] = field(default_factory=list)
    # The prompt tokens' (token id, logprob, top alternatives), when asked for (the first has no logprob).
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    cached_tokens: int = 0
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding's counts (meta_info)

    def add(self, out: ReqOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.cached_tokens = out.cached_tokens
        if out.spec_draft_tokens:
            self.spec.count(out.spec_draft_tokens, out.spec_accepted_tokens)
        if out.input_token_logprobs is not None:
            pairs = out.input_token_logprobs
            prompt_tops: list[list[tuple[int, float]] | None] = out.input_top_logprobs or [None] * len(pairs)
            self.prompt_logprobs = [
                (tok, None if lp is None else _json_logprob(lp), _json_tops(top))
                for (lp, tok), top in zip(pairs, prompt_tops)
            ]
        if out.token_logprobs is not None:
            tops = out.top_logprobs or [None] * len(out.token_ids)
            self.logprobs += [
                (tok, _json_logprob(lp), _json_tops(top))
                for tok, lp, top in zip(out.token_ids, out.token_logprobs, tops)
            ]
        if out.finish_reason is not None:
            self.finish = out.finish_reason


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, model_name: str):
        self.tm = tm
        self.model_name = model_name

    # ---- entry points ---------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        tools = req.tool_spec()
        if tools is not None:
            try:
                tools.check(self.tm.limits.grammar_backend)
            except ValueError as e:
                raise APIError(400, str(e), param="tools") from None
        prompt = chat_prompt([m.to_template() for m in req.messages], tools, self.tm.tokenizer)
        max_new = req.max_completion_tokens or req.max_tokens or self.tm.limits.context_len
        return await self._serve(req, raw, [prompt], max_new, chat=True)

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        try:
            prompts = req.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        max_new = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        return await self._serve(req, raw, prompts, max_new, chat=False)

    async def _serve(self, req, raw: Request, prompts: list[dict], max_new: int, chat: bool) -> Response:
        if req.model != self.model_name:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                code="model_not_found",
                param="model",
            )
        resp_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        gen_reqs, where = [], []
        for p_idx, prompt in enumerate(prompts):
            for j in range(req.n):
                gen_reqs.append(
                    GenerateReqInput(
                        **prompt, sampling_params=req.sampling_params(max_new, j), rid=f"{resp_id}-{len(gen_reqs)}"
                    )
                )
                where.append(p_idx)
        parsed = time.perf_counter()
        states = await submit_or_raise(self.tm, gen_reqs, group=resp_id)
        trace_http(self.tm, raw, [s.rid for s in states], parsed)
        choices = [Choice(i, p, s) for i, (p, s) in enumerate(zip(where, states))]
        fmt = _Formatter(self, resp_id, chat, req, prompts)
        if req.stream:
            return StreamingResponse(self._stream(fmt, choices, req.include_usage), media_type="text/event-stream")
        try:
            done = await asyncio.gather(*(self._collect(c, raw) for c in choices))
        except ServerDeadError as e:
            raise server_unavailable(e) from None
        if not all(done):
            return Response(status_code=499)  # the client has gone; nobody reads this
        body = fmt.response(choices)
        self._trace_respond(choices)
        return JSONResponse(body)

    async def _collect(self, choice: Choice, raw: Request) -> bool:
        async for out in self.tm.stream(choice.state, raw.is_disconnected):
            choice.add(out)
        return choice.finish is not None

    async def _stream(self, fmt: _Formatter, choices: list[Choice], include_usage: bool) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for out in self.tm.stream(choice.state):
                    await queue.put((choice, out))
            except ServerDeadError as e:
                await queue.put((choice, e))
            await queue.put((choice, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        echoed: set[int] = set()  # choices whose prompt went out (echo: before their first piece)
        try:
            if fmt.chat:
                opening = {"role": "assistant", "content": "" if fmt.tools is None else None}  # None: calls may come
                for c in choices:
                    yield sse(fmt.chunk(c, opening))
            remaining = len(choices)
            while remaining:
                choice, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, ServerDeadError):
                    yield sse(server_unavailable(item).body())
                    break
                else:
                    choice.add(item)
                    if fmt.echoes is not None and choice.index not in echoed:
                        echoed.add(choice.index)
                        yield sse(fmt.echo_chunk(choice))
                    # With tools the text is held back: only a finished output can be read as calls.
                    if fmt.tools is None and (item.text or item.token_ids and item.token_logprobs is not None):
                        yield sse(fmt.delta_chunk(choice, item))
                    if item.finish_reason is not None:
                        for chunk in fmt.finish_chunks(choice):
                            yield sse(chunk)
            else:
                if include_usage:
                    yield sse(fmt.usage_chunk(choices))
                self._trace_respond(choices)
            yield "data: [DONE]\n\n"
        finally:  # the client left or we are done: stop the pumps (unfinished requests get aborted)
            for t in tasks:
                t.cancel()

    def _trace_respond(self, choices: list[Choice]) -> None:
        if self.tm.tracer is not None:
            now = time.perf_counter()
            for c in choices:
                start = c.state.last_token_time or now
                self.tm.tracer.station(c.state.rid, Station.RESPOND, start, now, text=c.text, finish_reason=c.finish)


class _Formatter:
    """OpenAI's JSON shapes for one response (chat or text completion)."""

    def __init__(self, serving: OpenAIServing, resp_id: str, chat: bool, req, prompts: list[dict[str, Any]]):
        self.tm, self.model, self.id, self.chat, self.req = serving.tm, serving.model_name, resp_id, chat, req
        self.created = int(time.time())
        # echo (completions): each prompt's text, which its choices' text starts with.
        self.echoes = [self._prompt_text(p) for p in prompts] if not chat and req.echo else None
        self.tools = req.tool_spec() if chat else None

    def _envelope(self, choices: list, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def chunk(
        self, c: Choice, delta: dict | str, finish: dict | None = None, logprobs=None, calls: bool = False
    ) -> dict[str, Any]:
        item = {"index": c.index, "logprobs": logprobs, "finish_reason": None}
        item["delta" if self.chat else "text"] = delta
        if finish is not None:
            item.update(finish_fields(finish, calls))
        return self._envelope([item], "chat.completion.chunk" if self.chat else "text_completion")

    def finish_chunks(self, c: Choice) -> list[dict[str, Any]]:
        """A finished choice's last chunks; with tools, its held-back text first, as one delta of
        calls or of content."""
        if self.tools is None:
            return [self.chunk(c, {} if self.chat else "", finish=c.finish)]
        read = self.tool_output(c)
        logprobs = self.logprobs(c.logprobs) if self._wants_logprobs else None
        delta = read.delta() if read is not None else {"content": c.text}
        last = self.chunk(c, {}, finish=c.finish, calls=read is not None)
        return [self.chunk(c, delta, logprobs=logprobs), last] if read is not None or c.text else [last]

    def tool_output(self, c: Choice) -> ToolOutput | None:
        """The calls in a chat choice's text; None for plain content, and for an output cut short
        (only one that ended with "stop" is complete)."""
        if self.tools is None or c.finish is None or c.finish["type"] != "stop":
            return None
        return self.tools.read(c.text)

    def delta_chunk(self, c: Choice, out: ReqOutput) -> dict[str, Any]:
        entries = c.logprobs[len(c.logprobs) - len(out.token_ids) :] if out.token_logprobs is not None else None
        offset = len(self._echo(c)) + len(c.text) - len(out.text)
        return self.chunk(
            c,
            {"content": out.text} if self.chat else out.text,
            logprobs=self.logprobs(entries, offset) if entries is not None else None,
        )

    def echo_chunk(self, c: Choice) -> dict[str, Any]:
        """The prompt's text (and its tokens' logprobs, when asked for): a choice's first chunk with echo."""
        return self.chunk(c, self._echo(c), logprobs=self.logprobs(c.prompt_logprobs) if self._wants_logprobs else None)

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        items = []
        for c in choices:
            read = self.tool_output(c)
            item = {
                "index": c.index,
                **finish_fields(c.finish, calls=read is not None),
                "logprobs": self.logprobs(c.prompt_logprobs + c.logprobs) if self._wants_logprobs else None,
            }
            if self.chat:
                item["message"] = {"role": "assistant", **(read.message() if read else {"content": c.text})}
            else:
                item["text"] = self._echo(c) + c.text
            items.append(item)
        body = self._envelope(items, "chat.completion" if self.chat else "text_completion")
        body["usage"] = usage(choices)
        return body

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        body = self._envelope([], "chat.completion.chunk" if self.chat else "text_completion")
        body["usage"] = usage(choices)
        return body

    @property
    def _wants_logprobs(self) -> bool:
        return bool(self.req.logprobs) if self.chat else self.req.logprobs is not None

    def logprobs(self, entries: list, offset: int = 0) -> dict[str, Any]:
        """OpenAI's logprobs object; `offset` is where these tokens' text starts in the choice's text."""
        token = self._token_text
        if self.chat:

            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                text = token(token_id)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {
                "content": [
                    {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in (tops or [])]} for t, lp, tops in entries
                ]
            }
        tokens = [token(t) for t, _, _ in entries]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token(i): v for i, v in tops} if tops else None for _, _, tops in entries],
            "text_offset": offsets,
        }

    def _token_text(self, token_id: int) -> str:
        tok = self.tm.tokenizer
        return tok.decode([token_id]) if tok is not None else f"<{token_id}>"

    def _prompt_text(self, prompt: dict[str, Any]) -> str:
        """A completion prompt as text: as given, or its token ids decoded."""
        if "text" in prompt:
            return prompt["text"]
        ids, tok = prompt["input_ids"], self.tm.tokenizer
        return tok.decode(ids) if tok is not None else "".join(map(self._token_text, ids))

    def _echo(self, c: Choice) -> str:
        """The text a completion choice starts with: its prompt with echo, else nothing."""
        return self.echoes[c.prompt_index] if self.echoes is not None else ""


def finish_fields(finish: dict[str, Any] | None, calls: bool = False) -> dict[str, Any]:
    """finish_reason "stop" / "length" (or "abort"; "tool_calls" for a choice read as `calls`), plus
    what stopped it (SGLang's matched_stop)."""
    if finish is None:
        return {"finish_reason": None}
    reason = "tool_calls" if calls else finish["type"]
    return {"finish_reason": reason, "matched_stop": finish["matched"] if finish["type"] == "stop" else None}


def usage(choices: list[Choice]) -> dict[str, Any]:
    """Each prompt counts once however many choices it has (as OpenAI counts n > 1)."""
    first = {}
    for c in choices:
        first.setdefault(c.prompt_index, c)
    prompt = sum(c.state.prompt_tokens for c in first.values())
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in first.values())},
    }


_JSON = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event. msgspec writes UTF-8 as it is (json's ensure_ascii=False) in a twelfth
    of json.dumps' time, which a stream pays per chunk in the server's one main process."""
    return b"data: " + _JSON.encode(payload) + b"\n\n"


async def submit_or_raise(
    tm: TokenizerManager, reqs: list[GenerateReqInput], group: str | None = None
) -> list[ReqState]:
    """TokenizerManager.submit with its failures as API errors."""
    try:
        return await tm.submit(reqs, group)
    except ValueError as e:
        code = "context_length_exceeded" if "context length" in str(e) else "invalid_value"
        raise APIError(400, str(e), code=code) from None
    except QueueFullError as e:
        raise APIError(
            503, f"too many requests queued ({e}); retry later", code="queue_full", headers={"Retry-After": "1"}
        ) from None
    except ServerDeadError as e:
        raise server_unavailable(e) from None


def trace_http(tm: TokenizerManager, raw: Request, rids: list[str], parsed: float) -> None:
    """Stations 1 (HTTP receive) and 2 (parse/validate) of requests that were just submitted."""
    if tm.tracer is None:
        return
    received = getattr(raw.state, "received", parsed)
    entered = getattr(raw.state, "handler_entered", parsed)
    for rid in rids:
        tm.tracer.station(rid, Station.HTTP_RECEIVE, received, entered, path=raw.url.path)
        tm.tracer.station(rid, Station.PARSE_VALIDATE, entered, parsed)
