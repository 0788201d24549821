"""Large prompts do not hold the server up: one that cannot fit the context whatever its tokens is
refused before it is tokenized, and tokenizing happens off the event loop (in a worker thread)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from labkit.config import EngineConfig
from labkit.server.inprocess import InProcessServer

pytestmark = pytest.mark.slow


class RecordingTokenizer:
    """The real tokenizer, recording the thread of every encoding call."""

    def __init__(self, tokenizer: Any):
        self._tokenizer, self.threads = tokenizer, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread())
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def test_too_long_prompts_are_refused_untokenized_and_tokenizing_leaves_the_event_loop():
    asyncio.run(_run(InProcessServer(EngineConfig())))


async def _run(server: InProcessServer) -> None:
    await server.start()
    try:
        recorder = server.tm.tokenizer = RecordingTokenizer(server.tm.tokenizer)
        body = {"model": server.model_name, "max_tokens": 2, "temperature": 0}
        ok = await server.serve(server.client.post("/v1/completions", json={**body, "prompt": "Hello there"}))
        assert ok.status_code == 200
        assert recorder.threads and threading.main_thread() not in recorder.threads

        calls = len(recorder.threads)
        too_long = "x" * (server.tm.max_prompt_chars + 1)
        for payload in ({"prompt": too_long}, {"messages": [{"role": "user", "content": too_long}]}):
            endpoint = "/v1/completions" if "prompt" in payload else "/v1/chat/completions"
            refused = await server.serve(server.client.post(endpoint, json={**body, **payload}))
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "context_length_exceeded"
        assert len(recorder.threads) == calls  # never tokenized
    finally:
        await server.close()
