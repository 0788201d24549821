"""KV memory for a batch: request slots, KV slots (evicting from the cache when short) and the
req_to_token rows. The scheduler calls these; the pools and the cache stay the owners of their state."""

from __future__ import annotations

import torch

from labkit.mem_cache.allocator import TokenToKVPoolAllocator
from labkit.mem_cache.base_prefix_cache import BasePrefixCache, held_row
from labkit.mem_cache.memory_pool import ReqToTokenPool
from labkit.scheduler.schedule_batch import EMPTY_INDICES, Req, ScheduleBatch


def new_slots_needed(prefix_len: int, seq_len: int, page_size: int) -> int:
    """KV slots to allocate to grow a request from prefix_len to seq_len tokens (whole pages)."""
    return (-(-seq_len // page_size) - (-(-prefix_len // page_size))) * page_size


def ensure_free(tree_cache: BasePrefixCache, allocator: TokenToKVPoolAllocator, needed: int) -> bool:
    short = needed - allocator.available_size()
    if short > 0:
        tree_cache.evict(short)
    return allocator.available_size() >= needed


def _last_locs(pool: ReqToTokenPool, req_pool_indices: list[int], prefix_lens: list[int], page_size: int) -> list[int]:
    """Slot of each request's position prefix_len - 1 (-1 where the prefix is empty), in one gather:
    this runs for every decode step. At page size 1 the allocator never reads them (no request's last
    page has room), so nothing is gathered."""
    if page_size == 1:
        return [-1] * len(prefix_lens)
    rows = torch.tensor(req_pool_indices, dtype=torch.int64)
    pos = torch.tensor(prefix_lens, dtype=torch.int64) - 1
    return pool.host[rows, pos.clamp(min=0)].masked_fill_(pos < 0, -1).tolist()


def alloc_for_extend(
    batch: ScheduleBatch,
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    tree_cache: BasePrefixCache,
    page_size: int,
) -> bool:
    """Give every request of an EXTEND batch a request slot and KV slots for its new tokens.
    False (and nothing held by this call) when memory is short."""
    fresh = [r for r in batch.reqs if r.req_pool_idx is None]
    slots = req_to_token_pool.alloc(len(fresh))
    if slots is None:
        return False
    for req, slot in zip(fresh, slots):
        req.req_pool_idx = slot
    prefix_lens = [len(r.prefix_indices) for r in batch.reqs]
    seq_lens = [p + r.extend_input_len for p, r in zip(prefix_lens, batch.reqs)]
    needed = sum(new_slots_needed(p, s, page_size) for p, s in zip(prefix_lens, seq_lens))
    out = None
    if ensure_free(tree_cache, allocator, needed):
        last_locs = _last_locs(req_to_token_pool, batch.req_pool_indices, prefix_lens, page_size)
        out = allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
    if out is None:
        for req in fresh:
            req_to_token_pool.free(held_row(req))
            req.req_pool_idx = None
        return False
    # One write for the fresh requests' cached prefixes and everyone's new slots.
    row_parts: list[torch.Tensor] = []
    col_parts: list[torch.Tensor] = []
    value_parts: list[torch.Tensor] = []
    for req in fresh:
        n = len(req.prefix_indices)
        row_parts.append(torch.full((n,), held_row(req), dtype=torch.int64))
        col_parts.append(torch.arange(n))
        value_parts.append(req.prefix_indices)
    _write_new_slots(req_to_token_pool, batch.reqs, prefix_lens, seq_lens, out, row_parts, col_parts, value_parts)
    for req, p, s in zip(batch.reqs, prefix_lens, seq_lens):
        ids = req.all_ids
        batch.input_ids.extend(ids[p:s])
        batch.positions.extend(range(p, s))
    batch.prefix_lens, batch.out_cache_loc = prefix_lens, out
    batch.extend_lens = [s - p for p, s in zip(prefix_lens, seq_lens)]
    return True


def _write_new_slots(
    req_to_token_pool: ReqToTokenPool,
    reqs: list[Req],
    prefix_lens: list[int],
    seq_lens: list[int],
    slots: torch.Tensor,
    row_parts: list[torch.Tensor],
    col_parts: list[torch.Tensor],
    value_parts: list[torch.Tensor],
) -> None:
    """Write `slots` (positions prefix_lens[i]..seq_lens[i]-1 of each request, in order) into the
    requests' req_to_token rows, in one write with the entries already in the *_parts lists. One
    request's entries are one span of its row, ending at its seq_len (a fresh request's cached prefix
    starts the row): a slice write, cheaper on the host than the indexed one (a batch-1 step pays it
    once a step, a speculative verify step for all its drafts)."""
    if len(reqs) == 1:
        values = torch.cat([*value_parts, slots]) if value_parts else slots
        req_to_token_pool.write_row(held_row(reqs[0]), seq_lens[0] - values.numel(), values)
        return
    for req, p, s in zip(reqs, prefix_lens, seq_lens):
        row_parts.append(torch.full((s - p,), held_row(req), dtype=torch.int64))
        col_parts.append(torch.arange(p, s))
    value_parts.append(slots)
    req_to_token_pool.write(torch.cat(row_parts), torch.cat(col_parts), torch.cat(value_parts))


def alloc_for_verify(
    batch: ScheduleBatch,
    drafts: list[list[int]],
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    page_size: int,
) -> bool:
    """KV slots for each decoding request's last token and its drafts (positions kv_len ..
    kv_len + len(draft)), from free pages only: drafts never evict cached prefixes. False, with
    nothing allocated, when the free pages do not suffice."""
    reqs = batch.reqs
    prefix_lens = [r.kv_len for r in reqs]
    seq_lens = [p + 1 + len(d) for p, d in zip(prefix_lens, drafts)]
    if sum(new_slots_needed(p, s, page_size) for p, s in zip(prefix_lens, seq_lens)) > allocator.available_size():
        return False
    last_locs = _last_locs(req_to_token_pool, batch.req_pool_indices, prefix_lens, page_size)
    out = allocator.alloc_extend(prefix_lens, seq_lens, last_locs)
    if out is None:
        return False
    _write_new_slots(req_to_token_pool, reqs, prefix_lens, seq_lens, out, [], [], [])
    for req, p, draft in zip(reqs, prefix_lens, drafts):
        batch.input_ids += [req.output_ids[-1], *draft]
        batch.positions.extend(range(p, p + 1 + len(draft)))
    batch.prefix_lens, batch.out_cache_loc = prefix_lens, out
    batch.extend_lens = [1 + len(d) for d in drafts]
    return True


def rejected_slots(
    req: Req, end: int, req_to_token_pool: ReqToTokenPool, page_size: int, kept: int = 0
) -> torch.Tensor:
    """KV rollback after verification: the slots of positions req.kv_len + kept .. end-1 that a
    verify step allocated and did not keep, in the pages that start at or after kv_len + kept (a page
    the request still uses stays its own: its next tokens fill it). The caller frees them
    (allocator.free frees whole pages)."""
    start = -(-(req.kv_len + kept) // page_size) * page_size
    return req_to_token_pool.host[held_row(req), start:end] if start < end else EMPTY_INDICES


def decode_slots_needed(reqs: list[Req], page_size: int) -> int:
    """A decoding request needs a new page only when its next token starts one."""
    return sum(page_size for r in reqs if r.kv_len % page_size == 0)


def alloc_for_decode(
    batch: ScheduleBatch,
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator,
    tree_cache: BasePrefixCache,
    page_size: int,
) -> bool:
    """One KV slot per decoding request for its last sampled token."""
    reqs = batch.reqs
    if not ensure_free(tree_cache, allocator, decode_slots_needed(reqs, page_size)):
        return False
    prefix_lens = [r.kv_len for r in reqs]
    last_locs = _last_locs(req_to_token_pool, batch.req_pool_indices, prefix_lens, page_size)
    out = allocator.alloc_decode([p + 1 for p in prefix_lens], last_locs)
    if out is None:
        return False
    if len(reqs) == 1:  # a slice write (_write_new_slots)
        req_to_token_pool.write_row(held_row(reqs[0]), prefix_lens[0], out)
    else:
        rows = torch.tensor(batch.req_pool_indices, dtype=torch.int64)
        req_to_token_pool.write(rows, torch.tensor(prefix_lens, dtype=torch.int64), out)
    batch.input_ids = [r.output_ids[-1] for r in reqs]
    batch.positions = prefix_lens
    batch.prefix_lens, batch.extend_lens, batch.out_cache_loc = prefix_lens, [1] * len(reqs), out
    return True
