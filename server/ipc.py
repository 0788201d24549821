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
    tokenizer_ipc: str  # TokenizerManager <- DetokenizerManager (outputs), Scheduler and peers (replies)
    scheduler_ipc: str  # Scheduler <- TokenizerManager
    detokenizer_ipc: str  # DetokenizerManager <- Scheduler

    @classmethod
    def create(cls) -> PortArgs:
        """A new socket directory, named after this (the main) process so that a later server can
        tell a dead server's directory from a live one's."""
        # mkdtemp makes it 0700: only this user connects.
        d = tempfile.mkdtemp(prefix=f"{IPC_DIR_PREFIX}{os.getpid()}-")
        return cls(d, f"ipc://{d}/tokenizer", f"ipc://{d}/scheduler", f"ipc://{d}/detokenizer")

    def scheduler_ipc_of(self, dp_rank: int) -> str:
        """The socket of data-parallel replica `dp_rank`'s scheduler (replica 0's is scheduler_ipc)."""
        return self.scheduler_ipc if dp_rank == 0 else f"{self.scheduler_ipc}-{dp_rank}"

    def tokenizer_ipc_of(self, worker: int) -> str:
        """The socket of tokenizer worker `worker` (worker 0, the main process, has tokenizer_ipc)."""
        return self.tokenizer_ipc if worker == 0 else f"{self.tokenizer_ipc}-{worker}"

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


IPC_DIR_PREFIX = "labkit-ipc-"


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove the socket directories of servers whose main process is gone (killed before it could
    clean up); returns what was removed. Only this user's directories are touched."""
    root = root or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(root):
        pid = _owner_pid(entry.name)
        if pid is None or not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
            continue
        if not _pid_alive(pid):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _owner_pid(name: str) -> int | None:
    if not name.startswith(IPC_DIR_PREFIX):
        return None
    pid = name[len(IPC_DIR_PREFIX) :].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


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
    import faulthandler
    import logging
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` prints where it is
    logging.basicConfig(level=log_level.upper(), format=f"[%(asctime)s {name}] %(levelname)s %(message)s")
