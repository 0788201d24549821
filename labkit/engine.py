"""Engine: labkit in one process. `generate(...)` for batch use; `add_request` + `step()` to walk a
run one scheduler iteration at a time, with the live scheduler, pools and radix cache inspectable."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from html import escape
from typing import Any

from labkit.config import EngineConfig, check_parallel
from labkit.distributed.parallel_state import TPGroup, destroy_tp_group, init_tp_group
from labkit.distributed.tp_worker import TPFollowers, check_tp_shapes, free_local_addr
from labkit.io_struct import GenerateReqInput
from labkit.model_executor.forward_batch import ForwardMode
from labkit.model_executor.model_runner import resolve_device
from labkit.model_loader.loader import load_config
from labkit.reprs import Summarized
from labkit.sampling.sampling_params import SamplingParams
from labkit.scheduler.schedule_batch import Req
from labkit.scheduler.scheduler import Scheduler, StepOutput
from labkit.tokenizer.detokenizer_manager import DetokenizerManager
from labkit.tokenizer.prompt import apply_chat_template, tokenize_request
from labkit.trace.events import PoolUsage, TierUsage
from labkit.trace.recorder import Tracer


@dataclass(repr=False)
class EngineStep(Summarized):
    """What one `Engine.step()` did, for people: the batch, the new tokens and text, the memory."""

    step: int
    forward_mode: str
    rids: list[str]
    prefix_lens: list[int]
    extend_lens: list[int]
    new_tokens: dict[str, list[int]]  # rid -> the tokens it gained (several after a verify step)
    new_text: dict[str, str]
    finished: list[str]
    retracted: list[str]
    blocked: dict[str, str]
    cache_hit_tokens: int
    pool: PoolUsage | None  # None: not counted (step(count_pool=False))
    running: int
    waiting: int
    host_pool: TierUsage | None = None  # the host tier (--enable-hierarchical-cache)

    def summary(self) -> dict[str, object]:
        out: dict[str, object] = {"step": self.step, "forward_mode": self.forward_mode, "requests": len(self.rids)}
        out |= {"new_tokens": sum(map(len, self.new_tokens.values())), "cache_hit_tokens": self.cache_hit_tokens}
        out |= {"finished": self.finished, "retracted": self.retracted, "blocked": len(self.blocked)}
        out |= {"running": self.running, "waiting": self.waiting}
        if self.pool is not None:
            out |= {"kv_pool": f"{self.pool.free} free of {self.pool.total}"}
        return out

    def html_details(self) -> str:
        """Each request's new tokens (and their text, with a tokenizer)."""
        rows = "".join(
            f"<tr><td>{escape(rid)}</td><td>{tokens}</td><td>{escape(repr(self.new_text.get(rid, '')))}</td></tr>"
            for rid, tokens in self.new_tokens.items()
        )
        return f"<table><tr><th>rid</th><th>new tokens</th><th>text</th></tr>{rows}</table>" if rows else ""


@dataclass
class _ReqState:
    """What the Engine keeps of a request in flight: its text so far and its tokenize timestamp."""

    pieces: list[str]
    tokenize_time: float


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        config = config or EngineConfig()
        unknown = set(overrides) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ValueError(f"unknown engine option(s): {sorted(unknown)}")
        self.config = dataclasses.replace(config, **overrides)
        self.tracer = Tracer() if self.config.enable_trace else None
        self._followers: TPFollowers | None = None
        self.scheduler = Scheduler.from_config(self.config, self.tracer, self._start_tensor_parallel())
        self.tokenizer = self.scheduler.tokenizer
        self.model_runner = self.scheduler.model_runner
        self.detokenizer = DetokenizerManager(self.tokenizer, self.tracer)
        self._states: dict[str, _ReqState] = {}
        self.results: dict[str, dict[str, Any]] = {}  # finished requests of step-wise use, by rid
        self._rid_counter = itertools.count()
        self._last_pieces: dict[str, str] = {}  # rid -> text piece the last step produced

    def _start_tensor_parallel(self) -> TPGroup | None:
        """With tp_size > 1: start the follower ranks and join their group as rank 0."""
        config = self.config
        check_parallel(config)
        if config.tp_size == 1:
            return None
        if config.nnodes > 1:
            raise ValueError("an Engine runs on one machine; several nodes need the server (python -m labkit.server)")
        check_tp_shapes(load_config(config.model_path), config.tp_size, config.ep_size)
        addr = config.dist_init_addr or free_local_addr()
        self._followers = TPFollowers.start(config, addr)
        try:
            return init_tp_group(
                0,
                config.tp_size,
                addr,
                resolve_device(config.device),
                config.dist_timeout,
                self._followers.dead,
                ep_size=config.ep_size,
            )
        except RuntimeError:
            self._followers.join(timeout=0)
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel followers and leave their group (nothing to do with tp_size 1).
        The Engine cannot step afterwards."""
        if self._followers is None:
            return
        self.scheduler.broadcast_inputs(stop=True)
        destroy_tp_group(self.scheduler.tp)  # before the join: NCCL's teardown waits for every rank
        self._followers.join()
        self._followers = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- the live components, for inspection ----------------------------------------------
    @property
    def tree_cache(self):
        return self.scheduler.tree_cache

    @property
    def req_to_token_pool(self):
        return self.model_runner.req_to_token_pool

    @property
    def token_to_kv_pool(self):
        return self.model_runner.token_to_kv_pool

    @property
    def allocator(self):
        return self.model_runner.token_to_kv_pool_allocator

    def pool_usage(self) -> PoolUsage:
        return self.scheduler.pool_usage()

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        rid: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Tokenize and enqueue one request; returns its rid. Bad input raises ValueError.
        `arrival_time` (perf_counter seconds) backdates its arrival, for a workload runner that held
        the request back before submitting it; by default it arrives when tokenized."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = dataclasses.asdict(sampling_params)
        req = GenerateReqInput(
            text=prompt, input_ids=input_ids, messages=messages, sampling_params=dict(sampling_params or {}), rid=rid
        )
        rid = rid if rid is not None else f"req-{next(self._rid_counter)}"
        if rid in self._states:
            raise ValueError(f"request id {rid!r} is already in use")
        tokenized = tokenize_request(self.tokenizer, req, rid, tracer=self.tracer)
        if arrival_time is not None:
            tokenized.created_time = arrival_time
        self.scheduler.add_request(tokenized)
        self._states[rid] = _ReqState(pieces=[], tokenize_time=tokenized.received_time)
        return rid

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return apply_chat_template(self.tokenizer, messages)

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort_request(rid)

    def flush_cache(self) -> None:
        """Drop the prefix cache, returning its KV slots. Refused (RuntimeError) while requests are in flight."""
        self.scheduler.flush_cache()

    # ---- running -----------------------------------------------------------------------------
    def step(self, count_pool: bool = True) -> EngineStep:
        """Run exactly one scheduler iteration and report it. `count_pool=False` leaves out the count
        of KV slots by owner (a few ms per step with hundreds of requests): what a benchmark wants."""
        out = self._step()
        sched = self.scheduler
        return EngineStep(
            step=out.step,
            forward_mode=out.forward_mode.name,
            rids=out.rids,
            prefix_lens=out.prefix_lens,
            extend_lens=out.extend_lens,
            new_tokens=out.new_token_ids,
            new_text=dict(self._last_pieces),
            finished=[r.rid for r in out.finished],
            retracted=out.retracted,
            blocked=out.blocked,
            cache_hit_tokens=out.cache_hit_tokens,
            pool=sched.pool_usage() if count_pool else None,
            running=len(sched.running),
            waiting=len(sched.waiting_queue),
            host_pool=sched.tree_cache.tier_usage(),
        )

    def _step(self) -> StepOutput:
        out = self.scheduler.step()
        detokenized = self.detokenizer.handle(self.scheduler.stream_output(out))
        self._last_pieces = {}
        for o in detokenized.outputs:
            self._states[o.rid].pieces.append(o.text)
            if self.tokenizer is not None:
                self._last_pieces[o.rid] = o.text
        for req in out.finished:
            self.results[req.rid] = self._result(req, self._states.pop(req.rid))
        if (
            out.forward_mode == ForwardMode.IDLE
            and not self.scheduler.running
            and self.scheduler.waiting_queue
            and not out.finished
        ):
            raise RuntimeError("the scheduler cannot admit any waiting request (see EngineStep.blocked)")
        return out

    def _result(self, req: Req, state: _ReqState) -> dict[str, Any]:
        assert req.finished_reason is not None  # called for finished requests only
        times = {"tokenize": state.tokenize_time, **req.times}
        reason = req.finished_reason.to_dict()
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": reason,
            "matched_stop": reason["matched"] if reason["type"] == "stop" else None,
            "retractions": req.retract_count,
            **req.spec.meta_info(),
            "timestamps": times,
            "ttft": times["first_token"] - times["arrival"] if "first_token" in times else None,
            "e2e_latency": times["finished"] - times["arrival"],
        }
        if req.sampling_params.return_logprob:
            meta["output_token_logprobs"] = list(zip(req.output_token_logprobs, req.output_ids))
            meta["output_top_logprobs"] = [_logprob_first(top) for top in req.output_top_logprobs]
        if req.sampling_params.wants_input_logprobs:
            meta["input_token_logprobs"] = req.input_token_logprob_pairs()
            meta["input_top_logprobs"] = [_logprob_first(top) for top in req.input_top_logprobs]
        return {
            "text": "".join(state.pieces) if self.tokenizer is not None else None,
            "output_ids": list(req.output_ids),
            "meta_info": meta,
        }

    def _wait_for(self, rids: list[str]) -> list[dict[str, Any]]:
        """Step until these requests have finished; hand back (and forget) their results."""
        while any(rid not in self.results for rid in rids):
            self._step()
        return [self.results.pop(rid) for rid in rids]

    def run_until_done(self) -> None:
        while self.scheduler.has_work():
            self._step()

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | SamplingParams | list | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or many (returns a list, in order).
        Prompts are text, token ids or chat messages; sampling_params is one for all or one each."""
        single, items = _as_batch(prompt, input_ids, messages)
        n = len(items)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling_params for {n} prompts")
        rids: list[str] = []
        try:
            for item, p in zip(items, params):
                rids.append(self.add_request(**item, sampling_params=p))
        except ValueError:
            for rid in rids:  # all or nothing: take back what was already queued
                self.abort(rid)
            self._wait_for(rids)
            raise
        outs = self._wait_for(rids)
        return outs[0] if single else outs


def _as_batch(prompt, input_ids, messages) -> tuple[bool, list[dict[str, Any]]]:
    """Normalize the three prompt forms into a list of add_request keyword sets."""
    if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, input_ids or messages")
    if prompt is not None:
        return (True, [{"prompt": prompt}]) if isinstance(prompt, str) else (False, [{"prompt": p} for p in prompt])
    if input_ids is not None:
        if input_ids and isinstance(input_ids[0], list):
            return False, [{"input_ids": ids} for ids in input_ids]
        return True, [{"input_ids": input_ids}]
    if messages and isinstance(messages[0], list):
        return False, [{"messages": m} for m in messages]
    return True, [{"messages": messages}]


def _logprob_first(top: list[tuple[int, float]] | None) -> list[tuple[float, int]] | None:
    """A step's top logprobs as SGLang's Engine gives them, (logprob, token id) like the chosen token's."""
    return None if top is None else [(lp, token) for token, lp in top]
