"""One HTTP process's life, shared by the main process and the extra tokenizer workers
(--tokenizer-worker-num): build its TokenizerManager once the scheduler is up, prove the path with a
one-token generation, serve, and fail what is in flight when serving can no longer go on.

starting (503) -> ready -> (failed: in-flight requests get errors) -> exit"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from abc import ABC, abstractmethod
from typing import Any

import uvicorn

from labkit.model_loader.embedded import EMBEDDED_MODEL_NAME
from labkit.server.http_server import create_app
from labkit.server.ipc import PortArgs
from labkit.server.server_args import ServerArgs
from labkit.server.tokenizer_manager import TokenizerManager
from labkit.trace.recorder import Tracer

logger = logging.getLogger("labkit.server")
WATCH_INTERVAL_S = 0.5
DEATH_GRACE_S = 2.0  # keep answering 503 this long after serving failed, then exit
WARM_UP_TIMEOUT_S = 60.0


class ServerRuntime(ABC):
    """What the HTTP app serves with (http_server.AppRuntime). A subclass says where the scheduler's
    info comes from (`scheduler_info`), what happens once this process can serve (`announce`), and
    why it no longer can (`failure`)."""

    def __init__(self, args: ServerArgs, ports: PortArgs, tokenizer, model_name: str, worker: int = 0):
        self.args, self.ports, self.tokenizer, self.model_name = args, ports, tokenizer, model_name
        self.worker = worker
        self.created = int(time.time())
        self.tm: TokenizerManager | None = None
        self.ready = False
        self.exit_code = 0
        self.uvicorn: uvicorn.Server | None = None

    @abstractmethod
    async def scheduler_info(self) -> dict[str, Any]:
        """The scheduler's info (limits, device, ...), once it is up. RuntimeError if it cannot start."""

    @abstractmethod
    async def announce(self) -> None:
        """This process's generation path works; `ready` is set once this returns. RuntimeError if
        the server as a whole cannot serve."""

    @abstractmethod
    def failure(self) -> str | None:
        """Why the server can no longer serve (beyond this process's receive loop), or None."""

    def on_failure(self) -> None:
        """Serving failed: what else to take down at once (nothing, by default)."""
        return None

    async def run(self) -> None:
        try:
            info = await self.scheduler_info()
            self.tm = make_tokenizer_manager(self.args, self.tokenizer, self.ports, info, self.worker)
            loop_task = asyncio.create_task(self.tm.handle_loop())
            while not await self.tm.generate_one_token(timeout=WARM_UP_TIMEOUT_S):  # warm-up, proves the path
                if self._failure(loop_task):
                    break
                logger.warning("the warm-up generation did not finish in %.0f s; trying again", WARM_UP_TIMEOUT_S)
            if self._failure(loop_task) is None:
                await self.announce()
                self.ready = True  # with more workers: only once every one of them can serve
        except RuntimeError as e:
            logger.error("%s", e)
            return self._exit(1)
        except Exception:  # a bug: say so and exit, rather than stay "starting" with a dead task
            logger.exception("start-up failed")
            return self._exit(1)
        await self._watch(loop_task)

    def _failure(self, loop_task: asyncio.Task) -> str | None:
        reason = self.failure()
        if reason is None and loop_task.done():
            reason = f"the receive loop stopped: {loop_task.exception()!r}"
        return reason

    async def _watch(self, loop_task: asyncio.Task) -> None:
        """Until shutdown: once the server cannot serve, fail what is in flight and exit non-zero."""
        while (reason := self._failure(loop_task)) is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
        logger.error("%s; failing in-flight requests and shutting down", reason)
        self.tm.fail_all(reason)
        self.on_failure()
        await asyncio.sleep(DEATH_GRACE_S)
        self._exit(1)

    def _exit(self, code: int) -> None:
        self.exit_code = code
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True


def make_tokenizer_manager(
    args: ServerArgs, tokenizer, ports: PortArgs, scheduler_info: dict, worker: int = 0
) -> TokenizerManager:
    """Tokenizer worker `worker`'s TokenizerManager for these args: its share of the queue cap
    (--max-queued-requests beyond --max-running-requests per replica; none by default), a Tracer
    when tracing, and the routing to the --dp-size replicas."""
    workers = args.tokenizer_worker_num
    cap = None
    if args.max_queued_requests is not None:
        total = args.engine.max_running_requests * args.dp_size + args.max_queued_requests
        cap = total // workers + (worker < total % workers)
    tracer = Tracer() if args.engine.enable_trace else None
    return TokenizerManager(
        tokenizer,
        ports,
        scheduler_info,
        cap,
        tracer,
        dp_size=args.dp_size,
        load_balance=args.load_balance_method,
        worker=worker,
        workers=workers,
    )


def model_name_of(args: ServerArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    return args.engine.model_path or EMBEDDED_MODEL_NAME


class UvicornServer(uvicorn.Server):
    """uvicorn's server, ending the requests in flight first when it shuts down: each gets an error
    (a stream its final error event), so no connection is left for the graceful shutdown to cancel.
    Ctrl-C reaches every process of the terminal's group; only the main process acts on it (it
    takes the others down in order)."""

    def __init__(self, runtime: ServerRuntime, config: uvicorn.Config):
        super().__init__(config)
        self.runtime = runtime
        runtime.uvicorn = self

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGINT and self.runtime.worker != 0:
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        tm = self.runtime.tm
        if tm is not None and not tm.dead:
            tm.fail_all("the server is shutting down")
        await super().shutdown(sockets)


def bound_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound to (host, port) as uvicorn binds one (SO_REUSEADDR). With `reuse_port`
    (SO_REUSEPORT) each tokenizer worker binds its own and the kernel spreads new connections over
    them (one shared socket would let whichever process accepts first take a whole burst)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(runtime: ServerRuntime) -> int:
    """Serve the app on `runtime` until uvicorn stops, on the port itself or on this worker's
    SO_REUSEPORT socket; returns the exit code (1 also when it never started serving: the port could
    not be bound, or start-up failed first). uvicorn shuts down gracefully on SIGINT / SIGTERM, then
    re-raises the signal with the previous handler restored: the caller makes that handler
    `exit_cleanly`, so its own clean-up still runs."""
    args = runtime.args
    server = UvicornServer(
        runtime,
        uvicorn.Config(
            create_app(runtime),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=3,
            # C event loop and HTTP parser: streaming pays them per chunk, in each HTTP process
            loop="uvloop",
            http="httptools",
            access_log=args.log_level == "debug",
        ),
    )
    try:
        if args.tokenizer_worker_num == 1:
            server.run()
        else:
            server.run(sockets=[bound_socket(args.host, args.port, reuse_port=True)])
    except SystemExit:
        pass
    return runtime.exit_code if server.started else 1


def exit_cleanly(signum, frame) -> None:
    """A signal handler: exit as from the end of the program, so `finally` blocks run."""
    raise SystemExit(0)
