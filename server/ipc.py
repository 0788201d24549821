"""ZMQ wiring between the three processes: ipc sockets in a private directory (mode 0700), msgpack
encoding of the typed messages in labkit.io_struct (never pickle)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import msgspec
import zmq

ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class PortArgs:
    """Where each process listens (SGLang's name). Each PULL socket is bound by its owner."""

    ipc_dir: str
    tokenizer_ipc: str  # TokenizerManager <- DetokenizerManager (outputs) and Scheduler (control replies)
    scheduler_ipc: str  # Scheduler <- TokenizerManager
    detokenizer_ipc: str  # DetokenizerManager <- Scheduler

    @classmethod
    def create(cls) -> PortArgs:
        d = tempfile.mkdtemp(prefix="labkit-ipc-")  # mkdtemp makes it 0700: only this user connects
        return cls(d, f"ipc://{d}/tokenizer", f"ipc://{d}/scheduler", f"ipc://{d}/detokenizer")

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def pull_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    return sock


def push_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)  # never block exit on undelivered messages
    sock.connect(endpoint)
    return sock


def parent_alive(parent_pid: int) -> bool:
    """A child exits when the main process is gone (re-parented), so none is left behind."""
    return os.getppid() == parent_pid


def init_child(name: str, log_level: str) -> None:
    """Common start of a child process. Ctrl-C reaches the whole process group; the children ignore
    it and let the main process shut them down in order."""
    import logging
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=f"[%(asctime)s {name}] %(levelname)s %(message)s")
