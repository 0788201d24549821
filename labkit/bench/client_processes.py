"""The HTTP benchmark's requests sent from several client processes at once.

One Python process parses a server's chunks at a bounded rate: against the same server on an H200, at
256 requests in flight, one client process measured 20,600-23,500 output tokens/s where four measured
27,000-29,300 (docs/benchmarks.md). So `--client-processes N`
splits the requests over N client processes: the same arrival offsets, each process holding at most
its share of --max-concurrency, a conversation's turns kept in one process (a turn waits for its reply).
They start together once all are ready, and their outputs come back in request order on one clock."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Any, cast

from labkit.bench.backends import HttpTarget, RequestOutput, bench_client, run_http
from labkit.bench.datasets import BenchRequest


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


def _child() -> None:
    """A client process (python -m labkit.bench.client_processes): its part's (target, requests, arrivals,
    cap) pickled on stdin; "ready" once its HTTP client is made; after "go" on stdin, its Run pickled on
    stdout."""
    target, requests, arrivals, cap = pickle.load(sys.stdin.buffer)

    async def go() -> Run:
        async with bench_client() as client:
            sys.stdout.buffer.write(b"ready\n")
            sys.stdout.flush()
            await asyncio.to_thread(sys.stdin.buffer.readline)
            start = time.time()
            outs, duration = await run_http(client, target, requests, arrivals, cap)
            return outs, start, duration

    pickle.dump(asyncio.run(go()), sys.stdout.buffer)
    sys.stdout.flush()


def run_http_processes(
    target: HttpTarget,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_concurrency: int | None,
    processes: int,
) -> tuple[list[RequestOutput], float]:
    """run_http's outputs and duration, the requests sent from `processes` client processes. They are
    fresh interpreters that import only the client (not torch), started together once all are ready."""
    parts = split(requests, max_concurrency, processes)
    procs = [
        subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in parts
    ]
    pipes = [(cast(IO[bytes], p.stdin), cast(IO[bytes], p.stdout)) for p in procs]  # both PIPE
    try:
        for (stdin, _), part in zip(pipes, parts):
            job = (target, [requests[i] for i in part.indices], [arrivals[i] for i in part.indices])
            pickle.dump((*job, part.max_concurrency), stdin)
            stdin.flush()
        for proc, (_, stdout) in zip(procs, pipes):
            if stdout.readline() != b"ready\n":
                raise RuntimeError(f"a client process failed to start (exit code {proc.wait()})")
        for stdin, _ in pipes:  # the start line
            stdin.write(b"go\n")
            stdin.flush()
        runs = []
        for proc, (_, stdout) in zip(procs, pipes):
            try:
                runs.append(pickle.load(stdout))
            except EOFError:
                raise RuntimeError(f"a client process failed (exit code {proc.wait()})") from None
        return merge(len(requests), parts, runs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    _child()
