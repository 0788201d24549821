"""TokenizerManager (main process): tokenizes and validates requests (stations 2-4), keeps
rid -> ReqState, and hands each request's outputs to the HTTP handler waiting on it.

`submit` checks and sends a request (raising before any response is started, so bad input becomes a
4xx); `stream` yields its outputs as they arrive and aborts it in the scheduler if the consumer
goes away first (client disconnect, cancellation).

With --tokenizer-worker-num N there are N of these, one per HTTP process (worker 0 in the main
process). Each owns the requests it submitted; every message it sends names its worker, so that the
outputs and replies come back to it. What spans workers (an abort by id, metrics, requests in flight)
it asks the others for with a PeerReq."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from labkit.distributed.dp_controller import DataParallelController
from labkit.io_struct import (
    AbortReq,
    BatchStrOutput,
    ControlOutput,
    ControlReq,
    GenerateReqInput,
    PeerReq,
    ReqOutput,
    TokenizedGenerateReqInput,
    ToTokenizer,
)
from labkit.scheduler.limits import RequestLimits
from labkit.server.ipc import ENCODER, PortArgs, pull_socket, push_socket
from labkit.server.metrics import ServerMetrics
from labkit.tokenizer.prompt import max_chars_per_token, tokenize_request
from labkit.trace.events import Station
from labkit.trace.recorder import Tracer

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there
ABORT_CONFIRM_S = 5.0  # how long `abort` waits for the scheduler's answer (one step, normally)
PEER_TIMEOUT_S = ABORT_CONFIRM_S + 5.0  # how long a question to the other tokenizer workers may take


class QueueFullError(Exception):
    """More requests are in flight than --max-running-requests + --max-queued-requests."""


class ServerDeadError(Exception):
    """A child process died; nothing more can be served."""


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    created: float
    pending: list[ReqOutput] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    finished: bool = False
    error: str | None = None
    last_token_time: float | None = None
    group: str | None = None  # the OpenAI response id whose choice this is
    probe: bool = False  # a health probe: not counted against the queue cap
    finish_reason: dict[str, Any] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set once it finished (or serving stopped)


class TokenizerManager:
    def __init__(
        self,
        tokenizer,
        ports: PortArgs,
        info: dict[str, Any],
        max_in_flight: int | None,
        tracer: Tracer | None = None,
        dp_size: int = 1,
        load_balance: str = "round_robin",
        worker: int = 0,
        workers: int = 1,
    ):
        self.tokenizer = tokenizer
        self.worker = worker
        self.limits = RequestLimits(**info["limits"])
        # Longer text prompts cannot fit the context whatever their tokens: refused before tokenizing.
        self.max_prompt_chars = None if tokenizer is None else self.limits.context_len * max_chars_per_token(tokenizer)
        self.info = info
        self.max_in_flight = max_in_flight
        self.tracer = tracer
        self.metrics = ServerMetrics()
        self.rid_to_state: dict[str, ReqState] = {}
        self.dead: str | None = None  # why serving stopped, once a child died
        self.last_finish_time = float("-inf")  # perf_counter of the last request that finished normally
        self._control: dict[str, asyncio.Future] = {}
        self._probe: asyncio.Future[bool] | None = None  # the health probe in flight, shared by its callers
        # One scheduler per data-parallel replica; the controller picks each request's.
        self._sends = [push_socket(zmq.Context.instance(), ports.scheduler_ipc_of(d)) for d in range(dp_size)]
        self.dp = DataParallelController(dp_size, load_balance)
        self._recv = pull_socket(zmq.asyncio.Context.instance(), ports.tokenizer_ipc_of(worker))
        self._decoder = msgspec.msgpack.Decoder(ToTokenizer)
        self._peers = {
            w: push_socket(zmq.Context.instance(), ports.tokenizer_ipc_of(w)) for w in range(workers) if w != worker
        }
        self._answering: set[asyncio.Task] = set()  # peers' questions being answered (kept referenced)

    # ---- requests -----------------------------------------------------------------------------
    async def submit(
        self, reqs: list[GenerateReqInput], group: str | None = None, probe: bool = False
    ) -> list[ReqState]:
        """Tokenize, validate and send; all or none. `group`: the OpenAI response id of these
        choices; `probe`: health probes, outside the queue cap. Raises ValueError (bad input, a 400),
        QueueFullError (503) or ServerDeadError (503)."""
        self._check_capacity(len(reqs), probe)
        rids = [req.rid or uuid.uuid4().hex for req in reqs]
        # Only client-given rids can clash: OpenAI choices' and probes' are made here from uuid4.
        if self._peers and group is None and not probe:
            await self._check_peers_free([req.rid for req in reqs if req.rid])
        # Tokenizing costs CPU time in proportion to the prompt: a worker thread does it (the fast
        # tokenizers release the GIL), so the event loop keeps serving other requests meanwhile.
        # Token-id prompts are only checked, which costs less than the hop to a thread.
        if all(req.input_ids is not None for req in reqs):
            encoded = self._encode_all(reqs, rids)
        else:
            encoded = await asyncio.to_thread(self._encode_all, reqs, rids)
        self._check_capacity(len(reqs), probe)  # things may have changed while tokenizing
        for rid in rids:
            if rid in self.rid_to_state:
                raise ValueError(f"request id {rid!r} is already in use")
        states = []
        for tok, msg in encoded:
            self._sends[self.dp.route(tok.rid, tok.input_ids)].send(msg)
            now = time.perf_counter()
            state = ReqState(tok.rid, len(tok.input_ids), created=tok.received_time, group=group, probe=probe)
            self.rid_to_state[tok.rid] = state
            states.append(state)
            if self.tracer is not None:
                self.tracer.station(tok.rid, Station.ZMQ_SEND, tok.created_time, now, message_bytes=len(msg))
        return states

    async def _check_peers_free(self, given_rids: list[str]) -> None:
        """ValueError if another tokenizer worker has one of these client-given rids in flight. Two
        workers taking the same rid at once are left to the scheduler, which refuses the second:
        that client gets an abort instead of the 400."""
        try:  # one round trip for all of them, not one per rid
            answers = await asyncio.gather(*(self.ask_peers("in_use", rid) for rid in given_rids))
        except asyncio.TimeoutError:
            raise ServerDeadError("the other tokenizer workers did not answer") from None
        for rid, theirs in zip(given_rids, answers):
            if any(a.data["in_use"] for a in theirs):
                raise ValueError(f"request id {rid!r} is already in use")

    def _check_capacity(self, n: int, probe: bool) -> None:
        if self.dead:
            raise ServerDeadError(self.dead)
        if not probe and self.max_in_flight is not None:
            in_flight = sum(not s.probe for s in self.rid_to_state.values())
            if in_flight + n > self.max_in_flight:
                raise QueueFullError(f"{in_flight} requests in flight; the limit is {self.max_in_flight}")

    def _encode_all(
        self, reqs: list[GenerateReqInput], rids: list[str]
    ) -> list[tuple[TokenizedGenerateReqInput, bytes]]:
        """Every request tokenized, checked and msgspec-encoded before any is sent: all or none."""
        encoded = []
        for req, rid in zip(reqs, rids):
            tok = tokenize_request(self.tokenizer, req, rid, self.limits, self.tracer, self.max_prompt_chars)
            tok.worker = self.worker
            encoded.append((tok, ENCODER.encode(tok)))
        return encoded

    async def stream(
        self, state: ReqState, is_disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[ReqOutput]:
        """Yield the request's outputs until it finishes: at each wake-up, what arrived since the last
        one as one output (ReqOutput.merge), so a handler that falls behind the scheduler catches up
        in one chunk instead of one per step. Raises ServerDeadError if serving stopped. Leaving
        early (disconnect, cancellation, an error) aborts the request in the scheduler."""
        checked = time.perf_counter()
        try:
            while True:
                if is_disconnected is None:
                    await state.event.wait()
                else:
                    try:
                        await asyncio.wait_for(state.event.wait(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        pass
                    # Checked by the clock, not only on timeouts: outputs may arrive faster than the poll.
                    if time.perf_counter() - checked >= DISCONNECT_POLL_S:
                        checked = time.perf_counter()
                        if await is_disconnected():
                            logger.info("client of %s disconnected; aborting it", state.rid)
                            return
                if not state.event.is_set():
                    continue
                state.event.clear()
                if state.error is not None:
                    raise ServerDeadError(state.error)
                outputs, state.pending = state.pending, []
                if outputs:
                    yield ReqOutput.merge(outputs)
                if state.finished:
                    return
        finally:
            if not state.finished:
                self.abort_request(state.rid)

    def abort_request(self, rid: str) -> bool:
        """Ask the scheduler to abort; its KV and request slot come back at its next step."""
        replica = self.dp.replica_of(rid)
        if rid not in self.rid_to_state or self.dead or replica is None:
            return False
        self._sends[replica].send(ENCODER.encode(AbortReq(rid=rid)))
        return True

    async def abort(self, rid: str, timeout: float = ABORT_CONFIRM_S) -> list[str]:
        """Abort the request `rid`, or every choice of the OpenAI response `rid`, whichever tokenizer
        worker has it. Returns the rids the scheduler aborted (within `timeout`): not those that
        finished first."""
        mine, theirs = await asyncio.gather(
            self._abort_own(rid, timeout), self.ask_peers("abort", rid, timeout=timeout + PEER_TIMEOUT_S)
        )
        return mine + [r for answer in theirs for r in answer.data["aborted"]]

    async def _abort_own(self, rid: str, timeout: float) -> list[str]:
        states = [s for r, s in self.rid_to_state.items() if r == rid or s.group == rid]
        for state in states:
            self.abort_request(state.rid)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(s.done.wait() for s in states)), timeout)
        return [s.rid for s in states if s.finish_reason is not None and s.finish_reason["type"] == "abort"]

    async def generate_one_token(self, timeout: float) -> bool:
        """The health probe: one greedy token through all three processes. Concurrent callers share
        the probe in flight, so a burst of probes costs one generation."""
        if self._probe is None:
            self._probe = asyncio.ensure_future(self._generate_one_token(timeout))
        return await asyncio.shield(self._probe)  # a caller that leaves does not cancel the others' probe

    async def _generate_one_token(self, timeout: float) -> bool:
        try:
            [state] = await self.submit(
                [
                    GenerateReqInput(
                        input_ids=[0],
                        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                        rid=f"health-{uuid.uuid4().hex}",
                    )
                ],
                probe=True,
            )

            async def collect() -> list[ReqOutput]:
                return [o async for o in self.stream(state)]

            outs = await asyncio.wait_for(collect(), timeout)  # on timeout the request is aborted
        except (ServerDeadError, asyncio.TimeoutError, ValueError):
            return False
        finally:
            self._probe = None  # the next caller starts a new probe
        return bool(outs) and outs[-1].finish_reason is not None and outs[-1].finish_reason["type"] != "abort"

    # ---- control --------------------------------------------------------------------------------
    async def control(self, action: str, timeout: float = 30.0) -> ControlOutput:
        """Ask every replica's scheduler; one answer (with data parallelism: ok if all are, their
        data merged by merge_replica_info, each replica's under "replicas")."""
        questions = [(sock, ControlReq(req_id="", action=action, worker=self.worker)) for sock in self._sends]
        outs = await self._ask(questions, timeout)
        if len(outs) == 1:
            return outs[0]
        failed = [o.message for o in outs if not o.ok]
        data = merge_replica_info([o.data for o in outs]) if action == "get_info" else {}
        return ControlOutput(req_id=outs[0].req_id, ok=not failed, data=data, message="; ".join(failed))

    async def _ask(self, questions: list[tuple[zmq.Socket, ControlReq | PeerReq]], timeout: float) -> list:
        """Send each (socket, message) under a fresh req_id and wait for every ControlOutput answer,
        in order. Raises asyncio.TimeoutError, or ServerDeadError once serving stopped."""
        if self.dead:
            raise ServerDeadError(self.dead)
        loop = asyncio.get_running_loop()
        req_ids = []
        for sock, msg in questions:
            msg.req_id = uuid.uuid4().hex
            req_ids.append(msg.req_id)
            self._control[msg.req_id] = loop.create_future()
            sock.send(ENCODER.encode(msg))
        try:
            return await asyncio.wait_for(asyncio.gather(*(self._control[r] for r in req_ids)), timeout)
        finally:
            for req_id in req_ids:
                self._control.pop(req_id, None)

    # ---- the other tokenizer workers ------------------------------------------------------------
    async def ask_peers(self, action: str, rid: str = "", timeout: float = PEER_TIMEOUT_S) -> list[ControlOutput]:
        """Every other tokenizer worker's answer to `action` (see PeerReq); [] with one worker."""
        if not self._peers:
            return []
        questions = [
            (sock, PeerReq(req_id="", worker=self.worker, action=action, rid=rid)) for sock in self._peers.values()
        ]
        return await self._ask(questions, timeout)

    def stats(self) -> dict[str, Any]:
        """This worker's part of the server's figures (a PeerReq "stats" answer)."""
        return {
            "worker": self.worker,
            "pid": os.getpid(),
            "in_flight": len(self.rid_to_state),
            "metrics": self.metrics.snapshot(),
            "dp_routed_requests": self.dp.routed_counts,
        }

    async def all_stats(self) -> list[dict[str, Any]]:
        """Every tokenizer worker's stats, this one's first."""
        return [self.stats(), *(answer.data for answer in await self.ask_peers("stats"))]

    def _answer_peer(self, req: PeerReq) -> None:
        async def answer() -> None:
            out = ControlOutput(req_id=req.req_id, ok=True)
            if req.action == "abort":
                out.data = {"aborted": await self._abort_own(req.rid, ABORT_CONFIRM_S)}
            elif req.action == "stats":
                out.data = self.stats()
            elif req.action == "in_use":
                out.data = {"in_use": req.rid in self.rid_to_state}
            else:
                out.ok, out.message = False, f"unknown action {req.action!r}"
            self._peers[req.worker].send(ENCODER.encode(out))

        task = asyncio.create_task(answer())
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    # ---- the receive loop -----------------------------------------------------------------------
    async def handle_loop(self) -> None:
        while True:
            msg = self._decoder.decode(await self._recv.recv())
            if isinstance(msg, ControlOutput):
                future = self._control.get(msg.req_id)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, BatchStrOutput):
                self._dispatch(msg)
            elif isinstance(msg, PeerReq):
                self._answer_peer(msg)

    def _dispatch(self, batch: BatchStrOutput) -> None:
        now = time.perf_counter()
        if batch.trace is not None and self.tracer is not None:
            batch.trace.into(self.tracer)
        m = self.metrics
        for out in batch.outputs:
            state = self.rid_to_state.get(out.rid)
            if state is None:
                continue
            if out.token_ids:
                if state.last_token_time is None:
                    m.ttft.observe(now - state.created)
                    m.inc("cached_tokens_total", out.cached_tokens)
                else:
                    m.itl.observe((now - state.last_token_time) / len(out.token_ids))
                state.last_token_time = now
                m.inc("generation_tokens_total", len(out.token_ids))
            if out.spec_draft_tokens:
                m.inc("spec_verify_steps_total")
                m.inc("spec_draft_tokens_total", out.spec_draft_tokens)
                m.inc("spec_accepted_tokens_total", out.spec_accepted_tokens)
            if out.finish_reason is not None:
                self.dp.finish(out.rid)
                state.finished, state.finish_reason = True, out.finish_reason
                state.done.set()
                del self.rid_to_state[out.rid]
                m.e2e.observe(now - state.created)
                m.inc("prompt_tokens_total", state.prompt_tokens)
                if out.finish_reason["type"] == "abort":
                    m.inc("aborted_requests_total")
                else:
                    m.inc("requests_total")
                    self.last_finish_time = now
            state.pending.append(out)
            state.event.set()

    def close(self) -> None:
        """Close the sockets (the process's exit does it in the server)."""
        for sock in [*self._sends, *self._peers.values()]:
            sock.close(linger=0)
        self._recv.close(linger=0)

    def fail_all(self, reason: str) -> None:
        """A child died: every waiting handler gets an error now, and new requests are refused."""
        self.dead = reason
        for state in list(self.rid_to_state.values()):
            state.error = reason
            state.event.set()
            state.done.set()
        self.rid_to_state.clear()
        for future in self._control.values():
            if not future.done():
                future.set_exception(ServerDeadError(reason))


def merge_replica_info(datas: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' get_info data as one: counts summed (the pool's too), token usage recomputed
    from the summed pool, and each replica's own under "replicas"."""
    merged: dict[str, Any] = {"replicas": datas}
    for key in ("running", "waiting", "cached_tokens_in_tree"):
        merged[key] = sum(d[key] for d in datas)
    for key in ("pool", "req_slots"):
        merged[key] = {k: sum(d[key][k] for d in datas) for k in datas[0][key]}
    pool = merged["pool"]
    merged["token_usage"] = (pool["protected"] + pool["request_owned"]) / pool["total"]
    return merged
