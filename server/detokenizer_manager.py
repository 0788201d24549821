"""The detokenizer process (station 9): token ids from the scheduler -> text pieces for the
TokenizerManager, with one IncrementalDetokenizer per live request (dropped when it finishes)."""

from __future__ import annotations

import logging
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import zmq

from labkit.config import EngineConfig
from labkit.io_struct import BatchStrOutput, BatchTokenIDOutput, TraceChunk
from labkit.model_loader.loader import model_dir_and_tokenizer
from labkit.server.ipc import ENCODER, PortArgs, init_child, parent_alive, pull_socket, push_socket
from labkit.server.server_args import ServerArgs
from labkit.tokenizer.detokenizer import IncrementalDetokenizer
from labkit.trace.events import Station, StationEvent

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 500


class DetokenizerManager:
    def __init__(self, tokenizer, trace: bool = False):
        self.tokenizer = tokenizer
        self.trace = trace
        self.decode_status: dict[str, IncrementalDetokenizer] = {}

    def handle(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        events = []
        for out in batch.outputs:
            start = time.perf_counter()
            detok = self.decode_status.get(out.rid)
            if detok is None and out.detokenize is not None and self.tokenizer is not None:
                p = out.detokenize
                detok = self.decode_status[out.rid] = IncrementalDetokenizer(
                    self.tokenizer,
                    stop=p.stop,
                    skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens,
                )
            piece = detok.feed(out.token_ids) if detok is not None and out.token_ids else ""
            if out.finish_reason is not None:
                if detok is not None:
                    piece += detok.finish()
                self.decode_status.pop(out.rid, None)
            out.text, out.detokenize = piece, None
            if self.trace:
                token = out.token_ids[-1] if out.token_ids else None  # at most one per step
                events.append(
                    StationEvent(
                        out.rid,
                        Station.DETOKENIZE,
                        start,
                        time.perf_counter(),
                        None,
                        {"token": token, "piece": piece, "finish_reason": out.finish_reason},
                    )
                )
        trace = batch.trace
        if events:
            trace = trace or TraceChunk()
            trace.events.extend(events)
        return BatchStrOutput(outputs=batch.outputs, trace=trace)


class DetokenizerLoop:
    """The detokenizer's event loop: a DetokenizerManager between the ZMQ socket it reads (the
    scheduler's BatchTokenIDOutput) and the one it writes (BatchStrOutput to the TokenizerManager)."""

    def __init__(self, manager: DetokenizerManager, ports: PortArgs):
        self.manager = manager
        self.ctx = zmq.Context()
        self.recv_from_scheduler = pull_socket(self.ctx, ports.detokenizer_ipc)
        self.send_to_tokenizer = push_socket(self.ctx, ports.tokenizer_ipc)
        self.decoder = msgspec.msgpack.Decoder(BatchTokenIDOutput)

    @classmethod
    def create(cls, config: EngineConfig, ports: PortArgs) -> DetokenizerLoop:
        """Load the model's tokenizer (none for dummy weights) and bind to `ports`."""
        _, tokenizer = model_dir_and_tokenizer(config.model_path, config.load_format)
        return cls(DetokenizerManager(tokenizer, trace=config.enable_trace), ports)

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
        """Decode one message from the scheduler, detokenize it and send the result on."""
        out = self.manager.handle(self.decoder.decode(raw))
        self.send_to_tokenizer.send(ENCODER.encode(out))
        return out


def run_detokenizer_process(args: ServerArgs, ports: PortArgs, ready: Connection, parent_pid: int) -> None:
    init_child("detokenizer", args.log_level)
    try:
        loop = DetokenizerLoop.create(args.engine, ports)
    except Exception as e:
        traceback.print_exc()
        ready.send({"error": f"{type(e).__name__}: {e}"})
        return
    ready.send({"info": {}})
    loop.run(parent_pid)
