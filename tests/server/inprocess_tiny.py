"""The server's real app, TokenizerManager, scheduler and detokenizer in this process on a tiny
random-weight model (no tokenizer: prompts are token ids): fast tests of the HTTP layer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import msgspec

from labkit.config import EngineConfig
from labkit.io_struct import BatchStrOutput, ReqOutput
from labkit.server.http_server import create_app
from labkit.server.inprocess import InProcessServer

MODEL = "tiny-llama"
T = TypeVar("T")


def run_with_server(test: Callable[[InProcessServer], Awaitable[T]], api_key: str | None = None) -> T:
    """asyncio.run `test(server)` with a started tiny server (requiring `api_key`), closed afterwards."""

    async def main() -> T:
        server = InProcessServer(EngineConfig(model_path=MODEL, load_format="dummy", max_total_tokens=2048))
        if api_key is not None:  # the app reads the key when it is built
            server.args.api_key = api_key
            await server.client.aclose()
            server.app = create_app(server)
            server.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://labkit")
        await server.start()
        try:
            return await test(server)
        finally:
            await server.close()

    return asyncio.run(main())


async def answer_with(server: InProcessServer, path: str, body: dict, steps: list[ReqOutput]) -> httpx.Response:
    """POST `body` to `path` and, once its request is in flight, hand the TokenizerManager `steps` as
    if the scheduler had produced them (one message each, back to back, with the request's rid) in
    place of the model's own outputs; the response."""
    task = asyncio.create_task(server.client.post(path, json=body))
    while not server.tm.rid_to_state:
        await asyncio.sleep(0.001)
    [rid] = server.tm.rid_to_state
    for out in steps:
        server.tm._dispatch(BatchStrOutput(outputs=[msgspec.structs.replace(out, rid=rid)]))
    return await task


def error_of(r: httpx.Response, status: int) -> dict:
    """The error object of a response in OpenAI's shape, checked."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] and err["code"]
    return err
