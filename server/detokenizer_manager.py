"""The detokenizer process (station 9): token ids from the scheduler -> text pieces for the
TokenizerManager, with one IncrementalDetokenizer per live request (dropped when it finishes)."""
from __future__ import annotations

import logging
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import zmq

from labkit.io_struct import BatchStrOutput, BatchTokenIDOutput, TraceChunk
from labkit.model_loader.loader import load_tokenizer, resolve_model_dir
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
                    self.tokenizer, stop=p.stop, skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens)
            piece = detok.feed(out.token_ids) if detok is not None and out.token_ids else ""
            if out.finish_reason is not None:
                if detok is not None:
                    piece += detok.finish()
                self.decode_status.pop(out.rid, None)
            out.text, out.detokenize = piece, None
            if self.trace:
                events.append(StationEvent(out.rid, Station.DETOKENIZE, start, time.perf_counter(), None, {
                    "token_ids": out.token_ids, "piece": piece, "finish_reason": out.finish_reason}))
        trace = batch.trace
        if events:
            trace = trace or TraceChunk()
            trace.events.extend(events)
        return BatchStrOutput(outputs=batch.outputs, trace=trace)


def run_detokenizer_process(args: ServerArgs, ports: PortArgs, ready: Connection, parent_pid: int) -> None:
    init_child("detokenizer", args.log_level)
    try:
        cfg = args.engine
        tokenizer = load_tokenizer(resolve_model_dir(cfg.model_path)) if cfg.load_format != "dummy" else None
        manager = DetokenizerManager(tokenizer, trace=cfg.enable_trace)
        ctx = zmq.Context()
        recv = pull_socket(ctx, ports.detokenizer_ipc)
        send = push_socket(ctx, ports.tokenizer_ipc)
    except Exception as e:
        traceback.print_exc()
        ready.send({"error": f"{type(e).__name__}: {e}"})
        return
    ready.send({"info": {}})
    decoder = msgspec.msgpack.Decoder(BatchTokenIDOutput)
    while parent_alive(parent_pid):
        if recv.poll(IDLE_POLL_MS):
            send.send(ENCODER.encode(manager.handle(decoder.decode(recv.recv()))))
    logger.info("main process gone; detokenizer exits")
