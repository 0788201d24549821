"""The server in one process, for notebooks and tests: the real FastAPI app (called over an ASGI
transport, no network), the real TokenizerManager, SchedulerLoop and DetokenizerLoop, joined by the
real ZMQ ipc sockets in a private directory.

The difference from `python -m labkit.server`: the scheduler and the detokenizer are not processes
with event loops of their own. The caller turns them, one message or one step at a time, or lets
`serve` turn them until a request has its answer:

    server = InProcessServer(EngineConfig(enable_trace=True))
    await server.start()                                 # the app's start-up: the receive loop
    task = asyncio.create_task(server.client.post("/v1/chat/completions", json=body))
    raw, msg = await server.next_message()               # the bytes on the scheduler's socket
    server.scheduler_loop.process_input_request(msg)     # into the waiting queue
    out = server.scheduler.step()                        # one batch: forward and sample
    server.scheduler_loop.send_outputs(out)              # its tokens to the detokenizer
    raw, str_out = await server.detokenize()             # text pieces to the TokenizerManager
    ...                                                  # until the request finishes
    response = await task
    await server.close()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from contextlib import AsyncExitStack
from typing import TypeVar

import httpx
import zmq

from labkit.config import EngineConfig
from labkit.io_struct import BatchStrOutput, ToScheduler
from labkit.scheduler.scheduler import Scheduler
from labkit.server.detokenizer_process import DetokenizerLoop
from labkit.server.http_server import create_app
from labkit.server.ipc import PortArgs
from labkit.server.runtime import make_tokenizer_manager, model_name_of
from labkit.server.scheduler_process import SchedulerLoop
from labkit.server.server_args import ServerArgs
from labkit.server.tokenizer_manager import TokenizerManager
from labkit.trace.recorder import Tracer

T = TypeVar("T")
POLL_S = 0.001  # how long a side waiting for a message lets the event loop run before it looks again
STEP_MESSAGE_WAIT_MS = 20  # at most, for a message the scheduler has just sent


class InProcessServer:
    """The three parts of the server in this process; also the runtime the app serves with
    (http_server.AppRuntime). `client` sends HTTP requests straight into the app. With
    `config.enable_trace`, `tracer` (the TokenizerManager's) collects every request's ten stations:
    the scheduler's and the detokenizer's records travel to it inside their ZMQ messages, as in the
    server."""

    def __init__(self, config: EngineConfig | None = None):
        self.args = ServerArgs(engine=config or EngineConfig())
        self.model_name = model_name_of(self.args)
        self.created = int(time.time())
        self.ports = PortArgs.create()
        self.scheduler_loop: SchedulerLoop | None = None
        try:
            self.scheduler_loop = SchedulerLoop.create(self.args.engine, self.ports)
            # One process: the detokenizer shares the tokenizer the scheduler loaded.
            self.detokenizer_loop = DetokenizerLoop.create(self.args.engine, self.ports, self.scheduler.tokenizer)
            self.tm: TokenizerManager = make_tokenizer_manager(
                self.args, self.scheduler.tokenizer, self.ports, self.scheduler_loop.info()
            )
        except BaseException:
            if self.scheduler_loop is not None:
                self.scheduler_loop.close()
            self.ports.cleanup()
            raise
        self.ready = True
        self.app = create_app(self)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://labkit", timeout=None
        )
        self._lifespan = AsyncExitStack()

    @property
    def scheduler(self) -> Scheduler:
        return self.scheduler_loop.scheduler

    @property
    def tracer(self) -> Tracer | None:
        return self.tm.tracer

    @property
    def tokenizer(self):
        """The model's tokenizer (with `tracer`, what labkit.viz's Run.of(server) reads)."""
        return self.tm.tokenizer

    async def run(self) -> None:
        """The app's start-up task: the TokenizerManager's receive loop (the server's runtime starts
        the same loop once its children are up)."""
        await self.tm.handle_loop()

    async def start(self) -> None:
        """Run the app's lifespan start-up, which an ASGI transport does not do by itself."""
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))

    async def close(self) -> None:
        """The app's shutdown, then close the client and every socket and remove the socket directory."""
        await self._lifespan.aclose()
        await self.client.aclose()
        self.tm.close()
        self.scheduler_loop.close()
        self.detokenizer_loop.close()
        self.ports.cleanup()

    # ---- turning the scheduler and the detokenizer by hand ---------------------------------------
    async def next_message(self, timeout_s: float = 10.0) -> tuple[bytes, ToScheduler]:
        """The next message on the scheduler's socket, as bytes and decoded; not yet processed."""
        loop = self.scheduler_loop
        raw = await _recv(loop.recv_from_tokenizer, timeout_s)
        return raw, loop.decoder.decode(raw)

    async def detokenize(self, timeout_s: float = 10.0) -> tuple[bytes, BatchStrOutput]:
        """Take the next message on the detokenizer's socket, detokenize it and send the result on to
        the TokenizerManager. Returns the message's bytes and what was sent."""
        raw = await _recv(self.detokenizer_loop.recv_from_scheduler, timeout_s)
        return raw, self.detokenizer_loop.handle(raw)

    async def serve(self, request: Awaitable[T], timeout_s: float = 120.0) -> T:
        """Await `request` (e.g. a `client` call) while the scheduler and the detokenizer take turns
        as fast as they can, as the server's processes would."""
        task = asyncio.ensure_future(request)
        deadline = time.monotonic() + timeout_s
        try:
            while not task.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer within {timeout_s} s")
                sent = self.scheduler_loop.run_once(0)
                # A step's message is on its way (ipc delivery is not instant): wait for it, so that
                # its tokens are detokenized now, not after the next step.
                self.detokenizer_loop.run_once(STEP_MESSAGE_WAIT_MS if sent else 0)
                await asyncio.sleep(POLL_S)
        finally:
            task.cancel()  # a no-op once it is done
        return task.result()


async def _recv(sock: zmq.Socket, timeout_s: float) -> bytes:
    """The next message on a blocking socket, waited for without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    while not sock.poll(0):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no message within {timeout_s} s")
        await asyncio.sleep(POLL_S)
    return sock.recv()
