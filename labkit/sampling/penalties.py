"""Logit processors applied before sampling: penalties and the min_new_tokens ban.

Each is built once per step from the requests' token histories, and only when at least one request
in the batch uses it, so a plain batch pays nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from labkit.sampling.sampling_params import SamplingParams


class SamplingReq(Protocol):
    """What the sampler needs from a request (``labkit``'s ``Req`` satisfies it)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the GPU (a blocking copy would wait
    for the forwards already queued, which overlap scheduling must not)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _index_tensors(rows_of_ids: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row id lists into (row index, token id) tensors for scatter/index ops."""
    lengths = torch.tensor([len(ids) for ids in rows_of_ids], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(rows_of_ids)), lengths)
    cols = torch.tensor(list(itertools.chain.from_iterable(rows_of_ids)), dtype=torch.int64)
    return rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)


@dataclass
class Penalties:
    """Frequency/presence (OpenAI) and repetition (CTRL/HF) penalties for one batch.

    A group of fields is None when no request in the batch uses that penalty.
    """

    frequency: torch.Tensor | None  # [bs, 1]
    presence: torch.Tensor | None  # [bs, 1]
    output_counts: torch.Tensor | None  # [bs, vocab] float: occurrences in output_ids
    repetition: torch.Tensor | None  # [bs, 1]
    seen_mask: torch.Tensor | None  # [bs, vocab] bool: in prompt or output

    @classmethod
    def build(cls, reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device) -> Penalties | None:
        """Return the batch's penalties, or None when no request uses any."""
        params = [r.sampling_params for r in reqs]

        def column(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device).unsqueeze(1)

        use_freq = any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params)
        use_rep = any(p.repetition_penalty != 1 for p in params)
        if not (use_freq or use_rep):
            return None
        bs = len(reqs)
        pen = cls(None, None, None, None, None)
        if use_freq:
            pen.frequency = column([p.frequency_penalty for p in params])
            pen.presence = column([p.presence_penalty for p in params])
            rows, cols = _index_tensors([r.output_ids for r in reqs], device)
            counts = torch.zeros(bs, vocab_size, dtype=torch.float32, device=device)
            counts.index_put_((rows, cols), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
            pen.output_counts = counts
        if use_rep:
            pen.repetition = column([p.repetition_penalty for p in params])
            # Only rows with a penalty need their history scattered; others keep an all-False row.
            hist = [
                (r.origin_input_ids + r.output_ids) if r.sampling_params.repetition_penalty != 1 else [] for r in reqs
            ]
            rows, cols = _index_tensors(hist, device)
            pen.seen_mask = torch.zeros(bs, vocab_size, dtype=torch.bool, device=device)
            pen.seen_mask[rows, cols] = True
        return pen

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return penalized logits (a new tensor; the input is not modified)."""
        if self.output_counts is not None and self.frequency is not None and self.presence is not None:
            logits = logits - self.frequency * self.output_counts - self.presence * (self.output_counts > 0)
        if self.seen_mask is not None and self.repetition is not None:
            # CTRL: make a seen token less likely whatever its logit's sign.
            scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(self.seen_mask, scaled, logits)
        return logits


def min_tokens_ban(
    reqs: Sequence[SamplingReq], eos_token_ids: set[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) that must not be sampled this step, or None.

    While a request has fewer than ``min_new_tokens`` outputs, every token that would finish it is
    banned: its ``stop_token_ids`` and, unless ``ignore_eos`` (then EOS does not finish), the EOS ids.
    """
    banned: list[list[int]] = []
    for r in reqs:
        p = r.sampling_params
        if p.min_new_tokens and len(r.output_ids) < p.min_new_tokens:  # output_ids may be built on asking
            ids = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                ids |= eos_token_ids
            banned.append(sorted(ids))
        else:
            banned.append([])
    if not any(banned):
        return None
    return _index_tensors(banned, device)
