"""Prompt logprobs (SGLang's input logprobs) of one extend forward: which rows of the forward's flat
token dimension score which prompt token. Planned on the host from the batch's requests, carried by
the ForwardBatch, filled by the LogitsProcessor, and handed back to the requests by the scheduler.

Position j's logits score prompt token j + 1. A request asks for tokens logprob_start_len.. of its
prompt (`Req.input_logprob_positions` says which positions of an extend are still to score), so a
prompt split into chunks gets each chunk's share, and a batch whose requests ask for none has no
plan at all: the forward then costs exactly what it did without the feature."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from labkit.scheduler.schedule_batch import Req

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class InputLogprobs:
    """The prompt rows one extend forward scores and, once it ran, their logprobs (see above)."""

    rows: torch.Tensor  # [n] int64, on the device: rows of the forward's hidden states to score
    targets: torch.Tensor  # [n] int64, on the device: the prompt token each row's logits score
    counts: list[int]  # rows of each request of the batch, in batch order (0 for most)
    top_nums: list[int]  # each request's top_logprobs_num
    # Filled by the LogitsProcessor during the forward:
    logprobs: torch.Tensor | None = None  # [n] float32: log p(target)
    top_values: torch.Tensor | None = None  # [n, top_k] float32, best first (top_k > 0 only)
    top_ids: torch.Tensor | None = None  # [n, top_k] int64

    @property
    def top_k(self) -> int:
        """Alternatives each row needs: the largest top_logprobs_num among the requests with rows."""
        return max((num for num, count in zip(self.top_nums, self.counts) if count), default=0)

    @classmethod
    def plan(
        cls, reqs: list[Req], prefix_lens: list[int], extend_lens: list[int], device: torch.device
    ) -> InputLogprobs | None:
        """The rows an extend of `reqs` (each adding extend_lens[i] tokens after prefix_lens[i]) must
        score; None when no request has a prompt token to score in it."""
        rows: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        offset = 0
        for req, prefix, extend in zip(reqs, prefix_lens, extend_lens):
            positions = req.input_logprob_positions(prefix, prefix + extend)
            rows += [offset + j - prefix for j in positions]
            targets += [req.origin_input_ids[j + 1] for j in positions]
            counts.append(len(positions))
            offset += extend
        if not rows:
            return None
        both = torch.tensor([rows, targets], dtype=torch.int64).to(device, non_blocking=True)
        return cls(both[0], both[1], counts, [r.sampling_params.top_logprobs_num for r in reqs])

    def per_request(self) -> list[tuple[list[float], list[TopLogprobs]]]:
        """Each request's (logprobs, top alternatives), in batch order, on the host: one transfer,
        which waits for the forward."""
        if self.logprobs is None:
            raise RuntimeError("the forward has not scored the prompt rows yet")
        values: list[float] = self.logprobs.tolist()
        tops: list[TopLogprobs] = [[] for _ in values]
        if self.top_values is not None and self.top_ids is not None:
            tops = [list(zip(i, v)) for i, v in zip(self.top_ids.tolist(), self.top_values.tolist())]
        out = []
        start = 0
        for count, num in zip(self.counts, self.top_nums):
            out.append((values[start : start + count], [top[:num] for top in tops[start : start + count]]))
            start += count
        return out
