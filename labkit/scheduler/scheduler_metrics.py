"""SchedulerMetricsMixin: what the Scheduler reports about itself: KV pool usage by owner, and the
trace records of each forward (stations 6-8) and each step (StepRecord plus a tree and queue
snapshot for labkit.viz)."""

from __future__ import annotations

import time
import zlib
from typing import TYPE_CHECKING

import torch

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.base_prefix_cache import BasePrefixCache
from labkit.mem_cache.memory_pool import ReqToTokenPool
from labkit.model_executor.forward_batch import ForwardMode
from labkit.sampling.sampler import SampleOutput
from labkit.scheduler.schedule_batch import Req, ScheduleBatch
from labkit.speculative.verify import accept
from labkit.trace.events import PoolUsage, Station, StepRecord
from labkit.trace.recorder import Tracer

if TYPE_CHECKING:
    from labkit.distributed.parallel_state import TPGroup
    from labkit.scheduler.scheduler import StepOutput


class SchedulerMetricsMixin:
    """Mixed into Scheduler, which provides the state below. Reads it only (and takes the group's
    collective counts for each step's record)."""

    page_size: int
    step_id: int
    running: list[Req]
    waiting_queue: list[Req]
    chunked_req: Req | None
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    tp: TPGroup

    def pool_usage(self) -> PoolUsage:
        """KV slots by owner, counted independently (a leak shows as a sum that is off). Vectorized:
        the Engine reports it every step, over every live request's slots and the whole tree."""
        p = self.page_size
        live = self.running + ([self.chunked_req] if self.chunked_req else [])
        table = self.req_to_token_pool.host
        rows = [table[r.req_pool_idx, : r.kv_len] for r in live if r.req_pool_idx is not None and r.kv_len]
        request_owned = 0
        if rows:
            owned_pages = torch.cat(rows) // p if p > 1 else torch.cat(rows)
            held = torch.zeros(int(owned_pages.max()) + 1, dtype=torch.bool)
            held[owned_pages] = True
            if in_tree := [node.value for node in self.tree_cache.nodes() if node.value.numel()]:
                tree_pages = torch.cat(in_tree) // p if p > 1 else torch.cat(in_tree)
                held[tree_pages[tree_pages < held.numel()]] = False
            request_owned = int(held.sum()) * p
        return PoolUsage(
            total=self.allocator.size,
            free=self.allocator.available_size(),
            evictable=self.tree_cache.evictable_size(),
            protected=self.tree_cache.protected_size(),
            request_owned=request_owned,
        )

    def _trace_forward(
        self,
        tracer: Tracer,
        batch: ScheduleBatch,
        logits: torch.Tensor,
        sample: SampleOutput,
        start: float,
        mid: float,
        end: float,
    ) -> None:
        top = torch.topk(logits, k=min(5, logits.shape[-1]), dim=-1)
        offset = 0
        loc = batch.out_cache_loc.tolist()
        verify = batch.forward_mode == ForwardMode.TARGET_VERIFY
        for i, req in enumerate(batch.reqs):
            n = batch.extend_lens[i]
            sl = slice(offset, offset + n)
            offset += n
            row, extra = i, {}
            if verify:  # logits for every row: show the row whose token ended the accepted run
                targets = sample.next_token_ids[sl].tolist()
                kept = accept([batch.drafts[i]], targets)[0]
                row, extra = sl.start + len(kept) - 1, {"draft": batch.drafts[i], "target": targets, "kept": kept}
            tracer.station(
                req.rid,
                Station.BATCH,
                start,
                start,
                step=self.step_id,
                mode=batch.forward_mode.name,
                batch_size=len(batch.reqs),
                prefix_len=batch.prefix_lens[i],
                extend_len=n,
            )
            tracer.station(
                req.rid,
                Station.FORWARD,
                start,
                mid,
                step=self.step_id,
                input_ids=batch.input_ids[sl],
                positions=batch.positions[sl],
                out_cache_loc=loc[sl],
                req_pool_idx=req.req_pool_idx,
            )
            tracer.station(
                req.rid,
                Station.SAMPLE,
                mid,
                end,
                step=self.step_id,
                token=int(sample.next_token_ids[row]),
                discarded=req.is_chunked or req.sampling_params.max_new_tokens == 0,  # a chunk, or a prompt only scored
                top_ids=top.indices[row].tolist(),
                top_logits=top.values[row].tolist(),
                **extra,
            )

    def _trace_step(self, tracer: Tracer, out: StepOutput, start: float) -> None:
        comm = self.tp.stats.take()
        tracer.step(
            StepRecord(
                step=out.step,
                start=start,
                end=time.perf_counter(),
                forward_mode=out.forward_mode.name,
                rids=out.rids,
                extend_lens=out.extend_lens,
                prefix_lens=out.prefix_lens,
                num_tokens=sum(out.extend_lens),
                cache_hit_tokens=out.cache_hit_tokens,
                pool=self.pool_usage(),
                running=len(self.running),
                waiting=len(self.waiting_queue),
                chunked_rid=self.chunked_req.rid if self.chunked_req else None,
                finished=[r.rid for r in out.finished],
                retracted=out.retracted,
                blocked=out.blocked,
                rank=self.tp.rank,
                comm_calls=comm.calls,
                comm_bytes=comm.bytes,
                comm_seconds=comm.seconds,
                sampled_digest=zlib.crc32(repr(sorted(out.new_token_ids.items())).encode()),
                expert_tokens=out.expert_tokens,
                drafts=out.drafts,
                accepted=out.accepted,
                rollback_slots=out.rollback_slots,
                phases=out.phases,
                processed_step=out.processed_step,
                host_pool=self.tree_cache.tier_usage(),
            )
        )
        # The tree with its locks and the waiting queue with its matches, for replaying (labkit.viz).
        tracer.snapshot(out.step, self.tree_cache, self.waiting_queue)
