"""Tensor parallelism, scheduler side: one Scheduler per rank, all making the same decisions.

Rank 0 (the leader) takes the requests. Every input it accepts (a request, an abort, a call such as
flush_cache) is also queued for the other ranks (the followers); each `step()` of the leader first
broadcasts what was queued, with "step", over the group's CPU (gloo) group. A follower applies the
inputs through the same methods, in the same order, then steps: same queue, same radix tree, same
pool, same batches, each rank computing its own heads. Only the leader reports outputs.

Scheduling decisions read no per-process randomness (policies are seeded) and no clock but the
leader's step times, whose table each packet carries (speculative decoding), so equal inputs give
equal decisions; sampling uses the same seeds on every rank, so the sampled tokens
agree (tests/distributed check both)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from labkit.io_struct import AbortReq, TokenizedGenerateReqInput, TraceChunk

if TYPE_CHECKING:
    from labkit.distributed.parallel_state import TPGroup
    from labkit.speculative.step_costs import StepCosts
    from labkit.trace.recorder import Tracer


class SchedulerCall(msgspec.Struct, kw_only=True, tag=True):
    """A scheduler method to replay on the followers: flush_cache, reset, set_policy."""

    method: str
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


class StepPacket(msgspec.Struct, kw_only=True):
    """What the leader broadcasts: the inputs it took since the last packet, then whether to step
    (False: a heartbeat or a flush of inputs only) or to stop following."""

    inputs: list[TokenizedGenerateReqInput | AbortReq | SchedulerCall]
    step: bool = False
    stop: bool = False
    # Speculative decoding: the leader's measured break-even table and batch shares (StepCosts.table,
    # .shares), which the followers decide by: step times are the one clock reading a scheduling
    # decision depends on.
    spec_break_even: dict[int, float] | None = None
    spec_batch_share: dict[int, float] | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(StepPacket)
_CHUNK_DECODER = msgspec.msgpack.Decoder(TraceChunk)
REPLAYED_CALLS = ("flush_cache", "reset", "set_policy")


class SchedulerTPMixin:
    """Mixed into Scheduler, which provides `tp`, `tracer` and the methods the inputs replay."""

    tp: TPGroup
    tracer: Tracer | None
    step_costs: StepCosts
    _tp_outbox: list[TokenizedGenerateReqInput | AbortReq | SchedulerCall]

    def _mirror(self, msg: TokenizedGenerateReqInput | AbortReq | SchedulerCall) -> None:
        """Queue an input the leader accepted, for the followers."""
        if self.tp.size > 1 and self.tp.is_leader:
            self._tp_outbox.append(msg)

    def broadcast_inputs(self, step: bool = False, stop: bool = False) -> None:
        """Leader: send the queued inputs (and whether to step or stop) to the followers. The server
        calls it while idle too, so the followers never wait long in a collective."""
        if self.tp.size == 1 or not self.tp.is_leader:
            return
        costs, shares = self.step_costs.table or None, self.step_costs.shares or None  # empty without speculation
        packet = StepPacket(
            inputs=self._tp_outbox, step=step, stop=stop, spec_break_even=costs, spec_batch_share=shares
        )
        self._tp_outbox = []
        self.tp.broadcast_bytes(_ENCODER.encode(packet))

    def follow_leader(self) -> None:
        """Follower: apply the leader's inputs and step with it, until it says stop (or it is gone,
        which raises from the collective)."""
        while True:
            packet = _DECODER.decode(self.tp.broadcast_bytes(None))
            for msg in packet.inputs:
                self._replay(msg)
            if packet.stop:
                return
            if packet.spec_break_even is not None:
                self.step_costs.table = packet.spec_break_even
            if packet.spec_batch_share is not None:
                self.step_costs.shares = packet.spec_batch_share
            if packet.step:
                self.step()  # type: ignore[attr-defined]  # Scheduler.step

    def _replay(self, msg: TokenizedGenerateReqInput | AbortReq | SchedulerCall) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)  # type: ignore[attr-defined]
        elif isinstance(msg, AbortReq):
            self.abort_request(msg.rid)  # type: ignore[attr-defined]
        elif msg.method in REPLAYED_CALLS:
            getattr(self, msg.method)(**msg.kwargs)

    def gather_step_records(self) -> None:
        """With tracing, every rank's step records end up in the leader's tracer (one track per rank
        in the Perfetto export); the followers' other records repeat the leader's and are dropped.
        Every rank calls it at the end of each step."""
        if self.tp.size == 1 or self.tracer is None:
            return
        mine = b""
        if not self.tp.is_leader:
            drained = TraceChunk.drain(self.tracer)
            mine = _ENCODER.encode(TraceChunk(steps=drained.steps)) if drained is not None else b""
        chunks = self.tp.gather_bytes(mine)
        if self.tp.is_leader:
            for data in chunks[1:]:
                if data:
                    self.tracer.rank_steps.extend(_CHUNK_DECODER.decode(data).steps)
