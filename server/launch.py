"""`python -m labkit.server`: start the scheduler and detokenizer processes, serve HTTP in this one,
and take everything down together.

Start-up: resolve the model here (the embedded GGUF is converted once, before any child needs it),
spawn the children, and serve at once (503 until they are up). Ready: both children report in and a
one-token generation passes; one line is printed. Shutdown: Ctrl-C / SIGTERM stop uvicorn, then the
children are terminated (and killed if they linger) and the socket directory is removed. A child
that dies makes every in-flight request fail, /health answer 503, and the server exit non-zero."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from labkit.config import EngineConfig, ranks_per_node
from labkit.distributed.tp_worker import check_tp_shapes, free_local_addr
from labkit.model_executor.model_runner import resolve_device
from labkit.model_loader.embedded import EMBEDDED_MODEL_NAME
from labkit.model_loader.loader import load_config, model_dir_and_tokenizer
from labkit.server.detokenizer_process import run_detokenizer_process
from labkit.server.http_server import create_app
from labkit.server.ipc import PortArgs, remove_stale_ipc_dirs
from labkit.server.process import READY_LINE
from labkit.server.scheduler_process import RankPlace, run_scheduler_process
from labkit.server.server_args import ServerArgs
from labkit.server.tokenizer_manager import TokenizerManager
from labkit.trace.recorder import Tracer

logger = logging.getLogger("labkit.server")
WATCH_INTERVAL_S = 0.5
DEATH_GRACE_S = 2.0  # keep answering 503 this long after a child died, then exit
CHILD_START_TIMEOUT_S = 600.0
WARM_UP_TIMEOUT_S = 60.0


class Launcher:
    """Owns the child processes and the socket directory."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.ports = PortArgs.create()
        self.procs: dict[str, mp.Process] = {}
        self.ready_conns = {}
        self.stopping = False

    def start_children(self) -> None:
        """This node's scheduler ranks of every replica, and on node 0 the detokenizer."""
        cfg = self.args.engine
        per_node = ranks_per_node(cfg)
        for dp_rank in range(self.args.dp_size):
            addr = replica_init_addr(cfg, dp_rank)
            for tp_rank in range(cfg.node_rank * per_node, (cfg.node_rank + 1) * per_node):
                place = RankPlace(dp_rank, tp_rank, addr)
                self._start(place.name, run_scheduler_process, place)
        if cfg.node_rank == 0:
            self._start("detokenizer", run_detokenizer_process)

    def _start(self, name: str, target: Callable[..., None], *extra: object) -> None:
        ctx = mp.get_context("spawn")  # a clean interpreter: no forked torch or event-loop state
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=target, name=f"labkit-{name}", daemon=True, args=(self.args, self.ports, writer, os.getpid(), *extra)
        )
        proc.start()
        writer.close()
        self.procs[name], self.ready_conns[name] = proc, reader

    def wait_ready(self) -> dict[str, dict]:
        """Block until every child reported in; their info by name. Raises RuntimeError if one failed."""
        infos: dict[str, dict] = {}
        deadline = time.monotonic() + CHILD_START_TIMEOUT_S
        while len(infos) < len(self.procs):
            if self.stopping or time.monotonic() > deadline:
                raise RuntimeError("start-up was interrupted" if self.stopping else "children did not start in time")
            for name, conn in self.ready_conns.items():
                if name in infos:
                    continue
                if conn.poll(0.2):
                    try:
                        msg = conn.recv()
                    except EOFError:  # it died before reporting
                        self.procs[name].join(timeout=5)
                        msg = {"error": f"it exited (exit code {self.procs[name].exitcode})"}
                    if "error" in msg:
                        raise RuntimeError(f"the {name} process failed to start: {msg['error']}")
                    infos[name] = msg["info"]
                elif not self.procs[name].is_alive():
                    raise RuntimeError(
                        f"the {name} process exited during start-up (exit code {self.procs[name].exitcode})"
                    )
        return infos

    def dead_child(self) -> str | None:
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"the {name} process died (exit code {proc.exitcode})"
        return None

    def shutdown(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.ports.cleanup()


class ServerRuntime:
    """What the HTTP app serves with, and the server's life: starting -> ready -> (dead) -> exit."""

    def __init__(self, args: ServerArgs, launcher: Launcher, tokenizer, model_name: str):
        self.args, self.launcher, self.tokenizer, self.model_name = args, launcher, tokenizer, model_name
        self.created = int(time.time())
        self.tm: TokenizerManager | None = None
        self.ready = False
        self.exit_code = 0
        self.uvicorn: uvicorn.Server | None = None

    async def run(self) -> None:
        try:
            infos = await asyncio.to_thread(self.launcher.wait_ready)
            # Every child's pid by name (scheduler, scheduler-tp1, ..., detokenizer), for /get_server_info.
            info = {**infos["scheduler"], "processes": {name: i.get("pid") for name, i in infos.items()}}
            self.tm = make_tokenizer_manager(self.args, self.tokenizer, self.launcher.ports, info)
            loop_task = asyncio.create_task(self.tm.handle_loop())
            while not await self.tm.generate_one_token(timeout=WARM_UP_TIMEOUT_S):  # warm-up, proves the path
                if self._failure(loop_task):
                    break
                logger.warning("the warm-up generation did not finish in %.0f s; trying again", WARM_UP_TIMEOUT_S)
        except RuntimeError as e:
            logger.error("%s", e)
            return self._exit(1)
        except Exception:  # a bug: say so and exit, rather than stay "starting" with a dead task
            logger.exception("start-up failed")
            return self._exit(1)
        self.ready = self._failure(loop_task) is None
        if self.ready:
            info = infos["scheduler"]
            print(
                f"{READY_LINE} at http://{self.args.host}:{self.args.port} (model {self.model_name}, "
                f"{info['device']}, {info['dtype']}, KV pool {info['limits']['max_total_tokens']} tokens)",
                flush=True,
            )
        await self._watch(loop_task)

    def _failure(self, loop_task: asyncio.Task) -> str | None:
        """Why the server cannot serve (a child died, the receive loop stopped), or None."""
        reason = self.launcher.dead_child()
        if reason is None and loop_task.done():
            reason = f"the receive loop stopped: {loop_task.exception()!r}"
        return reason

    async def _watch(self, loop_task: asyncio.Task) -> None:
        """Until shutdown: once the server cannot serve, fail what is in flight and exit non-zero."""
        while (reason := self._failure(loop_task)) is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
        logger.error("%s; failing in-flight requests and shutting down", reason)
        self.tm.fail_all(reason)
        await asyncio.sleep(DEATH_GRACE_S)
        self._exit(1)

    def _exit(self, code: int) -> None:
        self.exit_code = code
        if self.uvicorn is not None:
            self.uvicorn.should_exit = True

    def save_trace(self) -> None:
        if self.args.trace_file and self.tm is not None and self.tm.tracer is not None:
            path = self.tm.tracer.save_perfetto(Path(self.args.trace_file))
            logger.info("trace written to %s (open it in https://ui.perfetto.dev)", path)


def make_tokenizer_manager(args: ServerArgs, tokenizer, ports: PortArgs, scheduler_info: dict) -> TokenizerManager:
    """The HTTP side's TokenizerManager for these args: the queue cap (--max-queued-requests beyond
    --max-running-requests per replica; none by default), a Tracer when tracing, and the routing to
    the --dp-size replicas."""
    running = args.engine.max_running_requests * args.dp_size
    cap = None if args.max_queued_requests is None else running + args.max_queued_requests
    tracer = Tracer() if args.engine.enable_trace else None
    return TokenizerManager(
        tokenizer, ports, scheduler_info, cap, tracer, dp_size=args.dp_size, load_balance=args.load_balance_method
    )


def model_name_of(args: ServerArgs) -> str:
    if args.served_model_name:
        return args.served_model_name
    return args.engine.model_path or EMBEDDED_MODEL_NAME


class _UvicornServer(uvicorn.Server):
    """uvicorn's server, ending the requests in flight first when it shuts down: each gets an error
    (a stream its final error event), so no connection is left for the graceful shutdown to cancel."""

    def __init__(self, runtime: ServerRuntime, config: uvicorn.Config):
        super().__init__(config)
        self.runtime = runtime

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        tm = self.runtime.tm
        if tm is not None and not tm.dead:
            tm.fail_all("the server is shutting down")
        await super().shutdown(sockets)


def replica_init_addr(cfg: EngineConfig, dp_rank: int) -> str:
    """Where replica `dp_rank`'s ranks meet: --dist-init-addr's port + dp_rank, or a free local port
    (one node). Unused with tp_size 1."""
    if cfg.dist_init_addr:
        host, _, port = cfg.dist_init_addr.rpartition(":")
        return f"{host}:{int(port) + dp_rank}"
    return free_local_addr()


def check_layout(args: ServerArgs) -> None:
    """SystemExit, before any process starts, for a tp_size the model cannot split or more ranks
    on this node than it has GPUs."""
    cfg = args.engine
    try:
        if cfg.tp_size > 1:
            check_tp_shapes(load_config(cfg.model_path), cfg.tp_size, cfg.ep_size)
        resolve_device(cfg.device, ranks_per_node(cfg) - 1)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"labkit server: {e}") from None


def run_worker_node(args: ServerArgs) -> int:
    """Node 1.. of a multi-node launch: only this node's scheduler ranks (they follow rank 0 on node
    0); no HTTP. Exits when a rank exits (e.g. node 0 went away) or on Ctrl-C / SIGTERM."""
    launcher = Launcher(args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    try:
        launcher.start_children()
        launcher.wait_ready()
        print(f"labkit node {args.engine.node_rank} ready ({len(launcher.procs)} scheduler ranks)", flush=True)
        while (reason := launcher.dead_child()) is None:
            time.sleep(WATCH_INTERVAL_S)
        logger.error("%s; this node stops", reason)
        return 1
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    except SystemExit:
        return 0
    finally:
        launcher.shutdown()


def check_port_free(host: str, port: int) -> None:
    """SystemExit with a clear message if (host, port) cannot be bound, e.g. another server has it."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind((host, port))
    except OSError as e:
        raise SystemExit(f"labkit server: cannot listen on {host}:{port}: {e.strerror}") from None


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    args = ServerArgs.from_cli(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints where it is
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s main] %(levelname)s %(message)s")
    check_layout(args)
    if args.engine.node_rank > 0:
        return run_worker_node(args)
    check_port_free(args.host, args.port)  # before the model loads, which takes a while
    for path in remove_stale_ipc_dirs():
        logger.info("removed the socket directory of a server that is gone: %s", path)
    # Before the children start: the embedded model's GGUF is converted here, once.
    _, tokenizer = model_dir_and_tokenizer(args.engine)
    launcher = Launcher(args)
    launcher.start_children()
    runtime = ServerRuntime(args, launcher, tokenizer, model_name_of(args))
    server = _UvicornServer(
        runtime,
        uvicorn.Config(
            create_app(runtime),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=3,
            # C event loop and HTTP parser: streaming pays them per chunk, in this one process
            loop="uvloop",
            http="httptools",
            access_log=args.log_level == "debug",
        ),
    )
    runtime.uvicorn = server
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with the previous
    # handler restored: make that handler a clean exit, so the children are still taken down below.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    try:
        server.run()
    except SystemExit:
        pass
    finally:
        launcher.shutdown()
        runtime.save_trace()
    if runtime.exit_code == 0 and not server.started:
        runtime.exit_code = 1  # could not bind the port, or start-up failed before serving
    return runtime.exit_code


if __name__ == "__main__":
    sys.exit(main())
