"""The serving benchmark's requests split over client processes: every request sent by exactly one
process, a conversation's turns by the same one, the concurrency caps adding up to the run's, and the
outputs merged back in request order on one clock."""

from __future__ import annotations

import socket

import pytest

from labkit.bench.backends import HttpTarget, RequestOutput
from labkit.bench.client_processes import Part, merge, run_http_processes, split
from labkit.bench.datasets import BenchRequest


def reqs(conversations: list[int | None]) -> list[BenchRequest]:
    """A request per entry: a turn of that conversation (numbered in order), or alone (None)."""
    return [
        BenchRequest([1, 2], 2, 4, conversation=c, turn=conversations[:i].count(c) if c is not None else 0)
        for i, c in enumerate(conversations)
    ]


def test_split_deals_requests_in_turn_and_divides_the_concurrency_cap():
    parts = split(reqs([None] * 10), max_concurrency=7, processes=3)
    assert [p.indices for p in parts] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [p.max_concurrency for p in parts] == [3, 2, 2]
    assert [p.max_concurrency for p in split(reqs([None] * 4), None, 2)] == [None, None]


def test_split_keeps_a_conversations_turns_in_one_process():
    conversations = [0, 1, 2, 0, 1, 2, 0, None, 1]
    parts = split(reqs(conversations), max_concurrency=None, processes=2)
    owner = {i: k for k, p in enumerate(parts) for i in p.indices}
    assert sorted(owner) == list(range(len(conversations)))  # each request exactly once
    for c in (0, 1, 2):
        assert len({owner[i] for i, ci in enumerate(conversations) if ci == c}) == 1
    assert all(p.indices == sorted(p.indices) for p in parts)  # turns stay in order within a process


def test_split_uses_no_more_processes_than_requests_or_slots():
    assert len(split(reqs([None] * 2), None, 8)) == 2
    assert len(split(reqs([0, 0, 0]), None, 4)) == 1  # one conversation: one process
    assert [p.max_concurrency for p in split(reqs([None] * 9), 3, 8)] == [1, 1, 1]
    with pytest.raises(ValueError):
        split(reqs([None]), None, 0)


def test_merge_restores_request_order_on_the_earliest_clock():
    parts = [Part([0, 2], None), Part([1], None)]
    a, b, c = (RequestOutput(success=True, start=s, output_len=n) for s, n in ((0.0, 1), (0.5, 3), (0.25, 2)))
    outs, duration = merge(3, parts, [([a, b], 100.0, 2.0), ([c], 100.75, 1.5)])
    assert [o.output_len for o in outs] == [1, 2, 3]
    assert [o.start for o in outs] == [0.0, 1.0, 0.5]  # part 1 started 0.75 s after part 0
    assert duration == pytest.approx(2.25)  # 100.75 + 1.5 - 100.0
    with pytest.raises(ValueError):
        merge(4, parts, [([a, b], 100.0, 2.0), ([c], 100.75, 1.5)])


def test_client_processes_return_every_requests_output_in_order():
    """The whole path through three client processes, against a port nothing listens on: each request
    fails on its own (recorded, not raised) and comes back at its index."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the clients connect
    requests = [BenchRequest([1] * (n + 1), n + 1, 4) for n in range(7)]
    target = HttpTarget(f"http://127.0.0.1:{port}", "", "generate")
    outs, duration = run_http_processes(target, requests, [0.0] * 7, max_concurrency=4, processes=3)
    assert [o.prompt_len for o in outs] == [r.prompt_len for r in requests]
    assert all(not o.success and "ConnectError" in o.error for o in outs), [o.error for o in outs]
    assert duration >= max(o.start + o.latency for o in outs) >= 0
