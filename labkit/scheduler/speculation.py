"""SchedulerSpecMixin: speculative decoding in the scheduler (labkit/speculative/verify.py explains
the rule). A decode step becomes a TARGET_VERIFY step when some request drafts and the drafts' KV
fits in free pages; the host waits for its tokens (the drafts of the step after need them), and
each request keeps its accepted run at once.

With overlap scheduling the step before a verify step may still be on the device. A drafter that
drafts ahead (Drafter.drafts_ahead) drafts behind that step's token: the verify step's first input is
that token, resolved on the device as a decode step's is (labkit.model_executor.future_map), and the
host takes it after launching the verify step. Otherwise, or when the batch's sampling needs its
output on the host (penalties), the host takes it before drafting, and that step loses its overlap."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

from labkit.model_executor.forward_batch import ForwardMode
from labkit.scheduler.batch_memory import alloc_for_verify, rejected_slots
from labkit.scheduler.schedule_batch import needs_host_history
from labkit.speculative.base import Drafter, LeaderDrafts, get_drafter
from labkit.speculative.step_costs import RealizedGains, StepCosts, bucket, weigh
from labkit.speculative.verify import accept, verify_rows

if TYPE_CHECKING:
    from labkit.config import EngineConfig
    from labkit.distributed.parallel_state import TPGroup
    from labkit.mem_cache.allocator import TokenToKVPoolAllocator
    from labkit.mem_cache.memory_pool import ReqToTokenPool
    from labkit.model_executor.future_map import HostSample
    from labkit.model_executor.model_runner import ModelRunner
    from labkit.sampling.sampler import SampleOutput
    from labkit.scheduler.schedule_batch import Req, ScheduleBatch
    from labkit.scheduler.scheduler import StepOutput


DEFAULT_BREAK_EVEN = 1.0  # accepted drafts per request, before this batch size's steps were timed
EARLY_RESUME_MAX_BATCH = 4  # larger batches leave a paused request paused until its pause ends
# A batch size refused by its realized gains is asked again after this many steps, not every step:
# the answer moves only as gains expire (GAIN_MEMORY_STEPS or more) and the question costs each step.
REFUSAL_HOLD_STEPS = 8


class SchedulerSpecMixin:
    """Mixed into Scheduler, which provides the state and methods declared below."""

    config: EngineConfig
    model_runner: ModelRunner
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    page_size: int
    step_id: int
    max_req_len: int
    in_flight: tuple[ScheduleBatch, HostSample] | None
    drafter: Drafter | None
    step_costs: StepCosts
    realized_gains: RealizedGains
    refused_until: dict[int, int]  # batch-size bucket -> step from which drafting_budgets asks again
    spec_attempt: bool
    waiting_queue: list[Req]
    chunked_req: Req | None

    tp: TPGroup

    if TYPE_CHECKING:  # the Scheduler's

        def run_batch(self, batch: ScheduleBatch, out: StepOutput) -> HostSample: ...
        def take_token(self, req: Req, row: int, result: SampleOutput, logprobs: list[float] | None) -> None: ...
        def _take_in_flight(self, out: StepOutput, next_batch: ScheduleBatch | None) -> None: ...
        def _finish(self, req: Req, in_next_batch: bool) -> None: ...

    def _make_drafter(self) -> Drafter | None:
        name = self.config.speculative_algorithm
        if not name:
            return None
        k = self.config.speculative_num_draft_tokens
        if k < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {k}")
        rate, gain = self.config.speculative_min_accept_rate, self.config.speculative_min_batch_gain
        if not 0 <= rate <= 1:
            raise ValueError(f"speculative_min_accept_rate must be in [0, 1], got {rate}")
        if gain is not None and gain < 0:
            raise ValueError(f"speculative_min_batch_gain must be >= 0 (or unset: measured), got {gain}")
        drafter = get_drafter(name)  # an unknown name fails on every rank
        if self.tp.is_leader:
            return drafter(self.config, self.model_runner)
        follower = LeaderDrafts(self.config, self.model_runner)
        follower.drafts_ahead = drafter.drafts_ahead  # every rank takes the same steps
        return follower

    def drafts_ahead(self, reqs: list[Req]) -> bool:
        """Whether these requests draft behind the token still on its way (the module docstring)."""
        assert self.drafter is not None
        return self.drafter.drafts_ahead and not needs_host_history(reqs)

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        """The drafter's drafts (cut to the budgets). With tensor parallelism the leader drafts and
        broadcasts them: every rank must feed the verify forward the same tokens, and a draft model's
        argmax can differ between processes where its logits nearly tie."""
        assert self.drafter is not None
        drafts = None
        if self.tp.is_leader:
            drafts = [d[:b] for d, b in zip(self.drafter.propose(reqs, budgets), budgets)]
        if self.tp.size > 1:
            drafts = json.loads(self.tp.broadcast_bytes(json.dumps(drafts).encode() if drafts is not None else None))
        assert drafts is not None
        return drafts

    def draft_budgets(self, reqs: list[Req]) -> list[int]:
        """Drafts each request may take now: none while paused (unless it resumes early here:
        _copying_again) or under a grammar (its matcher cannot look ahead), and never past
        max_new_tokens or the context (the last kept token is the target's own). With CUDA graphs,
        where the batch's decode step fits the largest graph, no more in all than lets the verify
        step fit it too (an eager forward costs many replays), requests with the best recent
        acceptance rates first."""
        k = self.config.speculative_num_draft_tokens
        budgets = []
        for r in reqs:
            room = min(r.sampling_params.max_new_tokens - len(r.output_ids), self.max_req_len - r.seqlen)
            drafting = r.grammar is None and (r.spec.drafting(self.step_id) or self._copying_again(r, len(reqs)))
            budgets.append(max(0, min(k, room - 1)) if drafting else 0)
        graphs = self.model_runner.cuda_graph_runner
        if graphs is not None and len(reqs) + sum(budgets) > graphs.max_bs >= len(reqs):
            spare = graphs.max_bs - len(reqs)
            for i in sorted(range(len(reqs)), key=lambda i: -reqs[i].spec.recent_rate):
                budgets[i] = min(budgets[i], spare)
                spare -= budgets[i]
        return budgets

    def _copying_again(self, req: Req, batch_size: int) -> bool:
        """Whether a paused request drafts again before its pause ends, because the drafter sees it
        copying again (Drafter.copying_again), and if so end the pause. Asked only where a verify
        step could pay for that request alone (a batch of at most EARLY_RESUME_MAX_BATCH), and
        not with tensor parallelism, whose followers keep no drafter state to agree on it."""
        if batch_size > EARLY_RESUME_MAX_BATCH or self.tp.size > 1:
            return False
        assert self.drafter is not None
        if not self.drafter.copying_again(req):
            return False
        req.spec.resume(self.step_id)
        return True

    def worth_drafting(self, reqs: list[Req], budgets: list[int]) -> bool:
        """Whether drafting pays for this batch: the tokens its requests are expected to gain reach
        the break-even gain per request of the batch. Expected per request: the mean of each
        request's recent acceptance rate times its drafts, and, unless requests wait, in part the
        batch's least such gain (weigh): where a decode step costs the same at any batch size,
        tokens gained by a request that is not the batch's last to finish shorten nothing
        (batch_share weighs the two). In a batch of several, neither more than what the recent
        verify steps of batches of about its size realized (labkit.speculative.step_costs.
        RealizedGains): a request's rate is an average over its verify steps, and the least of a
        batch's requests in one step keeps less than the least of their averages.
        Break-even: speculative_min_batch_gain when set, else what this machine's step times say
        (labkit.speculative.step_costs; 1.0 until both kinds of step were timed at this batch size).
        One drafting request makes the whole batch a verify step, whose tokens the host waits for."""
        if not any(budgets):
            return False
        gains = [r.spec.recent_rate * b for r, b in zip(reqs, budgets)]
        mean, least = sum(gains) / len(gains), min(gains)
        realized = self.realized_gain(len(reqs))
        if realized is not None:
            mean, least = min(mean, realized[0]), min(least, realized[1])
        return weigh(mean, least, self.batch_share(len(reqs))) >= self.break_even(len(reqs))

    def batch_share(self, batch_size: int) -> float:
        """How much of the batch's mean gain counts (worth_drafting): 1 alone, when requests wait (a
        finished request's place is taken), or under a fixed speculative_min_batch_gain; else the
        share of a decode step's time that grows with the batch (StepCosts.batch_share; 1 until
        measured)."""
        waiting = bool(self.waiting_queue or self.chunked_req)
        if batch_size < 2 or waiting or self.config.speculative_min_batch_gain is not None:
            return 1.0
        return self.step_costs.batch_share(batch_size, 1.0)

    def realized_gain(self, batch_size: int) -> tuple[float, float] | None:
        """What the recent verify steps of batches of about this size realized per request, mean and
        least (RealizedGains); None alone (a request's own rate is what its verify steps realized),
        under a fixed speculative_min_batch_gain, or when no gain is recent."""
        if self.config.speculative_min_batch_gain is not None or batch_size < 2:
            return None
        return self.realized_gains.recent(self.step_id, batch_size)

    def drafting_budgets(self, reqs: list[Req]) -> list[int] | None:
        """draft_budgets(reqs) when worth_drafting says drafting pays for them, else None. The
        common refusal is decided first, without a pass over the requests: a batch whose recent
        verify steps realized less than the break-even (worth_drafting would cap its expected gain
        there), held for REFUSAL_HOLD_STEPS. It runs before every decode step, on the host's share of
        the step."""
        size = bucket(len(reqs))
        if self.step_id < self.refused_until.get(size, 0):
            return None
        realized = self.realized_gain(len(reqs))
        if realized is not None and weigh(*realized, self.batch_share(len(reqs))) < self.break_even(len(reqs)):
            self.refused_until[size] = self.step_id + REFUSAL_HOLD_STEPS
            return None
        budgets = self.draft_budgets(reqs)
        return budgets if self.worth_drafting(reqs, budgets) else None

    def record_gains(self, batch_size: int, accepted: int, least: float | None) -> None:
        """A verify step's realized gains (RealizedGains.record), weighed as worth_drafting weighs."""
        share = self.batch_share(batch_size)
        self.realized_gains.record(self.step_id, batch_size, accepted, self.break_even(batch_size), share, least)

    def break_even(self, batch_size: int) -> float:
        """Accepted drafts per request at which a verify step of batch_size requests pays:
        speculative_min_batch_gain when set, else the measured one (labkit.speculative.step_costs)."""
        fixed = self.config.speculative_min_batch_gain
        return self.step_costs.break_even(batch_size, DEFAULT_BREAK_EVEN) if fixed is None else fixed

    def record_spec_step(self, batch: ScheduleBatch, seconds: float) -> None:
        """Time the step for the break-even (the leader's clock only). A step that waited for the
        tokens in flight in order to draft and then found nothing to verify costs what a verify step
        costs in overlap: it is timed as one."""
        mode = batch.forward_mode
        if self.spec_attempt and mode == ForwardMode.DECODE:
            mode = ForwardMode.TARGET_VERIFY
        if self.tp.is_leader:
            self.step_costs.record(mode, len(batch.reqs), seconds)

    def prepare_verify(self, batch: ScheduleBatch, budgets: list[int] | None) -> bool:
        """Make a DECODE batch a TARGET_VERIFY one: its requests' drafts, their KV slots and the
        sampler's rows. False (the batch untouched) when drafting does not pay (drafting_budgets, then
        worth_drafting of the drafts found), or the slots are short. `budgets`: drafting_budgets of
        the batch's requests as asked this step, or None to ask now."""
        assert self.drafter is not None
        if budgets is None:
            budgets = self.drafting_budgets(batch.reqs)
        if budgets is None:
            return False
        drafts = self.propose(batch.reqs, budgets)
        vocab = self.model_runner.vocab_size
        if any(not 0 <= t < vocab for d in drafts for t in d):  # would fail deep in the embedding
            name = self.config.speculative_algorithm
            raise ValueError(f"drafter {name!r} proposed a token id outside the vocabulary [0, {vocab})")
        for req, budget, draft in zip(batch.reqs, budgets, drafts):
            if budget and not draft:  # drafting for nothing costs the host (and the overlap, unless ahead)
                req.spec.miss(self.step_id, self.config.speculative_min_accept_rate)
        # Asked again of the drafts found: a request left without any gains nothing (and, where the
        # batch's least gain counts, neither does its batch).
        if not self.worth_drafting(batch.reqs, [len(d) for d in drafts]) or not alloc_for_verify(
            batch, drafts, self.req_to_token_pool, self.allocator, self.page_size
        ):
            # A batch that drafted and found nothing worth verifying (no drafts, too few, no free
            # pages) gained nothing from it: a fruitless probe, as a verify step that kept nothing.
            self.record_gains(len(batch.reqs), 0, 0)
            return False
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.drafts = drafts
        batch.sample_rows = verify_rows(batch.reqs, drafts)
        return True

    def run_verify_batch(self, batch: ScheduleBatch, out: StepOutput) -> None:
        """Forward, pick the target's token at every row, keep each request's accepted run (cut where
        a stop condition falls inside it), and give back the KV of what was not kept."""
        assert self.drafter is not None
        launched = self.run_batch(batch, out)
        # A request whose token in flight finishes it keeps none of this step's rows: where its
        # drafts' slots start (the row of that token stays: its KV is computed here and cached).
        ends = [r.kv_len + 1 + len(d) for r, d in zip(batch.reqs, batch.drafts)]
        ahead = self.in_flight is not None  # the step before is still on its way (drafted ahead)
        if ahead:
            pool, page = self.req_to_token_pool, self.page_size
            past_token = [rejected_slots(r, end, pool, page, kept=1) for r, end in zip(batch.reqs, ends)]
            self._take_in_flight(out, batch)
        result = launched.wait()
        target_ids = result.next_token_ids.tolist()
        logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        row = 0
        rejected, finished, going_on = [], [], []  # going_on: drafts kept by requests still running
        for i, (req, draft, gained) in enumerate(zip(batch.reqs, batch.drafts, accept(batch.drafts, target_ids))):
            first, row = row, row + 1 + len(draft)
            if ahead and req.finished():  # by the token taken in flight
                rejected.append(past_token[i])
                continue
            kept = []
            for j, token in enumerate(gained):
                req.output_ids.append(token)
                kept.append(token)
                self.take_token(req, first + j, result, logprobs)
                if req.finished():
                    break
            req.kv_len = req.seqlen - 1
            rejected.append(rejected_slots(req, ends[i], self.req_to_token_pool, self.page_size))
            # After the token taken from the step in flight, if it was this request's (overlap).
            out.new_token_ids.setdefault(req.rid, []).extend(kept)
            if draft:
                accepted = min(len(kept), len(gained) - 1)  # drafts kept (a stop may cut the run)
                req.spec.record(len(draft), accepted, self.step_id, self.config.speculative_min_accept_rate)
                out.drafts[req.rid], out.accepted[req.rid] = draft, accepted
            if req.finished():
                finished.append(req)
            else:
                going_on.append(out.accepted.get(req.rid, 0))
        out.rollback_slots += sum(-(-len(slots) // self.page_size) * self.page_size for slots in rejected)
        self.record_gains(len(batch.reqs), sum(out.accepted.values()), min(going_on, default=None))
        # One free for the batch (a free costs a few tensor ops, whatever its size), before the
        # finished requests hand the rest of their KV to the cache.
        self.allocator.free(torch.cat(rejected))
        for req in finished:
            self._finish(req, False)
            out.finished.append(req)
