"""The HTTP benchmark's requests sent from several client processes at once.

One Python process parses a server's chunks at a bounded rate: on an H200 serving 256 requests at
once, a single client measured about 22,000 output tokens/s where two, each sending half the requests,
measured 33,800 together, the in-process engine's rate (docs/benchmarks.md). So `--client-processes N`
splits the requests over N spawned processes: the same arrival offsets, each process holding at most
its share of --max-concurrency, a conversation's turns kept in one process (a turn waits for its reply).
They start together (a barrier), and their outputs come back in request order on one clock."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import time
from dataclasses import dataclass
from typing import Any

import httpx

from labkit.bench.backends import HttpTarget, RequestOutput, run_http
from labkit.bench.datasets import BenchRequest

START_TIMEOUT_S = 300.0  # for every process to start, import and reach the start line


@dataclass
class Part:
    """The requests (indices into the run's list) one client process sends, and its concurrency cap."""

    indices: list[int]
    max_concurrency: int | None


def split(requests: list[BenchRequest], max_concurrency: int | None, processes: int) -> list[Part]:
    """Requests dealt to at most `processes` parts in turn, a conversation's turns to one part (by its
    first turn); the concurrency cap divided so the parts' caps add up to it (each at least 1)."""
    if processes < 1:
        raise ValueError(f"client processes must be >= 1, got {processes}")
    groups: dict[Any, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(("conversation", r.conversation) if r.conversation is not None else i, []).append(i)
    n = max(1, min(processes, len(groups), max_concurrency or processes))
    dealt: list[list[int]] = [[] for _ in range(n)]
    for g, members in enumerate(groups.values()):
        dealt[g % n].extend(members)
    caps = [None if max_concurrency is None else max_concurrency // n + (k < max_concurrency % n) for k in range(n)]
    return [Part(sorted(ix), cap) for ix, cap in zip(dealt, caps)]


Run = tuple[list[RequestOutput], float, float]  # a part's outputs, wall-clock start and duration


def merge(n: int, parts: list[Part], runs: list[Run]) -> tuple[list[RequestOutput], float]:
    """The parts' outputs in request order, their starts on the earliest part's clock, and the run's
    duration from the first part's start to the last part's end (runs[k] is part k's)."""
    t0 = min(start for _, start, _ in runs)
    merged: list[RequestOutput | None] = [None] * n
    for part, (outs, start, _) in zip(parts, runs):
        for i, out in zip(part.indices, outs, strict=True):
            out.start += start - t0
            merged[i] = out
    missing = [i for i, o in enumerate(merged) if o is None]
    if missing:
        raise ValueError(f"no output for requests {missing[:5]}")
    return [o for o in merged if o is not None], max(start + d for _, start, d in runs) - t0


def _client(
    target: HttpTarget,
    requests: list[BenchRequest],
    arrivals: list[float],
    cap: int | None,
    barrier: Any,
    results: Any,
    k: int,
) -> None:
    """A client process: connect, wait at the start line with the others, run its part, send back its
    Run (with its index k)."""

    async def go() -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            await asyncio.to_thread(barrier.wait, START_TIMEOUT_S)
            start = time.time()
            outs, duration = await run_http(client, target, requests, arrivals, cap)
            results.put((k, outs, start, duration))

    asyncio.run(go())


def run_http_processes(
    target: HttpTarget,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_concurrency: int | None,
    processes: int,
) -> tuple[list[RequestOutput], float]:
    """run_http's outputs and duration, the requests sent from `processes` spawned client processes."""
    parts = split(requests, max_concurrency, processes)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(parts)), ctx.Queue()  # the processes start each other
    procs = [
        ctx.Process(
            target=_client,
            args=(target, [requests[i] for i in p.indices], [arrivals[i] for i in p.indices], p.max_concurrency)
            + (barrier, results, k),
            daemon=True,
        )
        for k, p in enumerate(parts)
    ]
    for p in procs:
        p.start()
    try:
        runs: dict[int, Run] = {}
        while len(runs) < len(parts):
            try:
                k, outs, start, duration = results.get(timeout=1.0)
                runs[k] = (outs, start, duration)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process failed (exit code {dead[0]})") from None
        return merge(len(requests), parts, [runs[k] for k in range(len(parts))])
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
