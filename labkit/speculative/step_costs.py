"""StepCosts: what a verify step costs against a plain decode step, measured on this machine.

A verify step of B requests yields B tokens plus the drafts it accepts, in the time V of one
verify step; a decode step yields B tokens in its time D. Drafting pays when the accepted drafts
reach B x (V / D - 1): the break-even gain per request. V / D is not a constant: on CUDA with
overlap scheduling a decode step costs the host's share of a step (the device works behind it) and
a verify step costs the host's and the device's in series (its drafts need the tokens before it),
about 2-3 decode steps for a small model; on a CPU, or for a model whose forward dominates, a
verify step of a few rows costs little more than a decode step. So the scheduler times its steps
and asks this table.

The break-even counts every accepted draft as worth a request's share of a decode step, D / B.
That holds when the freed step is of use: requests wait to take a finished one's place, or the step
costs less with fewer requests. Where the step costs the same at any batch size (a small model on a
GPU: the host's share is the step) and nobody waits, a request that finishes early saves nothing:
the batch lasts until its last request ends. So the table also keeps the share of a decode step's
time that grows with its batch size, and the scheduler weighs the batch's least gain by the rest.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from labkit.model_executor.forward_batch import ForwardMode

SAMPLES = 16  # the latest step times kept per kind and batch-size bucket (their median is used)
# A bucket's decode times update its break-even and batch share at its 1st, 9th, 17th, ... decode step:
# a median of 16 moves slowly, and recomputing it costs the host every step (verify steps, rare, always do).
DECODE_REFRESH = 8


def bucket(batch_size: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ... share a bucket: a step's host work grows with its rows."""
    return batch_size.bit_length()


@dataclass
class StepCosts:
    """The latest wall times of decode and verify steps by batch-size bucket, and the break-even
    gain per request they give. Owned by the scheduler that times its steps (the leader, with
    tensor parallelism: its table travels to the followers with each step, so every rank decides
    alike)."""

    decode: dict[int, deque[float]] = field(default_factory=dict)
    verify: dict[int, deque[float]] = field(default_factory=dict)
    table: dict[int, float] = field(default_factory=dict)  # bucket -> break-even gain per request
    shares: dict[int, float] = field(default_factory=dict)  # bucket -> batch_share of its decode step
    counts: dict[tuple[ForwardMode, int], int] = field(default_factory=dict)  # (kind, bucket) -> steps

    def record(self, mode: ForwardMode, batch_size: int, seconds: float) -> None:
        """One step's wall time; steps other than decode and verify (prefill, mixed) are ignored."""
        kinds = {ForwardMode.DECODE: self.decode, ForwardMode.TARGET_VERIFY: self.verify}
        if mode not in kinds or batch_size < 1:
            return
        b = bucket(batch_size)
        count = self.counts[mode, b] = self.counts.get((mode, b), 0) + 1
        kinds[mode].setdefault(b, deque(maxlen=SAMPLES)).append(seconds)
        if mode == ForwardMode.DECODE and count % DECODE_REFRESH != 1:
            return
        if b in self.decode and b in self.verify:
            ratio = statistics.median(self.verify[b]) / statistics.median(self.decode[b])
            self.table[b] = max(0.0, ratio - 1.0)
        if mode == ForwardMode.DECODE and 1 in self.decode:
            alone = statistics.median(self.decode[1])
            for other in [b] if b > 1 else [o for o in self.decode if o > 1]:
                self.shares[other] = _batch_share(alone, statistics.median(self.decode[other]), other)

    def break_even(self, batch_size: int, default: float) -> float:
        """Accepted drafts per request at which a verify step pays for `batch_size` requests;
        `default` until both kinds of step were timed at about this size."""
        return self.table.get(bucket(batch_size), default)

    def batch_share(self, batch_size: int, default: float) -> float:
        """The share of a decode step's time at about this batch size that grows with the batch (0: a
        step costs the same at any size; 1: it costs in proportion to it), from the median decode
        steps alone and at this size; `default` until both were timed."""
        return self.shares.get(bucket(batch_size), default)

    def summary(self) -> list[str]:
        """A line per bucket timed both ways: batch sizes, median decode and verify step (and how many
        of each ran), break-even, and batch share where known."""
        return [
            f"batch {2 ** (b - 1)}-{2**b - 1}: decode {statistics.median(self.decode[b]) * 1e3:.2f} ms "
            f"({self.counts[ForwardMode.DECODE, b]}), verify {statistics.median(self.verify[b]) * 1e3:.2f} ms "
            f"({self.counts[ForwardMode.TARGET_VERIFY, b]}), break-even {self.table[b]:.2f} per request"
            + (f", batch share {self.shares[b]:.2f}" if b in self.shares else "")
            for b in sorted(self.table)
        ]


def _batch_share(alone: float, step: float, b: int) -> float:
    """A decode step as fixed + per_request x B, fitted through B = 1 (`alone`) and the middle of
    bucket b (`step`): the per-request part's share of `step`, within [0, 1]."""
    size = 1.5 * 2 ** (b - 1)
    per_request = (step - alone) / (size - 1)
    return min(1.0, max(0.0, per_request * size / step))


GAIN_MEMORY_STEPS = 64  # a verify step's realized gain counts for this many scheduler steps, at first
MAX_GAIN_MEMORY_STEPS = 1024  # and at most this many after fruitless verify steps in a row


def weigh(mean: float, least: float, share: float) -> float:
    """A batch's gain per request as it shortens the batch: its mean gain where the batch's decode
    step grows with its size (share 1: each request's tokens save their share of a step), its least
    where the step costs the same at any size (share 0: the batch lasts until its slowest request
    ends), in proportion between."""
    return share * mean + (1 - share) * min(least, mean)


@dataclass
class RealizedGains:
    """What the recent verify steps of batches of several requests actually yielded, by batch-size
    bucket (as StepCosts: a batch of 2 that loops on its answers says nothing of a batch of 16): the
    accepted drafts per request of the batch (the mean), and the fewest that any request going on
    after the step kept (the least). The requests' acceptance rates are each request's own; a batch
    also pays for the rows of requests that draft nothing, the drafts that do land are often those
    of requests about to finish anyway, and a request's rate says little of what the batch's
    unluckiest request keeps in one step. A gain expires after its bucket's `memory` steps, so a
    batch that stopped drafting tries again later: GAIN_MEMORY_STEPS, doubled by each verify step
    whose weighed gain (weigh, with the batch share of its step) fell short of the break-even (each
    such probe costs a verify step's price for nothing), reset by one that reached it. Computed from
    tokens only: every tensor-parallel rank agrees."""

    gains: dict[int, deque[tuple[int, float, float]]] = field(default_factory=dict)  # bucket -> (step, mean, least)
    memory: dict[int, int] = field(default_factory=dict)  # bucket -> steps a gain counts for

    def record(
        self,
        step: int,
        batch_size: int,
        accepted: int,
        break_even: float,
        share: float = 1.0,
        least: float | None = None,
    ) -> None:
        """A verify step of batch_size requests that accepted `accepted` drafts in all, the fewest of
        them (`least`) by a request going on after it (one it finished holds the batch no longer;
        None: all finished, or not known apart from the mean)."""
        if batch_size > 1:  # alone, a request's own rate is what its verify steps realized
            b, mean = bucket(batch_size), accepted / batch_size
            least = mean if least is None else least
            self.gains.setdefault(b, deque(maxlen=SAMPLES)).append((step, mean, least))
            longer = min(2 * self.memory_of(batch_size), MAX_GAIN_MEMORY_STEPS)
            self.memory[b] = GAIN_MEMORY_STEPS if weigh(mean, least, share) >= break_even else longer

    def memory_of(self, batch_size: int) -> int:
        return self.memory.get(bucket(batch_size), GAIN_MEMORY_STEPS)

    def recent(self, step: int, batch_size: int) -> tuple[float, float] | None:
        """The mean gain per request and the mean least gain of the unexpired verify steps of this
        batch size's bucket; None when there is none."""
        memory = self.memory_of(batch_size)
        live = [(mean, least) for s, mean, least in self.gains.get(bucket(batch_size), ()) if step - s < memory]
        if not live:
            return None
        return sum(m for m, _ in live) / len(live), sum(least for _, least in live) / len(live)
