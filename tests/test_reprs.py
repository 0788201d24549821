"""The live objects a notebook evaluates show what they hold: a one-line repr and an HTML table
(Jupyter's _repr_html_) with the same facts, read from the objects' own state."""

from __future__ import annotations

import re

import pytest

from labkit import Engine

GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    engine = Engine(model_path="tiny-qwen3", load_format="dummy", device="cpu", max_total_tokens=512)
    engine.generate(input_ids=[5, 6, 7, 8, 9, 10], sampling_params=GREEDY)  # leaves a cached prefix
    return engine


def test_pools_and_allocator_show_their_sizes_and_free_counts(engine):
    slots = engine.req_to_token_pool
    assert repr(slots) == (
        f"ReqToTokenPool(slots={slots.size}, free={slots.available_size()}, max_context_len={slots.max_context_len})"
    )
    alloc = engine.model_runner.token_to_kv_pool_allocator
    assert f"free={alloc.available_size()}" in repr(alloc) and f"size={alloc.size}" in repr(alloc)
    kv = engine.model_runner.token_to_kv_pool
    assert f"tokens={kv.size}" in repr(kv) and f"bytes_per_token={kv.bytes_per_token()}" in repr(kv)
    assert "<table>" in kv._repr_html_() and "dtype" in kv._repr_html_()


def test_the_radix_cache_shows_its_sizes_and_its_tree(engine):
    tree = engine.tree_cache
    assert f"tokens={tree.total_size()}" in repr(tree) and tree.total_size() > 0
    html = tree._repr_html_()
    # One line per node, children indented: the prompt, then (as a child, from the decode steps'
    # inserts) the outputs the cache holds: all but the last token, whose KV was never computed.
    assert re.search(r"<pre>#\d+: 6 tokens \[5 6 7 8 9 10\]\n  #\d+: 2 tokens \[\d+ \d+\]</pre>", html), html


def test_a_request_and_its_batch_say_where_they_are(engine):
    rid = engine.add_request(input_ids=[1, 2, 3, 4], sampling_params=GREEDY)
    req = next(r for r in engine.scheduler.waiting_queue if r.rid == rid)
    assert repr(req).startswith(f"Req(rid={rid}, state=waiting, prompt_tokens=4, output_tokens=0")
    step = engine.step()
    assert f"requests={len(step.rids)}" in repr(step) and f"{step.pool.free} free of {step.pool.total}" in repr(step)
    assert "state=running" in repr(req) and "output_tokens=1" in repr(req)
    while engine.scheduler.has_work():
        engine.step()
    assert "state=finished (length)" in repr(req) and "output_tokens=3" in repr(req)
    batch_html = step._repr_html_()
    assert "<table>" in batch_html and rid in batch_html


def test_a_schedule_batch_lists_each_request_s_prefix_and_new_tokens():
    from labkit.model_executor.forward_batch import ForwardMode
    from labkit.sampling.sampling_params import SamplingParams
    from labkit.scheduler.schedule_batch import Req, ScheduleBatch

    a = Req("a", [1, 2, 3, 4, 5], SamplingParams())
    b = Req("b", [6, 7, 8, 9, 10], SamplingParams())
    batch = ScheduleBatch([a, b], ForwardMode.EXTEND, step=4, input_ids=[4, 5, 6, 7, 8, 9, 10])
    batch.prefix_lens, batch.extend_lens = [3, 0], [2, 5]
    assert (
        repr(batch)
        == "ScheduleBatch(step=4, forward_mode=EXTEND, requests=2, tokens=7, prefix + new=a: 3 + 2, b: 0 + 5)"
    )
