"""A tokenizer worker's process (--tokenizer-worker-num N > 1): workers 1..N-1 each serve the same
app on the same port as the main process (worker 0), with their own TokenizerManager, so the HTTP
and streaming work of many connections spreads over N cores. The main process starts them once the
scheduler is up, and takes them down with the server; each exits if the main process is gone."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from labkit.model_loader.loader import model_dir_and_tokenizer
from labkit.server.ipc import PortArgs, init_child, parent_alive
from labkit.server.runtime import ServerRuntime, exit_cleanly, model_name_of, serve
from labkit.server.server_args import ServerArgs


class HTTPWorkerRuntime(ServerRuntime):
    """Worker k > 0: the scheduler's info comes from the main process; it reports in on `ready` once
    its own one-token generation went through; it fails when the main process is gone."""

    def __init__(
        self, args: ServerArgs, ports: PortArgs, tokenizer, worker: int, info: dict, ready: Connection, parent_pid: int
    ):
        super().__init__(args, ports, tokenizer, model_name_of(args), worker)
        self.info, self.ready_conn, self.parent_pid = info, ready, parent_pid

    async def scheduler_info(self) -> dict[str, Any]:
        return self.info

    async def announce(self) -> None:
        self.ready_conn.send({"info": {"pid": os.getpid()}})

    def failure(self) -> str | None:
        return None if parent_alive(self.parent_pid) else "the main process is gone"


def run_http_worker(
    args: ServerArgs, ports: PortArgs, ready: Connection, parent_pid: int, worker: int, info: dict
) -> None:
    init_child(f"http-{worker}", args.log_level)
    try:
        _, tokenizer = model_dir_and_tokenizer(args.engine)
    except Exception as e:
        traceback.print_exc()
        ready.send({"error": f"{type(e).__name__}: {e}"})
        return
    signal.signal(signal.SIGTERM, exit_cleanly)
    sys.exit(serve(HTTPWorkerRuntime(args, ports, tokenizer, worker, info, ready, parent_pid)))
