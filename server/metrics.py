"""Prometheus metrics in the text exposition format (small enough that a dependency would not pay
for itself). Each tokenizer worker keeps its own; /metrics adds up every worker's snapshot."""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "labkit:"


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(init=False)  # per bucket (not cumulative), +Inf last
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        n = PREFIX + self.name
        lines = [f"# HELP {n} {self.help}", f"# TYPE {n} histogram"]
        total = 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += count
            lines.append(f'{n}_bucket{{le="{bound}"}} {total}')
        return lines + [f"{n}_sum {self.sum}", f"{n}_count {total}"]


class ServerMetrics:
    """Counters and latency histograms the TokenizerManager updates as outputs arrive."""

    COUNTERS = {
        "prompt_tokens_total": "Prompt tokens of finished requests",
        "generation_tokens_total": "Generated tokens",
        "cached_tokens_total": "Prompt tokens served from the prefix cache",
        "requests_total": "Finished requests",
        "aborted_requests_total": "Requests aborted (client gone, /abort_request, or failure)",
        "spec_verify_steps_total": "Speculative decoding: a request's verify steps with drafts",
        "spec_draft_tokens_total": "Speculative decoding: tokens drafted",
        "spec_accepted_tokens_total": "Speculative decoding: drafted tokens the target model accepted",
    }

    def __init__(self) -> None:
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = Histogram("inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = Histogram("e2e_request_latency_seconds", "Request latency from arrival to finish")

    def inc(self, name: str, value: int = 1) -> None:
        self.counters[name] += value

    def histograms(self) -> tuple[Histogram, ...]:
        return (self.ttft, self.itl, self.e2e)

    def snapshot(self) -> dict[str, Any]:
        """The counters and histograms as plain data (what a tokenizer worker sends its peers)."""
        return {
            "counters": dict(self.counters),
            "histograms": {h.name: {"counts": list(h.counts), "sum": h.sum} for h in self.histograms()},
        }

    @classmethod
    def total(cls, snapshots: list[dict[str, Any]]) -> ServerMetrics:
        """The sum of several workers' snapshots."""
        out = cls()
        for snap in snapshots:
            for name, value in snap["counters"].items():
                out.counters[name] += value
            for h in out.histograms():
                theirs = snap["histograms"][h.name]
                h.counts = [a + b for a, b in zip(h.counts, theirs["counts"])]
                h.sum += theirs["sum"]
        return out

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The exposition text; `gauges` maps name -> (help, value) as of now (from the scheduler)."""
        lines: list[str] = []
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} gauge", f"{PREFIX}{name} {value}"]
        for name, help_text in self.COUNTERS.items():
            lines += [
                f"# HELP {PREFIX}{name} {help_text}",
                f"# TYPE {PREFIX}{name} counter",
                f"{PREFIX}{name} {self.counters[name]}",
            ]
        for hist in self.histograms():
            lines += hist.render()
        return "\n".join(lines) + "\n"


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """The samples of an exposition text such as `render` writes, one dict each: name, labels (a
    dict), value, and the type and help of its metric (a histogram's _bucket/_sum/_count samples
    belong to the histogram)."""
    kinds: dict[str, str] = {}
    helps: dict[str, str] = {}
    samples = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            _, what, metric, rest = line.split(" ", 3)
            (helps if what == "HELP" else kinds)[metric] = rest
        elif line.strip():
            sample, value = line.rsplit(" ", 1)
            name, _, labels = sample.partition("{")
            metric = name if name in kinds else re.sub(r"_(bucket|sum|count)$", "", name)
            samples.append(
                {
                    "name": name,
                    "labels": dict(re.findall(r'(\w+)="([^"]*)"', labels)),
                    "value": float(value),
                    "type": kinds.get(metric),
                    "help": helps.get(metric),
                }
            )
    return samples
