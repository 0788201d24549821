"""The scheduler process: the engine's own Scheduler + ModelRunner behind ZMQ (stations 5-8).

Its event loop: receive requests (blocking only when idle), add/abort them, run one scheduler step,
send the step's tokens to the detokenizer. Control requests (get_info, flush_cache) are answered
straight to the TokenizerManager between steps.

With tensor parallelism there is one such process per rank: rank 0 runs this loop (and hands its
inputs on to the others at each step, or every idle poll), ranks 1.. follow it and talk to no socket
(labkit.scheduler.tp_sync). With data parallelism each replica has its own rank 0 and socket."""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import zmq

from labkit.config import EngineConfig, ranks_per_node
from labkit.distributed.parallel_state import TPGroup, init_tp_group
from labkit.io_struct import (
    AbortReq,
    BatchTokenIDOutput,
    ControlOutput,
    ControlReq,
    ReqOutput,
    TokenizedGenerateReqInput,
    ToScheduler,
    TraceChunk,
)
from labkit.model_executor.model_runner import resolve_device
from labkit.scheduler.scheduler import Scheduler, StepOutput
from labkit.server.ipc import ENCODER, PortArgs, init_child, parent_alive, pull_socket, push_socket
from labkit.server.server_args import ServerArgs
from labkit.trace.recorder import Tracer

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 500  # how often an idle scheduler checks that the main process is still there


@dataclass(frozen=True)
class RankPlace:
    """Where a scheduler process sits: its data-parallel replica, its rank in the replica's
    tensor-parallel group, and that group's rendezvous address."""

    dp_rank: int = 0
    tp_rank: int = 0
    init_addr: str = ""

    @property
    def name(self) -> str:
        parts = ["scheduler"]
        if self.dp_rank:
            parts.append(f"dp{self.dp_rank}")
        if self.tp_rank:
            parts.append(f"tp{self.tp_rank}")
        return "-".join(parts)


def run_scheduler_process(
    args: ServerArgs, ports: PortArgs, ready: Connection, parent_pid: int, place: RankPlace = RankPlace()
) -> None:
    init_child(place.name, args.log_level)
    config = args.engine
    try:
        device = resolve_device(config.device, place.tp_rank % ranks_per_node(config))
        tp = init_tp_group(
            place.tp_rank, config.tp_size, place.init_addr, device, config.dist_timeout, ep_size=config.ep_size
        )
        if tp.is_leader:
            loop = SchedulerLoop.create(config, ports, tp, place.dp_rank, args.tokenizer_worker_num)
        else:
            loop, follower = None, Scheduler.from_config(config, _tracer(config), tp)
    except Exception as e:  # report why start-up failed, then exit
        traceback.print_exc()
        ready.send({"error": f"{type(e).__name__}: {e}"})
        return
    if loop is None:
        ready.send({"info": {"pid": os.getpid(), "tp_rank": place.tp_rank}})
        follower.follow_leader()
        return
    ready.send({"info": loop.info()})
    loop.run(parent_pid)
    ports.cleanup()  # the main process is gone (killed?) and left its socket directory


def _tracer(config: EngineConfig) -> Tracer | None:
    # Tree snapshots stay in-process (labkit.viz replays Engine runs); the server ships the rest.
    return Tracer(record_snapshots=False) if config.enable_trace else None


class SchedulerLoop:
    """The scheduler's event loop: its Scheduler and the ZMQ sockets it reads and writes."""

    def __init__(self, scheduler: Scheduler, ports: PortArgs, dp_rank: int = 0, workers: int = 1):
        self.scheduler = scheduler
        self.ctx = zmq.Context()
        self.recv_from_tokenizer = pull_socket(self.ctx, ports.scheduler_ipc_of(dp_rank))
        self.send_to_detokenizer = push_socket(self.ctx, ports.detokenizer_ipc)
        # Control replies go straight to the asking tokenizer worker.
        self.send_to_tokenizer = [push_socket(self.ctx, ports.tokenizer_ipc_of(w)) for w in range(workers)]
        self.decoder = msgspec.msgpack.Decoder(ToScheduler)

    @classmethod
    def create(
        cls, config: EngineConfig, ports: PortArgs, tp: TPGroup | None = None, dp_rank: int = 0, workers: int = 1
    ) -> SchedulerLoop:
        """Load the model and build the scheduler (with a tracer if config.enable_trace), bound to
        `ports` as replica `dp_rank`'s scheduler (rank 0 of `tp`), serving `workers` tokenizer workers."""
        return cls(Scheduler.from_config(config, _tracer(config), tp), ports, dp_rank, workers)

    def close(self) -> None:
        """Close the sockets (the process's exit does it in the server)."""
        self.ctx.destroy(linger=0)

    def info(self) -> dict:
        """Static facts the TokenizerManager needs (limits for validation) and reports."""
        s, runner = self.scheduler, self.scheduler.model_runner
        return {
            "limits": dataclasses.asdict(s.limits),
            "page_size": s.page_size,
            "device": str(runner.device),
            "dtype": str(runner.dtype).replace("torch.", ""),
            "req_slots": runner.req_to_token_pool.size,
            "pid": os.getpid(),
        }

    def run(self, parent_pid: int) -> None:
        while parent_alive(parent_pid):
            self.run_once(IDLE_POLL_MS)
        logger.info("main process gone; scheduler exits")
        self.scheduler.broadcast_inputs(stop=True)

    def run_once(self, idle_poll_ms: int) -> bool:
        """One turn: take the messages that arrived (waiting up to idle_poll_ms if there is no work),
        then run one scheduler step, if there is work, and send its outputs to the detokenizer.
        Returns whether a message went to the detokenizer."""
        for msg in self.recv_requests(idle_poll_ms):
            self.process_input_request(msg)
        if not self.scheduler.has_work():
            self.scheduler.broadcast_inputs()  # the inputs (and a heartbeat) to the other ranks
            return False
        return self.send_outputs(self.scheduler.step())

    def recv_requests(self, idle_poll_ms: int) -> list:
        timeout = 0 if self.scheduler.has_work() else idle_poll_ms
        msgs = []
        if self.recv_from_tokenizer.poll(timeout):
            while True:
                try:
                    msgs.append(self.decoder.decode(self.recv_from_tokenizer.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return msgs

    def process_input_request(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            try:
                self.scheduler.add_request(msg)
            except ValueError as e:  # the TokenizerManager validates first; this is the safety net
                reason = {"type": "abort", "matched": None, "message": str(e)}
                refused = ReqOutput(rid=msg.rid, token_ids=[], finish_reason=reason, worker=msg.worker)
                self._send(BatchTokenIDOutput(outputs=[refused]))
        elif isinstance(msg, AbortReq):
            self.scheduler.abort_request(msg.rid)
        elif isinstance(msg, ControlReq):
            self.send_to_tokenizer[msg.worker].send(ENCODER.encode(self.control(msg)))

    def control(self, req: ControlReq) -> ControlOutput:
        s = self.scheduler
        if req.action == "flush_cache":
            try:
                s.flush_cache()
            except RuntimeError as e:
                return ControlOutput(req_id=req.req_id, ok=False, message=str(e))
            return ControlOutput(req_id=req.req_id, ok=True)
        if req.action == "get_info":
            pool = s.pool_usage()
            slots = s.req_to_token_pool
            return ControlOutput(
                req_id=req.req_id,
                ok=True,
                data={
                    "running": len(s.running) + (s.chunked_req is not None),
                    "waiting": len(s.waiting_queue),
                    "pool": dataclasses.asdict(pool),
                    "token_usage": (pool.protected + pool.request_owned) / pool.total,
                    "req_slots": {"total": slots.size, "free": slots.available_size()},
                    "cached_tokens_in_tree": s.tree_cache.evictable_size() + s.tree_cache.protected_size(),
                    "host_pool": dataclasses.asdict(host) if (host := s.tree_cache.tier_usage()) else None,
                },
            )
        return ControlOutput(req_id=req.req_id, ok=False, message=f"unknown action {req.action!r}")

    def send_outputs(self, out: StepOutput) -> bool:
        """The step's tokens (and trace records) to the detokenizer; whether there was anything to send."""
        batch = self.scheduler.stream_output(out)
        batch.trace = TraceChunk.drain(self.scheduler.tracer)
        return self._send(batch)

    def _send(self, batch: BatchTokenIDOutput) -> bool:
        if not batch.outputs and batch.trace is None:
            return False
        self.send_to_detokenizer.send(ENCODER.encode(batch))
        return True
