"""Batched next-token sampling: penalties, bans and grammar masks, greedy/temperature,
top-k/top-p/min-p, seeds, logprobs.

Sampling uses the exponential-race trick: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d. draws a
token with probability proportional to ``probs``. It needs no normalization and no multinomial, and
the randomness is a plain noise tensor, so a seeded request can get its noise from its own generator.
``E`` is drawn as ``-log(U)``: on CPU that is several times faster than ``Tensor.exponential_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labkit.constrained.bitmask import VocabMask
from labkit.sampling.penalties import Penalties, SamplingReq, min_tokens_ban, to_device
from labkit.sampling.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, step: int) -> int:
    """Derive a per-(seed, step) generator seed (splitmix64 finalizer) so steps get unrelated noise."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds must fit in a signed int64 range


@dataclass
class SampledRows:
    """The tensors of a batch in which some rows sample (temperature > 0); every row has one."""

    temperatures: torch.Tensor  # [bs, 1] float32; 1.0 on greedy rows (they never divide)
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64, clamped to [1, vocab]; vocab means "off"
    filter_width: int  # largest top_k among sampled rows: top-k/top-p need only that many candidates
    min_ps: torch.Tensor  # [bs] float32
    is_greedy: torch.Tensor  # [bs] bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device
    ) -> SampledRows:
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        sampled = [(p, k) for p, k, g in zip(params, top_ks, greedy) if not g]

        def f32(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        return cls(
            temperatures=f32([1.0 if g else p.temperature for p, g in zip(params, greedy)]).unsqueeze(1),
            top_ps=f32([p.top_p for p in params]),
            top_ks=to_device(top_ks, torch.int64, device),
            min_ps=f32([p.min_p for p in params]),
            is_greedy=to_device(greedy, torch.bool, device),
            filter_width=max((k for _, k in sampled), default=vocab_size),
            need_top_k=any(k < vocab_size for _, k in sampled),
            need_top_p=any(p.top_p < 1 for p, _ in sampled),
            need_min_p=any(p.min_p > 0 for p, _ in sampled),
        )


@dataclass
class SamplingBatchInfo:
    """Per-row sampling tensors for one step, built once from the batch's requests."""

    vocab_size: int
    sampled: SampledRows | None  # None when every row is greedy: an argmax needs no per-row tensors
    penalties: Penalties | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) blocked by min_new_tokens
    seeds: list[int | None]  # per-row generator seed for this step (already mixed with the step)
    vocab_mask: VocabMask | None  # the tokens the grammars of the constrained rows allow (on the device)
    return_logprob: list[bool]
    top_logprobs_nums: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.seeds)

    @property
    def all_greedy(self) -> bool:
        return self.sampled is None

    @property
    def need_logprobs(self) -> bool:
        return any(self.return_logprob) or any(n > 0 for n in self.top_logprobs_nums)

    @classmethod
    def from_requests(
        cls,
        reqs: Sequence[SamplingReq],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: set[int],
        vocab_mask: VocabMask | None = None,
    ) -> SamplingBatchInfo:
        """Build the step's tensors from requests with ``sampling_params``, ``origin_input_ids``,
        ``output_ids`` (parameters are assumed verified) and the grammar mask the scheduler built."""
        if not reqs:
            raise ValueError("cannot sample an empty batch")
        device = torch.device(device)
        params = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        return cls(
            vocab_size=vocab_size,
            sampled=None if all(greedy) else SampledRows.build(params, greedy, vocab_size, device),
            penalties=Penalties.build(reqs, vocab_size, device),
            banned=min_tokens_ban(reqs, eos_token_ids, device),
            seeds=[
                None if p.seed is None or g else _mix_seed(p.seed, len(r.output_ids))
                for r, p, g in zip(reqs, params, greedy)
            ],
            vocab_mask=vocab_mask.to(device) if vocab_mask is not None else None,
            return_logprob=[p.return_logprob for p in params],
            top_logprobs_nums=[p.top_logprobs_num for p in params],
        )


@dataclass
class SampleOutput:
    """One step's result. ``logprobs``/``top_logprobs`` are None unless some row asked for them;
    then rows that did not ask still get a chosen-token logprob and an empty top list."""

    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None  # [bs] float32, log p(chosen) under the penalized model distribution
    top_logprobs: list[tuple[list[int], list[float]]] | None  # per row: (ids, logprobs), best first


class Sampler:
    """Samples next tokens from ``[bs, vocab]`` logits according to a :class:`SamplingBatchInfo`.

    Unseeded rows draw from one generator owned by the sampler (seeded by ``seed`` if given, else
    randomly); seeded rows draw from a fresh CPU generator per (request seed, step), so their tokens do
    not depend on the rest of the batch.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """Pick one token per row; ``logits`` (``[bs, vocab]``, any float dtype) is not modified."""
        if logits.shape != (info.batch_size, info.vocab_size):
            raise ValueError(f"logits must be [{info.batch_size}, {info.vocab_size}], got {list(logits.shape)}")
        # Greedy rows need no float32 copy: the upcast is exact, so the argmax is the same. Anything
        # that computes on the scores (penalties, softmax, logprobs) works in float32.
        if not (info.all_greedy and info.penalties is None and info.banned is None and not info.need_logprobs):
            logits = logits.float()
        if info.penalties is not None:
            logits = info.penalties.apply(logits)
        if info.banned is not None:
            logits = logits.index_put(info.banned, torch.full((), float("-inf"), device=logits.device))
        if info.vocab_mask is not None:
            logits = info.vocab_mask.apply(logits)

        greedy_ids = torch.argmax(logits, dim=-1)
        if info.sampled is None:
            next_ids = greedy_ids
        else:
            probs = filtered_probs(logits, info)
            sampled_ids = torch.argmax(probs / self._exp_noise(probs, info.seeds), dim=-1)
            next_ids = torch.where(info.sampled.is_greedy, greedy_ids, sampled_ids)

        if not info.need_logprobs:
            return SampleOutput(next_ids, None, None)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
        return SampleOutput(next_ids, chosen, _top_logprobs(logprobs, info.top_logprobs_nums))

    def _exp_noise(self, probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
        """Exp(1) noise, one row per request; seeded rows from their own generator.

        U is in [0, 1), so -log(U) is in (0, inf]: never 0, hence never a 0/0 NaN for a filtered token.
        """
        noise = torch.rand(probs.shape, generator=self._generator(probs.device), device=probs.device)
        for row, seed in enumerate(seeds):
            if seed is not None:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(seed)
                noise[row] = torch.rand(probs.shape[1], generator=gen).to(probs.device, non_blocking=True)
        return noise.log_().neg_()


def filtered_probs(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Softmax of ``logits / temperature`` with top-k, then top-p, then min-p applied (not renormalized:
    filtered tokens get probability 0; the rest keep their relative weights). `info` must have
    sampled rows."""
    if info.sampled is None:
        raise ValueError("filtered_probs needs a batch with sampled rows (this one is all greedy)")
    rows = info.sampled
    probs = torch.softmax(logits / rows.temperatures, dim=-1)
    if rows.need_top_k or rows.need_top_p:
        # A partial sort (topk) when every sampled row has a top-k bound: much cheaper than a full sort.
        if rows.filter_width < probs.shape[1]:
            sorted_probs, order = torch.topk(probs, rows.filter_width, dim=-1)
        else:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        ranks = torch.arange(sorted_probs.shape[1], device=probs.device)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if rows.need_top_k:
            drop |= ranks.unsqueeze(0) >= rows.top_ks.unsqueeze(1)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        if rows.need_top_p:
            # Top-p over the top-k-renormalized distribution: keep the smallest prefix whose mass
            # reaches top_p, i.e. drop a token when the mass strictly before it already does.
            cum = torch.cumsum(sorted_probs, dim=-1)
            mass_before = (cum - sorted_probs) / cum[:, -1:]
            drop |= mass_before >= rows.top_ps.unsqueeze(1)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    if rows.need_min_p:
        # min-p is relative to the top token, which no earlier filter removes, so order is immaterial.
        threshold = rows.min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_logprobs(logprobs: torch.Tensor, nums: list[int]) -> list[tuple[list[int], list[float]]]:
    """Per-row top-n (ids, logprobs); one topk over the batch, one transfer to the host."""
    k = max(nums)
    if k == 0:
        return [([], []) for _ in nums]
    values, ids = torch.topk(logprobs, k, dim=-1)
    values_l, ids_l = values.tolist(), ids.tolist()
    return [(ids_l[i][:n], values_l[i][:n]) for i, n in enumerate(nums)]
