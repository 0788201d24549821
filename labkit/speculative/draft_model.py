"""The draft-model drafter (SGLang's standalone drafter): a smaller model that shares the target's
vocabulary drafts greedily, k tokens in k forwards, with its own ModelRunner and KV pool.

Each target request has a draft twin (a Req over the draft pools) whose KV covers a prefix of the
target's ids. Before drafting, the twin is synced: its KV is kept up to the first id where it and the
target disagree (a rejected draft), the rest is given back; then one extend catches it up to the
target's last token, and decode steps draft the rest. Requests that no longer fit the draft pool
draft nothing that step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from labkit.mem_cache.chunk_cache import ChunkCache
from labkit.model_executor.forward_batch import ForwardMode
from labkit.sampling.sampling_params import SamplingParams
from labkit.scheduler.batch_memory import alloc_for_decode, alloc_for_extend, rejected_slots
from labkit.scheduler.schedule_batch import Req, ScheduleBatch
from labkit.speculative.base import Drafter, DraftReq, register_drafter

if TYPE_CHECKING:
    from labkit.config import EngineConfig
    from labkit.model_executor.model_runner import ModelRunner


@register_drafter("draft")
class DraftModelDrafter(Drafter):
    def __init__(self, config: EngineConfig, target: ModelRunner) -> None:
        from labkit.model_executor.model_runner import ModelRunner  # the runner imports this package

        super().__init__(config, target)
        draft_config = dataclasses.replace(
            config,
            model_path=config.speculative_draft_model_path,
            load_format=config.speculative_draft_load_format,
            tokenizer_path=None,
            speculative_algorithm=None,
            tp_size=1,
            ep_size=1,
            nnodes=1,
            enable_trace=False,
            # As many tokens as the target's pool (every request has a twin here); a fraction of the
            # GPU would be measured after the target's pool took its share.
            max_total_tokens=target.token_to_kv_pool.size,
            mem_fraction_static=None,
        )
        self.runner = ModelRunner(draft_config)
        if self.runner.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({self.runner.vocab_size}) must be the target's ({target.vocab_size})"
            )
        self.page_size = config.page_size
        self.cache = ChunkCache(self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator, self.page_size)
        self.twins: dict[str, Req] = {}  # target rid -> its twin over the draft pools
        self.synced: dict[str, int] = {}  # ids a twin is known to share with its target

    def propose(self, reqs: Sequence[DraftReq], budgets: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in reqs]
        live = [(i, self._synced_twin(r)) for i, (r, k) in enumerate(zip(reqs, budgets)) if k > 0]
        batch = ScheduleBatch(reqs=[t for _, t in live], forward_mode=ForwardMode.EXTEND)
        if not live or not self._alloc(batch, extend=True):
            return drafts
        step = 0
        while True:
            tokens = self._forward(batch)
            for (i, twin), token in zip(live, tokens):
                drafts[i].append(token)
                twin.output_ids.append(token)
            step += 1
            live = [(i, t) for i, t in live if budgets[i] > step]
            batch = ScheduleBatch(reqs=[t for _, t in live], forward_mode=ForwardMode.DECODE)
            if not live or not self._alloc(batch, extend=False):
                return drafts

    def _synced_twin(self, req: DraftReq) -> Req:
        """The request's twin with KV only where its ids still equal the target's, and the target's
        ids (its extend, prefix_indices and extend_input_len set for the catch-up)."""
        ids = req.origin_input_ids + req.output_ids
        twin = self.twins.get(req.rid)
        if twin is None:
            twin = self.twins[req.rid] = Req(req.rid, req.origin_input_ids, SamplingParams(max_new_tokens=0))
            self.synced[req.rid] = 0
        mine = twin.all_ids
        same = self.synced[req.rid]
        while same < min(len(ids), len(mine)) and ids[same] == mine[same]:
            same += 1
        end = twin.kv_len
        twin.kv_len = min(twin.kv_len, same, len(ids) - 1)
        if twin.req_pool_idx is not None:
            pool = self.runner.req_to_token_pool
            self.runner.token_to_kv_pool_allocator.free(rejected_slots(twin, end, pool, self.page_size))
            twin.prefix_indices = pool.host[twin.req_pool_idx, : twin.kv_len].clone()
        twin.output_ids = list(req.output_ids)
        twin.extend_input_len = len(ids) - twin.kv_len
        self.synced[req.rid] = len(ids)
        return twin

    def _alloc(self, batch: ScheduleBatch, extend: bool) -> bool:
        runner = self.runner
        alloc = alloc_for_extend if extend else alloc_for_decode
        return alloc(batch, runner.req_to_token_pool, runner.token_to_kv_pool_allocator, self.cache, self.page_size)

    @torch.inference_mode()
    def _forward(self, batch: ScheduleBatch) -> list[int]:
        """The draft model's greedy next token of each twin; their KV now covers the batch's inputs."""
        logits = self.runner.forward(self.runner.build_forward_batch(batch))
        for twin, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            twin.kv_len = p + n
        return logits.argmax(dim=-1).tolist()

    def release(self, req: DraftReq) -> None:
        twin = self.twins.pop(req.rid, None)
        self.synced.pop(req.rid, None)
        if twin is not None and twin.req_pool_idx is not None:
            self.cache.cache_finished_req(twin)

    def idle(self) -> bool:
        allocator = self.runner.token_to_kv_pool_allocator
        return not self.twins and allocator.available_size() == allocator.size
