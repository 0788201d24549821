"""The messages between the stations (SGLang's names). They are msgspec Structs so that the server
can send them across processes with a schema'd, non-executable encoding (never pickle).

Server flow: TokenizerManager --TokenizedGenerateReqInput / AbortReq / control--> Scheduler
--BatchTokenIDOutput--> DetokenizerManager --BatchStrOutput--> TokenizerManager; the scheduler
answers control requests (ControlReq) straight to the TokenizerManager with ControlOutput. With
several tokenizer workers (HTTP processes), every message names its worker, and each goes back to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from labkit.trace.events import StationEvent, StepRecord, TreeEvent

if TYPE_CHECKING:
    from labkit.trace.recorder import Tracer


class GenerateReqInput(msgspec.Struct, kw_only=True):
    """What a client asks for (station 1-2). Exactly one of text, input_ids, messages."""

    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat messages: the model's chat template is applied
    tools: list[dict[str, Any]] | None = None  # with messages: OpenAI function tools, passed to the template
    sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)
    stream: bool = False
    rid: str | None = None


class TokenizedGenerateReqInput(msgspec.Struct, kw_only=True, tag=True):
    """A request after tokenization (station 3), as the scheduler receives it (station 4-5)."""

    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: dict[str, Any]
    stream: bool = False
    received_time: float = 0.0  # perf_counter when tokenizing (station 3) began
    created_time: float = 0.0  # perf_counter when it ended: the request's arrival for the scheduler
    worker: int = 0  # the tokenizer worker (HTTP process) it came from, which its outputs go back to


class AbortReq(msgspec.Struct, kw_only=True, tag=True):
    rid: str


class ControlReq(msgspec.Struct, kw_only=True, tag=True):
    """A request to the scheduler process itself: "get_info" or "flush_cache"."""

    req_id: str
    action: str
    worker: int = 0  # the tokenizer worker to answer


class PeerReq(msgspec.Struct, kw_only=True, tag=True):
    """A tokenizer worker's question to another (--tokenizer-worker-num > 1): "abort" (`rid`, as
    /abort_request), "in_use" (is `rid` in flight there) or "stats" (its metrics and requests in
    flight). Answered with a ControlOutput."""

    req_id: str
    worker: int  # the asking worker, where the answer goes
    action: str
    rid: str = ""


class ControlOutput(msgspec.Struct, kw_only=True, tag=True):
    req_id: str
    ok: bool
    data: dict[str, Any] = msgspec.field(default_factory=dict)
    message: str = ""


class TraceChunk(msgspec.Struct, kw_only=True):
    """Trace records made in a child process since its last message, shipped with it."""

    events: list[StationEvent] = msgspec.field(default_factory=list)
    steps: list[StepRecord] = msgspec.field(default_factory=list)
    rank_steps: list[StepRecord] = msgspec.field(default_factory=list)
    tree_events: list[TreeEvent] = msgspec.field(default_factory=list)

    @classmethod
    def drain(cls, tracer: Tracer | None) -> TraceChunk | None:
        """What `tracer` recorded since it was last drained (then cleared), or None if nothing."""
        if tracer is None or not (tracer.events or tracer.steps or tracer.rank_steps or tracer.tree_events):
            return None
        chunk = cls(
            events=list(tracer.events),
            steps=list(tracer.steps),
            rank_steps=list(tracer.rank_steps),
            tree_events=list(tracer.tree_events),
        )
        tracer.clear()
        return chunk

    def into(self, tracer: Tracer) -> None:
        """Append this chunk's records to `tracer`'s."""
        tracer.events.extend(self.events)
        tracer.steps.extend(self.steps)
        tracer.rank_steps.extend(self.rank_steps)
        tracer.tree_events.extend(self.tree_events)

    def extend(self, other: TraceChunk | None) -> TraceChunk:
        """Append `other`'s records to this chunk's; returns self."""
        if other is not None:
            self.events.extend(other.events)
            self.steps.extend(other.steps)
            self.rank_steps.extend(other.rank_steps)
            self.tree_events.extend(other.tree_events)
        return self


class DetokenizeParams(msgspec.Struct, kw_only=True):
    """What the detokenizer needs to know about a request; sent with its first output."""

    stop: list[str]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool


class ReqOutput(msgspec.Struct, kw_only=True):
    """One request's progress in one scheduler step (token ids) or after detokenization (text too)."""

    rid: str
    token_ids: list[int]
    finish_reason: dict[str, Any] | None = None  # FinishReason.to_dict() once finished
    worker: int = 0  # the tokenizer worker that owns the request (TokenizedGenerateReqInput.worker)
    cached_tokens: int = 0
    # Speculative decoding: this step's drafts of the request, and how many of them it kept.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    token_logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt logprobs, (logprob, token id) per scored prompt token, with a request's first output only:
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    detokenize: DetokenizeParams | None = None  # scheduler -> detokenizer only
    text: str = ""  # detokenizer -> tokenizer manager: the new text piece

    @classmethod
    def merge(cls, outputs: list[ReqOutput]) -> ReqOutput:
        """One request's consecutive outputs (several steps') as one, in order: the pieces they carry
        joined, the counts summed, the state (finish reason, cached tokens) of the last."""
        if len(outputs) == 1:
            return outputs[0]
        first, last = outputs[0], outputs[-1]
        logprobs = [o.token_logprobs for o in outputs if o.token_logprobs is not None]
        tops = [o.top_logprobs for o in outputs if o.top_logprobs is not None]
        return cls(
            rid=first.rid,
            worker=first.worker,
            token_ids=[t for o in outputs for t in o.token_ids],
            finish_reason=last.finish_reason,
            cached_tokens=last.cached_tokens,
            spec_draft_tokens=sum(o.spec_draft_tokens for o in outputs),
            spec_accepted_tokens=sum(o.spec_accepted_tokens for o in outputs),
            token_logprobs=[lp for part in logprobs for lp in part] if logprobs else None,
            top_logprobs=[top for part in tops for top in part] if tops else None,
            input_token_logprobs=first.input_token_logprobs,
            input_top_logprobs=first.input_top_logprobs,
            text="".join(o.text for o in outputs),
        )


class BatchTokenIDOutput(msgspec.Struct, kw_only=True, tag=True):
    outputs: list[ReqOutput]
    step: int | None = None  # the scheduler step that produced it (None: a request refused on arrival)
    trace: TraceChunk | None = None


class BatchStrOutput(msgspec.Struct, kw_only=True, tag=True):
    outputs: list[ReqOutput]
    trace: TraceChunk | None = None


ToScheduler = TokenizedGenerateReqInput | AbortReq | ControlReq
ToTokenizer = BatchStrOutput | ControlOutput | PeerReq
