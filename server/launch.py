"""`python -m labkit.server`: start the scheduler and detokenizer processes, serve HTTP in this one
(and in --tokenizer-worker-num - 1 more), and take everything down together.

Start-up: resolve the model here (the embedded GGUF is converted once, before any child needs it),
spawn the children, and serve at once (503 until they are up). Ready: both children report in, the
other tokenizer workers start, and a one-token generation passes in every HTTP process; one line is
printed. Shutdown: Ctrl-C / SIGTERM stop uvicorn, then the children are terminated (and killed if
they linger) and the socket directory is removed. A child that dies makes every in-flight request
fail, /health answer 503, and the server exit non-zero."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from labkit.config import EngineConfig, ranks_per_node
from labkit.distributed.tp_worker import check_tp_shapes, free_local_addr
from labkit.model_executor.model_runner import resolve_device
from labkit.model_loader.loader import load_config, model_dir_and_tokenizer
from labkit.server.detokenizer_process import run_detokenizer_process
from labkit.server.http_worker import run_http_worker
from labkit.server.ipc import PortArgs, remove_stale_ipc_dirs
from labkit.server.process import READY_LINE
from labkit.server.runtime import WATCH_INTERVAL_S, ServerRuntime, bound_socket, exit_cleanly, model_name_of, serve
from labkit.server.scheduler_process import RankPlace, run_scheduler_process
from labkit.server.server_args import ServerArgs

logger = logging.getLogger("labkit.server")
CHILD_START_TIMEOUT_S = 600.0


class Launcher:
    """Owns the child processes and the socket directory."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.ports = PortArgs.create()
        self.procs: dict[str, mp.Process] = {}
        self.ready_conns = {}
        self.infos: dict[str, dict] = {}  # what each child reported once ready, by name
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

    def start_http_workers(self, scheduler_info: dict) -> None:
        """Tokenizer workers 1.. (worker 0 is this process), given the scheduler's info."""
        for worker in range(1, self.args.tokenizer_worker_num):
            self._start(f"http-{worker}", run_http_worker, worker, scheduler_info)

    def stop_http_workers(self) -> None:
        for name, proc in self.procs.items():
            if name.startswith("http-") and proc.is_alive():
                proc.terminate()

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
        """Block until every child started so far reported in; their info by name. Raises
        RuntimeError if one failed."""
        infos = self.infos
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
                elif not self.procs[name].is_alive() and not conn.poll(0):
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


class MainRuntime(ServerRuntime):
    """Tokenizer worker 0, in the main process: it waits for the children, starts the other
    tokenizer workers, prints the ready line once every worker can serve, and fails when any child
    dies."""

    def __init__(self, args: ServerArgs, launcher: Launcher, tokenizer, model_name: str):
        super().__init__(args, launcher.ports, tokenizer, model_name)
        self.launcher = launcher

    async def scheduler_info(self) -> dict[str, Any]:
        infos = await asyncio.to_thread(self.launcher.wait_ready)
        # Every child's pid by name (scheduler, scheduler-tp1, ..., detokenizer), for /get_server_info.
        info = {**infos["scheduler"], "processes": {name: i.get("pid") for name, i in infos.items()}}
        self.launcher.start_http_workers(info)
        return info

    async def announce(self) -> None:
        await asyncio.to_thread(self.launcher.wait_ready)  # the other tokenizer workers
        info = self.launcher.infos["scheduler"]
        workers = f", {self.args.tokenizer_worker_num} tokenizer workers" if self.args.tokenizer_worker_num > 1 else ""
        print(
            f"{READY_LINE} at http://{self.args.host}:{self.args.port} (model {self.model_name}, "
            f"{info['device']}, {info['dtype']}, KV pool {info['limits']['max_total_tokens']} tokens{workers})",
            flush=True,
        )

    def failure(self) -> str | None:
        return self.launcher.dead_child()

    def on_failure(self) -> None:
        self.launcher.stop_http_workers()  # they fail their requests in flight as they stop

    def save_trace(self) -> None:
        if self.args.trace_file and self.tm is not None and self.tm.tracer is not None:
            path = self.tm.tracer.save_perfetto(Path(self.args.trace_file))
            logger.info("trace written to %s (open it in https://ui.perfetto.dev)", path)


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
        signal.signal(sig, exit_cleanly)
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
        bound_socket(host, port).close()
    except OSError as e:
        raise SystemExit(f"labkit server: cannot listen on {host}:{port}: {e.strerror}") from None


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
    runtime = MainRuntime(args, launcher, tokenizer, model_name_of(args))
    for sig in (signal.SIGINT, signal.SIGTERM):  # so the children are still taken down below
        signal.signal(sig, exit_cleanly)
    try:
        return serve(runtime)
    finally:
        launcher.shutdown()
        runtime.save_trace()


if __name__ == "__main__":
    sys.exit(main())
