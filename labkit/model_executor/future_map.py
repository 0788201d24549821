"""FutureMap: the overlap-scheduling protocol in one place (SGLang's name for it).

With overlap scheduling the host schedules and launches step N+1 while step N still runs on the
device, so the token a request sampled in step N is not on the host when step N+1's batch is built.
Every party asks this module how that works:

- the scheduler appends a *future token* to a request's output_ids when it commits a batch:
  `future_token(req_pool_idx)`, a negative id (never a real token), one per request slot (a request
  has at most one token on its way);
- after sampling, the ModelRunner `store`s each slot's token in a device table and gets a
  `HostSample`: the tokens copied to pinned host memory behind a CUDA event;
- when a batch's input ids hold future tokens (`has_future`), the ModelRunner `resolve`s them from
  that table on the device, without waiting for the host;
- the scheduler takes the HostSample's tokens with `wait()` one step later and writes each in place
  of its future token; a request that finishes with one still on its way drops it (`is_future`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.sampling.sampler import SampleOutput


class FutureMap:
    """The device table of each request slot's latest sampled token, and the future-token encoding.

    Guarantees: `future_token(i)` is negative for every slot i >= 0 and distinct per slot;
    `resolve` leaves real (non-negative) ids unchanged and replaces future_token(i) with the token
    last `store`d for slot i, reading only the device (no host synchronization)."""

    def __init__(self, num_slots: int, device: torch.device):
        self.token_ids = torch.zeros(num_slots, dtype=torch.int64, device=device)

    @staticmethod
    def future_token(req_pool_idx: int) -> int:
        """The placeholder for the token request slot `req_pool_idx` is sampling now."""
        return -1 - req_pool_idx

    @staticmethod
    def is_future(token_id: int) -> bool:
        return token_id < 0

    @staticmethod
    def has_future(token_ids: list[int]) -> bool:
        return min(token_ids) < 0

    def store(self, req_pool_indices: torch.Tensor, out: SampleOutput) -> HostSample:
        """Remember each row's sampled token for its request slot and start copying `out` to the host."""
        self.token_ids[req_pool_indices] = out.next_token_ids
        return HostSample.start(out)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids` (on the device) with each future token replaced by its slot's stored token."""
        slots = (-1 - input_ids).clamp_(min=0)  # real ids read slot 0, and the value is not used
        return torch.where(input_ids < 0, self.token_ids[slots], input_ids)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


@dataclass
class HostSample:
    """A step's sampled tokens (and logprobs) on their way to the host. On CUDA the copy goes to
    pinned memory behind an event, so the host can queue the next step before reading this one."""

    output: SampleOutput  # the host copies, valid after wait()
    event: torch.cuda.Event | None

    @classmethod
    def start(cls, out: SampleOutput) -> HostSample:
        if out.next_token_ids.device.type != "cuda":
            return cls(out, None)
        logprobs = _pinned_copy(out.logprobs) if out.logprobs is not None else None
        host = SampleOutput(_pinned_copy(out.next_token_ids), logprobs, out.top_logprobs)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def wait(self) -> SampleOutput:
        if self.event is not None:
            self.event.synchronize()
        return self.output
