"""On the tiny random-weight Llama with the embedded tokenizer (tests/conftest.py's
`tiny_engine_kwargs`): an Engine, and the server's real app, TokenizerManager, scheduler and
detokenizer in this process behind a real HTTP port, for RuntimeEndpoint."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvicorn

import labkit.lang as sgl
from labkit import Engine
from labkit.config import EngineConfig
from labkit.server.inprocess import InProcessServer
from labkit.server.process import free_port


@pytest.fixture(scope="module")
def engine(tiny_engine_kwargs):
    return Engine(**tiny_engine_kwargs)


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.EngineBackend(engine)


@pytest.fixture(scope="module")
def server_url(tiny_engine_kwargs):
    """An InProcessServer's app served by uvicorn on a free port (its event loop in one thread), with
    its scheduler and detokenizer turned by another thread, as their processes would."""
    server = InProcessServer(EngineConfig(**tiny_engine_kwargs))
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    stop = threading.Event()

    def turn() -> None:
        while not stop.is_set():
            sent = server.scheduler_loop.run_once(5)
            server.detokenizer_loop.run_once(20 if sent else 0)

    threads = [threading.Thread(target=http.run, daemon=True), threading.Thread(target=turn, daemon=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not http.started:
        if time.monotonic() > deadline:
            raise TimeoutError("uvicorn did not start")
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    http.should_exit = True
    stop.set()
    for t in threads:
        t.join(timeout=10)
    asyncio.run(server.close())
