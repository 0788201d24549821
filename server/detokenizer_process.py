"""The detokenizer process (station 9): labkit's DetokenizerManager between the scheduler (token ids)
and the TokenizerManager (text pieces), over ZMQ. Its trace records travel on with each message."""

from __future__ import annotations

import logging
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from labkit.config import EngineConfig
from labkit.io_struct import BatchStrOutput, BatchTokenIDOutput, ReqOutput, TraceChunk
from labkit.model_loader.loader import model_dir_and_tokenizer
from labkit.server.ipc import ENCODER, PortArgs, init_child, parent_alive, pull_socket, push_socket
from labkit.server.server_args import ServerArgs
from labkit.tokenizer.detokenizer_manager import DetokenizerManager
from labkit.trace.recorder import Tracer

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 500


class DetokenizerLoop:
    """The detokenizer's event loop: a DetokenizerManager between the ZMQ socket it reads (the
    scheduler's BatchTokenIDOutput) and the one it writes (BatchStrOutput to the TokenizerManager)."""

    def __init__(self, manager: DetokenizerManager, ports: PortArgs, workers: int = 1):
        self.manager = manager
        self.ctx = zmq.Context()
        self.recv_from_scheduler = pull_socket(self.ctx, ports.detokenizer_ipc)
        self.send_to_tokenizer = [push_socket(self.ctx, ports.tokenizer_ipc_of(w)) for w in range(workers)]
        self.decoder = msgspec.msgpack.Decoder(BatchTokenIDOutput)

    @classmethod
    def create(cls, config: EngineConfig, ports: PortArgs, tokenizer: Any, workers: int = 1) -> DetokenizerLoop:
        """Bind to `ports`, detokenizing with `tokenizer` (None for dummy weights: no text), for
        `workers` tokenizer workers."""
        tracer = Tracer(record_snapshots=False) if config.enable_trace else None
        return cls(DetokenizerManager(tokenizer, tracer), ports, workers)

    def close(self) -> None:
        """Close the sockets (the process's exit does it in the server)."""
        self.ctx.destroy(linger=0)

    def run(self, parent_pid: int) -> None:
        while parent_alive(parent_pid):
            self.run_once(IDLE_POLL_MS)
        logger.info("main process gone; detokenizer exits")

    def run_once(self, poll_ms: int) -> None:
        """Handle the next message, if one arrives within poll_ms."""
        if self.recv_from_scheduler.poll(poll_ms):
            self.handle(self.recv_from_scheduler.recv())

    def handle(self, raw: bytes) -> BatchStrOutput:
        """Decode one message from the scheduler, detokenize it and send the result on: each
        request's output to its tokenizer worker. Returns the whole detokenized batch."""
        out = self.manager.handle(self.decoder.decode(raw))
        mine = TraceChunk.drain(self.manager.tracer)
        if mine is not None:
            out.trace = (out.trace or TraceChunk()).extend(mine)
        if len(self.send_to_tokenizer) == 1:
            self.send_to_tokenizer[0].send(ENCODER.encode(out))
            return out
        by_worker: dict[int, list[ReqOutput]] = {}  # (no trace: tracing needs one worker, ServerArgs.check)
        for o in out.outputs:
            by_worker.setdefault(o.worker, []).append(o)
        for worker, outputs in by_worker.items():
            self.send_to_tokenizer[worker].send(ENCODER.encode(BatchStrOutput(outputs=outputs)))
        return out


def run_detokenizer_process(args: ServerArgs, ports: PortArgs, ready: Connection, parent_pid: int) -> None:
    init_child("detokenizer", args.log_level)
    try:
        _, tokenizer = model_dir_and_tokenizer(args.engine)
        loop = DetokenizerLoop.create(args.engine, ports, tokenizer, args.tokenizer_worker_num)
    except Exception as e:
        traceback.print_exc()
        ready.send({"error": f"{type(e).__name__}: {e}"})
        return
    ready.send({"info": {"pid": os.getpid()}})
    loop.run(parent_pid)
    ports.cleanup()  # the main process is gone (killed?) and left its socket directory
