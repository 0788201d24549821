"""Overlap scheduling: a request that finishes while its next decode step is already scheduled
rides that step as an extra row. Its token is dropped, and the KV slot the row wrote (its last
token's) goes into the prefix cache with the rest of the request: nothing is held afterwards."""

from __future__ import annotations

import pytest

from labkit import Engine
from labkit.trace import Station

PROMPT = [7, 8, 9, 10, 11, 12]
NEW_TOKENS = 4


@pytest.mark.parametrize("overlap", [False, True])
def test_a_finished_request_s_last_token_is_cached_only_when_an_extra_row_computed_its_kv(overlap):
    engine = Engine(
        model_path="tiny-llama",
        load_format="dummy",
        dtype="float32",
        enable_trace=True,
        overlap_schedule_on_cpu=overlap,
        disable_overlap_schedule=not overlap,
    )
    out = engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS})
    rid, output = out["meta_info"]["id"], out["output_ids"]
    assert len(output) == NEW_TOKENS
    # The prefill, the decodes, and with overlap one decode more: the extra row.
    assert sum(rid in s.rids for s in engine.tracer.steps) == NEW_TOKENS + overlap
    sampled = [e.detail["token"] for e in engine.tracer.events if e.rid == rid and e.station == Station.SAMPLE]
    assert len(sampled) == NEW_TOKENS + overlap and sampled[:NEW_TOKENS] == output  # the extra token is dropped
    cached = engine.tree_cache.match_prefix(PROMPT + output).device_indices
    # Without overlap the last token's KV is never computed; the extra row computed it, and it is cached.
    assert len(cached) == len(PROMPT) + len(output) - (not overlap)
    usage = engine.pool_usage()
    assert usage.request_owned == usage.protected == 0 and usage.evictable == len(cached)
    engine.flush_cache()
    assert engine.allocator.available_size() == engine.allocator.size
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
