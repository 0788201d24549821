"""stream_output: one scheduler step -> the BatchTokenIDOutput the DetokenizerManager consumes. The
one place a step's results become a message; the Engine hands it to its DetokenizerManager in
process, the server's scheduler loop sends it over ZMQ to the detokenizer process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.io_struct import BatchTokenIDOutput, DetokenizeParams, ReqOutput

if TYPE_CHECKING:
    from labkit.scheduler.schedule_batch import Req
    from labkit.scheduler.scheduler import StepOutput


class SchedulerOutputProcessorMixin:
    """Mixed into Scheduler (which provides `running` and `waiting_queue`)."""

    running: list[Req]
    waiting_queue: list[Req]

    def stream_output(self, out: StepOutput) -> BatchTokenIDOutput:
        """One ReqOutput per request that got tokens or finished in `out`: its new token ids (several
        after a verify step), logprobs when asked for, its drafts and accepted drafts of a verify
        step, its finish reason once finished, and (with its first output only) what the
        detokenizer needs to know about it."""
        reqs = {r.rid: r for r in self.running}
        reqs.update((r.rid, r) for r in out.finished)
        # A request can get its token and be retracted in the same step: it is back in the queue.
        retracted = set(out.retracted) & set(out.new_token_ids)
        if retracted:
            reqs.update((r.rid, r) for r in self.waiting_queue if r.rid in retracted)
        outputs = []
        finished_only = [r.rid for r in out.finished if r.rid not in out.new_token_ids]
        for rid in [*out.new_token_ids, *finished_only]:
            req = reqs[rid]
            params = req.sampling_params
            new = out.new_token_ids.get(rid, [])
            o = ReqOutput(rid=rid, token_ids=new, cached_tokens=req.cached_tokens, worker=req.worker)
            if rid in out.drafts:
                o.spec_draft_tokens, o.spec_accepted_tokens = len(out.drafts[rid]), out.accepted[rid]
            if params.return_logprob and new:
                o.token_logprobs = req.output_token_logprobs[-len(new) :]
                if params.top_logprobs_num:
                    o.top_logprobs = req.output_top_logprobs[-len(new) :]
            if not req.detokenize_params_sent:  # the first output: the prompt's logprobs go with it
                if params.wants_input_logprobs:
                    o.input_token_logprobs = req.input_token_logprob_pairs()
                    o.input_top_logprobs = req.input_top_logprobs if params.top_logprobs_num else None
                o.detokenize = DetokenizeParams(
                    stop=params.stop_strs,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
                req.detokenize_params_sent = True
            if req.finished_reason is not None:
                o.finish_reason = req.finished_reason.to_dict()
            outputs.append(o)
        return BatchTokenIDOutput(outputs=outputs, step=out.step)
