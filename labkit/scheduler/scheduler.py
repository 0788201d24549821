"""The Scheduler: waiting queue -> prefill / decode batches -> model -> results, one step at a time.

recv_requests/process_input_requests (add_request, abort_request) -> get_next_batch_to_run ->
run_batch -> process_batch_result. `step()` does one iteration and returns a StepOutput; the
Engine drives it in-process, the server's scheduler process in its event loop. The scheduler owns
its state: others ask it (from_config, flush_cache, reset, waiting_order) rather than set fields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from labkit.config import EngineConfig
from labkit.constrained import BaseGrammarBackend, BaseGrammarObject, GrammarSpec, build_vocab_mask, get_grammar_backend
from labkit.distributed.parallel_state import TPGroup
from labkit.io_struct import AbortReq, TokenizedGenerateReqInput
from labkit.mem_cache.base_prefix_cache import held_row
from labkit.mem_cache.factory import make_prefix_cache
from labkit.model_executor.forward_batch import ForwardMode
from labkit.model_executor.future_map import FutureMap, HostSample
from labkit.model_executor.model_runner import ModelRunner
from labkit.model_loader.loader import model_dir_and_tokenizer
from labkit.sampling.sampler import SampleOutput
from labkit.scheduler.batch_memory import alloc_for_decode, alloc_for_extend, decode_slots_needed
from labkit.scheduler.limits import RequestLimits
from labkit.scheduler.output_processor import SchedulerOutputProcessorMixin
from labkit.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch, Tokenizer, needs_host_history
from labkit.scheduler.schedule_policy import PrefillAdder, SchedulePolicy, make_policy
from labkit.scheduler.scheduler_metrics import SchedulerMetricsMixin
from labkit.scheduler.speculation import SchedulerSpecMixin
from labkit.scheduler.tp_sync import SchedulerCall, SchedulerTPMixin
from labkit.speculative.step_costs import RealizedGains, StepCosts
from labkit.tokenizer.detokenizer import TokenDecoder
from labkit.trace.events import Station
from labkit.trace.recorder import Tracer

INIT_NEW_TOKEN_RATIO = 0.7  # share of max_new_tokens a running request is expected to still need
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per decode step, back towards the minimum after a retraction


def default_chunked_prefill_size(device: torch.device) -> int:
    """Prompt tokens per prefill step when --chunked-prefill-size is not given. On CUDA an eager
    prefill step's forward call costs about as much host time as GPU time, so larger chunks amortize
    it; 8192 was the fastest measured (docs/benchmarks.md)."""
    return 8192 if device.type == "cuda" else 2048


@dataclass
class StepOutput:
    """What one scheduler iteration did."""

    step: int
    forward_mode: ForwardMode
    rids: list[str] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)  # rid -> tokens it gained this step
    finished: list[Req] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)  # waiting rid -> what held it back
    cache_hit_tokens: int = 0
    expert_tokens: list[list[int]] | None = None  # traced MoE models: [MoE layer][expert] tokens routed
    # Speculative decoding (TARGET_VERIFY steps): each drafting request's drafts and how many it kept,
    # and the KV slots allocated for rejected drafts and given back.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    rollback_slots: int = 0
    # Traced runs: when the step ran each of its phases (see StepRecord.phases), and whose tokens it took.
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    processed_step: int | None = None


class Scheduler(SchedulerOutputProcessorMixin, SchedulerMetricsMixin, SchedulerTPMixin, SchedulerSpecMixin):
    def __init__(
        self, config: EngineConfig, model_runner: ModelRunner, tokenizer: Tokenizer | None, tracer: Tracer | None = None
    ):
        self.config = config
        self.model_runner = model_runner
        self.tokenizer = tokenizer
        # What Req.check_finished decodes stop strings with, every step: the tokenizer's fast decode.
        self.stop_decoder = TokenDecoder(tokenizer) if tokenizer is not None else None
        self.tracer = tracer
        self.tp = model_runner.tp
        self._tp_outbox = []  # inputs the leader took since its last broadcast (labkit.scheduler.tp_sync)
        self.page_size = config.page_size
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.tree_cache = make_prefix_cache(config, model_runner, tracer.tree if tracer is not None else None)
        self.policy = self._make_policy(config.schedule_policy, None)
        self.max_req_len = model_runner.context_len
        self.limits = RequestLimits(
            model_runner.vocab_size,
            self.max_req_len,
            self.allocator.size,
            grammar_backend=config.grammar_backend,
            has_tokenizer=tokenizer is not None,
        )
        # Built at the first request with a grammar: importing xgrammar alone takes about a second.
        self.grammar_backend: BaseGrammarBackend | None = None
        chunk = config.chunked_prefill_size
        if chunk is None:
            chunk = default_chunked_prefill_size(model_runner.device)
        self.chunked_prefill_size = chunk if chunk > 0 else None
        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []  # decoding requests
        self.chunked_req: Req | None = None
        self.aborted: list[Req] = []  # aborted since the last step, reported by the next one
        self.new_token_ratio = self.init_new_token_ratio
        self.step_id = 0
        self.drafter = self._make_drafter()
        self.step_costs = StepCosts()
        self.realized_gains = RealizedGains()
        self.refused_until: dict[int, int] = {}  # labkit.scheduler.speculation.drafting_budgets
        self.spec_attempt = False  # this step gave up the overlap to draft (labkit.scheduler.speculation)
        # Overlap scheduling: the batch launched last step, whose tokens the host has not taken yet.
        # With speculation, a step that drafts waits for them first (drafts follow the newest tokens).
        on_cuda = model_runner.device.type == "cuda"
        self.overlap = not config.disable_overlap_schedule and (on_cuda or config.overlap_schedule_on_cpu)
        self.in_flight: tuple[ScheduleBatch, HostSample] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, tracer: Tracer | None = None, tp: TPGroup | None = None) -> Scheduler:
        """Load the tokenizer and model (this rank's share over `tp`), size the pools, and build the
        scheduler around them. The Engine, its tensor-parallel workers and the server's scheduler
        processes all start here."""
        model_dir, tokenizer = model_dir_and_tokenizer(config)
        return cls(config, ModelRunner(config, tokenizer, model_dir, tp), tokenizer, tracer)

    # ---- lifecycle ---------------------------------------------------------------------------
    def flush_cache(self) -> None:
        """Drop the prefix cache, returning its KV slots. RuntimeError while requests are in flight
        (they hold locks on it); the scheduler is unchanged then."""
        self._flush()
        self._mirror(SchedulerCall(method="flush_cache"))

    def _flush(self) -> None:
        if self.has_work():
            raise RuntimeError("cannot flush the cache while requests are waiting or running")
        self.tree_cache.reset()

    def reset(self, policy: str | None = None, seed: int | None = None) -> None:
        """Start over as a freshly built scheduler, for the next run on the same model: empty prefix
        cache, steps counted from 1 again, the new-token ratio at its initial value (it moves during
        a run and changes admissions), and `policy` seeded with `seed` (default: the configured ones).
        RuntimeError while requests are in flight, ValueError for an unknown policy; the scheduler is
        unchanged then."""
        new_policy = self._make_policy(policy or self.config.schedule_policy, seed)
        self._flush()
        self.new_token_ratio = self.init_new_token_ratio
        self.step_id = 0
        self.policy = new_policy
        self._mirror(SchedulerCall(method="reset", kwargs={"policy": policy, "seed": seed}))

    def set_policy(self, name: str, seed: int | None = None) -> None:
        """Order the waiting queue by the registered policy `name` from the next step on (seed:
        default config.random_seed). ValueError for an unknown name; the policy is unchanged then."""
        self.policy = self._make_policy(name, seed)
        self._mirror(SchedulerCall(method="set_policy", kwargs={"name": name, "seed": seed}))

    def _make_policy(self, name: str, seed: int | None) -> SchedulePolicy:
        return make_policy(name, self.config.random_seed if seed is None else seed)

    @property
    def init_new_token_ratio(self) -> float:
        """new_token_ratio at the start and after a retraction (it decays as decoding goes well)."""
        return INIT_NEW_TOKEN_RATIO * self.config.schedule_conservativeness

    # ---- input -------------------------------------------------------------------------------
    def add_request(self, recv: TokenizedGenerateReqInput) -> Req:
        """Validate and enqueue. Raises ValueError for bad input; the scheduler is unchanged then."""
        params = self.limits.check(recv.input_ids, recv.sampling_params)
        if self.find_request(recv.rid) is not None:
            raise ValueError(f"request id {recv.rid!r} is already in use")
        req = Req(
            rid=recv.rid,
            origin_input_ids=list(recv.input_ids),
            sampling_params=params,
            input_text=recv.input_text,
            worker=recv.worker,
            grammar=self._new_matcher(params.grammar) if params.grammar is not None else None,
        )
        if recv.created_time:
            req.times["arrival"] = recv.created_time
        self.waiting_queue.append(req)
        self._mirror(recv)
        return req

    def _new_matcher(self, spec: GrammarSpec) -> BaseGrammarObject:
        """A matcher for a new request (ValueError if its grammar does not compile). Every rank builds
        its own from the replayed request, and advances it with the same tokens."""
        if self.grammar_backend is None:
            backend = get_grammar_backend(self.config.grammar_backend)
            runner = self.model_runner
            self.grammar_backend = backend(self.tokenizer, runner.vocab_size, runner.eos_token_ids)
        return self.grammar_backend.new_matcher(spec)

    def waiting_order(self, policy: str) -> list[Req]:
        """The waiting requests in the order the registered `policy` (seeded with config.random_seed)
        would take them now: each is matched against the prefix cache first, as a step does, then
        the policy sorts a copy of the queue. The queue itself keeps its order."""
        for req in self.waiting_queue:
            req.init_next_round_input(self.tree_cache)
        order = list(self.waiting_queue)
        self._make_policy(policy, None).sort(order, self.tree_cache)
        return order

    def find_request(self, rid: str) -> Req | None:
        live = self.waiting_queue + self.running + ([self.chunked_req] if self.chunked_req else [])
        return next((r for r in live if r.rid == rid), None)

    def abort_request(self, rid: str) -> bool:
        """Abort a waiting or running request; its memory is returned at the next step."""
        req = self.find_request(rid)
        if req is None or req.finished():
            return False
        req.finished_reason = FinishReason("abort", message="aborted")
        if req in self.waiting_queue:  # waiting requests hold no memory (retracted ones released it)
            self.waiting_queue.remove(req)
            req.times["finished"] = time.perf_counter()
        self.aborted.append(req)
        self._mirror(AbortReq(rid=rid))
        return True

    def _release_aborted(self) -> None:
        for req in [r for r in self.running if r.finished()]:
            self.running.remove(req)
            self._release(req)
        if self.chunked_req is not None and self.chunked_req.finished():
            self._release(self.chunked_req)
            self.chunked_req = None

    def _release(self, req: Req) -> None:
        self.tree_cache.cache_finished_req(req)
        req.drop_placeholder()
        req.times["finished"] = time.perf_counter()
        if self.drafter is not None:
            self.drafter.release(req)

    # ---- one iteration -----------------------------------------------------------------------
    def step(self) -> StepOutput:
        """Schedule and launch a batch, then take in the tokens of the batch before it. Without
        overlap that is the batch just launched. With overlap it is the previous one: its forward ran
        on the device while the host scheduled and launched this one, so a step reports the tokens of
        the batch launched one step earlier (see labkit.model_executor.future_map)."""
        self.broadcast_inputs(step=True)  # tensor parallelism: the followers take the same step
        self.step_id += 1
        start = time.perf_counter()
        self._release_aborted()
        self.spec_attempt = False
        out = StepOutput(step=self.step_id, forward_mode=ForwardMode.IDLE, finished=self.aborted)
        self.aborted = []
        batch = self.get_next_batch_to_run(out)
        if self.tracer is not None:
            out.phases["schedule"] = (start, time.perf_counter())
        if batch is None:
            self._take_in_flight(out, None)
        elif batch.forward_mode == ForwardMode.TARGET_VERIFY:
            self.run_verify_batch(batch, out)
        else:
            if self.in_flight is not None and needs_host_history(batch.reqs):
                self._take_in_flight(out, batch)  # its penalties need the tokens still on the device
            launched = self.run_batch(batch, out)
            self._take_in_flight(out, batch)
            self.commit_batch(batch, out)
            # A batch of requests that all finished meanwhile (or a prompt chunk) has no token to take.
            self.in_flight = (batch, launched) if batch.sampled_rows else None
            if not self.overlap:
                self._take_in_flight(out, None)
        if self.drafter is not None and batch is not None:
            self.record_spec_step(batch, time.perf_counter() - start)
        if self.tracer is not None:
            self._trace_step(self.tracer, out, start)
            self.gather_step_records()
        return out

    def _take_in_flight(self, out: StepOutput, next_batch: ScheduleBatch | None) -> None:
        if self.in_flight is not None:
            batch, launched = self.in_flight
            self.in_flight = None
            start = time.perf_counter()  # the wait is part of it: on CUDA the host may block there
            self.process_batch_result(batch, launched.wait(), out, next_batch)
            if self.tracer is not None:
                out.phases["process"] = (start, time.perf_counter())
                out.processed_step = batch.step

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running or self.chunked_req or self.aborted or self.in_flight)

    def get_next_batch_to_run(self, out: StepOutput) -> ScheduleBatch | None:
        """Prefill first (new requests get their first token soon), else decode the running ones."""
        batch = self.get_new_batch_prefill(out)
        if batch is None and self.running:
            batch = self.update_running_batch(out)
        if batch is not None:
            out.forward_mode = batch.forward_mode
            out.rids = [r.rid for r in batch.reqs]
            out.prefix_lens, out.extend_lens = batch.prefix_lens, batch.extend_lens
        return batch

    def get_new_batch_prefill(self, out: StepOutput) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if self.policy.needs_prefix_match:
            for req in self.waiting_queue:
                req.init_next_round_input(self.tree_cache)
        self.policy.sort(self.waiting_queue, self.tree_cache)
        mixed = self.config.enable_mixed_chunk and bool(self.running)
        adder = PrefillAdder(
            self.tree_cache,
            self.allocator,
            self.running,
            self.new_token_ratio,
            self.config.max_prefill_tokens,
            self.chunked_prefill_size,
            self.page_size,
            mixed_decode_tokens=len(self.running) if mixed else 0,
        )
        stopped_at = None
        if self.chunked_req is not None:
            req = self.chunked_req
            req.extend_input_len = req.seqlen - len(req.prefix_indices)
            if not adder.add_chunked_req(req):
                stopped_at = req.rid  # memory is short: the chunked request is first in line
        for req in self.waiting_queue:
            if stopped_at is not None:
                adder.blocked[req.rid] = f"queued behind {stopped_at}"
            elif len(self.running) + len(adder.can_run) >= self.config.max_running_requests:
                adder.blocked[req.rid] = f"running-request cap ({self.config.max_running_requests})"
            elif adder.new_chunked_req is not None:
                adder.blocked[req.rid] = "a request is being chunk-prefilled this step"
            else:
                # A tiered cache matches again right before admission: loading one request's prefix
                # back may evict what another one matched when the queue was sorted.
                if self.tree_cache.loads_back or not self.policy.needs_prefix_match:
                    req.init_next_round_input(self.tree_cache)
                if not adder.add_one_req(req):
                    stopped_at = req.rid
        out.blocked = adder.blocked
        if not adder.can_run:
            return None
        admitted = set(map(id, adder.can_run))
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        batch = ScheduleBatch(reqs=adder.can_run, forward_mode=ForwardMode.EXTEND, step=self.step_id)
        if not alloc_for_extend(batch, self.req_to_token_pool, self.allocator, self.tree_cache, self.page_size):
            raise RuntimeError("KV allocation failed after the PrefillAdder admitted the batch")
        if self.chunked_req is None or self.chunked_req in adder.can_run:
            self.chunked_req = adder.new_chunked_req
        now = time.perf_counter()
        for req in batch.reqs:
            if "first_scheduled" not in req.times:
                req.times["first_scheduled"] = now
                req.cached_tokens = len(req.prefix_indices)
                out.cache_hit_tokens += req.cached_tokens
                if self.tracer is not None:
                    self.tracer.station(
                        req.rid,
                        Station.ENQUEUE,
                        req.times["arrival"],
                        now,
                        prefix_len=len(req.prefix_indices),
                        input_len=len(req.origin_input_ids),
                    )
        if mixed:
            self._mix_in_decodes(batch)
        return batch

    def _mix_in_decodes(self, batch: ScheduleBatch) -> None:
        decode = ScheduleBatch(reqs=list(self.running), forward_mode=ForwardMode.DECODE)
        if not alloc_for_decode(decode, self.req_to_token_pool, self.allocator, self.tree_cache, self.page_size):
            return  # no memory for the decodes now: they run (and retract if needed) next step
        batch.forward_mode = ForwardMode.MIXED
        batch.decoding_reqs = decode.reqs
        batch.reqs = batch.reqs + decode.reqs
        batch.input_ids += decode.input_ids
        batch.positions += decode.positions
        batch.prefix_lens = batch.prefix_lens + decode.prefix_lens
        batch.extend_lens = batch.extend_lens + decode.extend_lens
        batch.out_cache_loc = torch.cat([batch.out_cache_loc, decode.out_cache_loc])

    def update_running_batch(self, out: StepOutput) -> ScheduleBatch | None:
        """Decode every running request; retract some first if their next tokens do not fit."""
        budgets = self.drafting_budgets(self.running) if self.drafter is not None else None
        drafting = budgets is not None
        if drafting and self.in_flight is not None and not self.drafts_ahead(self.running):
            self._take_in_flight(out, None)  # drafts follow the tokens still on their way
            self.spec_attempt = True  # the overlap is lost, whether or not a verify step follows
            budgets = None  # asked again: the tokens taken in may change them
        if decode_slots_needed(self.running, self.page_size) > self._reclaimable():
            budgets = None  # and the requests retracted
            out.retracted = self.retract_decode()
            self.new_token_ratio = self.init_new_token_ratio
        else:
            floor = MIN_NEW_TOKEN_RATIO * self.config.schedule_conservativeness
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, floor)
        if not self.running:
            return None
        batch = ScheduleBatch(reqs=list(self.running), forward_mode=ForwardMode.DECODE, step=self.step_id)
        if drafting and self.prepare_verify(batch, budgets):
            return batch
        if not alloc_for_decode(batch, self.req_to_token_pool, self.allocator, self.tree_cache, self.page_size):
            raise RuntimeError("KV allocation failed for decode after retraction")
        return batch

    def _reclaimable(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def retract_decode(self) -> list[str]:
        """Send running requests back to the queue until the rest can decode. The victims are those
        with the fewest output tokens (least work lost), longest prompts first. Their KV goes into the
        cache (evictable), so a retracted request that comes back soon finds much of it again."""
        victims = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
        retracted: list[Req] = []
        while decode_slots_needed(victims, self.page_size) > self._reclaimable():
            req = victims.pop()
            self.tree_cache.cache_finished_req(req)
            if not victims:  # even alone it cannot grow: the pool is too small for this request
                req.drop_placeholder()
                req.finished_reason = FinishReason("length", len(req.output_ids), "KV pool exhausted")
                req.times["finished"] = time.perf_counter()
                self.aborted.append(req)
                break
            req.reset_for_retract()
            if self.drafter is not None:
                self.drafter.release(req)
            retracted.append(req)
        kept = set(map(id, victims))
        self.running = [r for r in self.running if id(r) in kept]
        self.waiting_queue = sorted(retracted, key=lambda r: r.times["arrival"]) + self.waiting_queue
        return [r.rid for r in retracted]

    def run_batch(self, batch: ScheduleBatch, out: StepOutput) -> HostSample:
        """Queue the batch's forward and sampling on the device; the tokens come with `.wait()`."""
        prepare = time.perf_counter()
        forward_batch = self.model_runner.build_forward_batch(batch)
        start = time.perf_counter()
        logits = self.model_runner.forward(forward_batch)
        mid = time.perf_counter()
        rows = batch.sample_rows or batch.reqs  # a verify batch samples every draft's row
        # Filled on the host while the device runs the forward (station 8's grammar mask).
        vocab_mask = build_vocab_mask(
            [r.grammar for r in rows], self.model_runner.vocab_size, self.model_runner.eos_token_ids
        )
        sample = self.model_runner.sample(logits, rows, forward_batch, vocab_mask)
        if forward_batch.input_logprobs is not None:  # reads them now: such a step gives up the overlap
            for req, (logprobs, top) in zip(batch.reqs, forward_batch.input_logprobs.per_request()):
                req.add_input_logprobs(logprobs, top)
        if self.tracer is not None:  # reads the logits now: tracing gives up the overlap
            sampled = sample.wait()
            end = time.perf_counter()
            out.phases.update(prepare=(prepare, start), forward=(start, mid), sample=(mid, end))
            self._trace_forward(self.tracer, batch, logits, sampled, start, mid, end)
            if forward_batch.expert_load is not None:
                out.expert_tokens = forward_batch.expert_load.tolist()
        return sample

    def commit_batch(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """What the launched batch did that needs no token values: KV lengths, chunks cached, and a
        placeholder for each request's coming token (the host learns it in process_batch_result).
        A request asking for no new token (max_new_tokens 0: it only scores its prompt) finishes
        here once its prompt is prefilled; its sampled token is discarded."""
        decoding = set(map(id, batch.reqs if batch.forward_mode.is_decode() else batch.decoding_reqs))
        for i, req in enumerate(batch.reqs):
            if req.finished():  # it finished while this batch was being scheduled (overlap)
                continue
            req.kv_len = batch.prefix_lens[i] + batch.extend_lens[i]
            if req.is_chunked:  # more prompt to come: keep the chunk's KV; its token is discarded
                self.tree_cache.cache_unfinished_req(req)
                continue
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = FinishReason("length", 0)
                self._release(req)
                out.finished.append(req)
                continue
            req.output_ids.append(FutureMap.future_token(held_row(req)))
            batch.sampled_rows.append(i)
            if id(req) not in decoding:  # prefill done: share the prompt's KV, start decoding
                self.tree_cache.cache_unfinished_req(req)
                self.running.append(req)

    def process_batch_result(
        self, batch: ScheduleBatch, result: SampleOutput, out: StepOutput, next_batch: ScheduleBatch | None = None
    ) -> None:
        """Put the sampled tokens in place of their placeholders (each still the request's last output
        id) and finish requests. `next_batch` is the batch scheduled after this one (overlap): a request
        finishing now is in it, computing its last token's KV, so that slot is cached with the rest."""
        next_ids = result.next_token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        in_next = set(map(id, next_batch.reqs)) if next_batch is not None else set()
        for i in batch.sampled_rows:
            req = batch.reqs[i]
            if req.finished():  # aborted or cut off after its batch was launched
                continue
            req.output_ids[-1] = next_ids[i]
            self.take_token(req, i, result, logprobs)
            out.new_token_ids[req.rid] = [next_ids[i]]
            if req.finished():
                self._finish(req, id(req) in in_next)
                out.finished.append(req)

    def take_token(self, req: Req, row: int, result: SampleOutput, logprobs: list[float] | None) -> None:
        """The request's newest output id (sampled at `row`) is final: advance its grammar, keep its
        logprobs when asked for, and check whether it finishes the request."""
        token = req.output_ids[-1]
        req.times.setdefault("first_token", time.perf_counter())
        if req.grammar is not None and not req.grammar.accept_token(token):
            # Only a stop token its mask gave a row whose grammar allowed nothing (build_vocab_mask).
            req.finished_reason = FinishReason("stop", None, "the grammar admits no further token")
        if logprobs is not None and req.sampling_params.return_logprob:
            req.output_token_logprobs.append(logprobs[row])
            if req.sampling_params.top_logprobs_num and result.top_logprobs is not None:
                ids, lps = result.top_logprobs[row]
                req.output_top_logprobs.append(list(zip(ids, lps)))
        req.check_finished(self.model_runner.eos_token_ids, self.stop_decoder, self.max_req_len)

    def _finish(self, req: Req, in_next_batch: bool) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.req_pool_idx is None:  # retracted while its last batch ran: it holds no memory
            self.waiting_queue.remove(req)
            req.times["finished"] = time.perf_counter()
            return
        if in_next_batch:
            req.kv_len += 1
        self._release(req)
