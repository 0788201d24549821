"""KV memory for a batch (labkit.scheduler.batch_memory): after an extend, a decode or a verify
allocation, each request's req_to_token row holds its cached prefix at 0..prefix_len-1 (a fresh
request's) and the slots allocated for it at prefix_len..seq_len-1, in order; alike whether the batch
has one request (one slice write) or several (one indexed write)."""

from __future__ import annotations

import pytest

from labkit.mem_cache import ChunkCache, ReqToTokenPool, TokenToKVPoolAllocator
from labkit.model_executor.forward_batch import ForwardMode
from labkit.sampling.sampling_params import SamplingParams
from labkit.scheduler.batch_memory import alloc_for_decode, alloc_for_extend, alloc_for_verify
from labkit.scheduler.schedule_batch import Req, ScheduleBatch


def _pools(page_size: int) -> tuple[ReqToTokenPool, TokenToKVPoolAllocator, ChunkCache]:
    pool, allocator = ReqToTokenPool(4, 256), TokenToKVPoolAllocator(1024, page_size)
    return pool, allocator, ChunkCache(pool, allocator, page_size)


def _row(pool: ReqToTokenPool, req: Req, end: int) -> list[int]:
    assert req.req_pool_idx is not None
    return pool.host[req.req_pool_idx, :end].tolist()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_each_row_holds_its_prefix_then_its_new_slots(page_size: int, batch_size: int) -> None:
    pool, allocator, cache = _pools(page_size)
    cached = allocator.alloc_extend([0], [6], [-1])  # a prefix some earlier request left in the cache
    assert cached is not None
    reqs = [Req(f"r{i}", list(range(10 + 3 * i)), SamplingParams()) for i in range(batch_size)]
    reqs[0].prefix_indices = cached
    for req in reqs:
        req.extend_input_len = len(req.origin_input_ids) - len(req.prefix_indices)

    extend = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.EXTEND)
    assert alloc_for_extend(extend, pool, allocator, cache, page_size)
    new = extend.out_cache_loc.split(extend.extend_lens)
    assert _row(pool, reqs[0], 10) == cached.tolist() + new[0].tolist()
    for req, slots in zip(reqs[1:], new[1:]):
        assert _row(pool, req, len(req.origin_input_ids)) == slots.tolist()
    for req, p, e in zip(reqs, extend.prefix_lens, extend.extend_lens):
        req.kv_len = p + e
        req.output_ids = [7]

    decode = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE)
    assert alloc_for_decode(decode, pool, allocator, cache, page_size)
    for req, slot in zip(reqs, decode.out_cache_loc.tolist()):
        assert _row(pool, req, req.kv_len + 1)[-1] == slot
        req.kv_len += 1

    before = [_row(pool, req, req.kv_len) for req in reqs]
    drafts = [[1, 2, 3], [4]][:batch_size]
    verify = ScheduleBatch(reqs=reqs, forward_mode=ForwardMode.DECODE)
    assert alloc_for_verify(verify, drafts, pool, allocator, page_size)
    slots = verify.out_cache_loc.split(verify.extend_lens)
    for req, draft, mine, kept in zip(reqs, drafts, slots, before):
        assert _row(pool, req, req.kv_len + 1 + len(draft)) == kept + mine.tolist()
    assert len(set(verify.out_cache_loc.tolist())) == verify.out_cache_loc.numel()
