"""ForwardBatch: everything one model forward needs, as tensors. Built by the ModelRunner from a
ScheduleBatch and passed explicitly down through the model into the attention backend."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from labkit.attention.base import AttentionBackend
    from labkit.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from labkit.model_executor.input_logprobs import InputLogprobs


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill: each request adds extend_seq_len tokens after extend_prefix_len cached ones
    DECODE = 2  # one new token per request
    MIXED = 3  # a prefill chunk and running decodes in one forward (decodes are extends of length 1)
    IDLE = 4  # nothing to run
    # Speculative decoding: each request's last token and its drafts, one row each. A row attends as
    # a decode row does (its prefix, then the drafts before it), so the decode kernels and CUDA
    # graphs run it; the logits are per row (labkit/speculative/verify.py).
    TARGET_VERIFY = 5

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        """One query row per sequence, logits for every row: DECODE and TARGET_VERIFY."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64: rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64: length of each sequence after this forward
    out_cache_loc: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    seq_lens_cpu: list[int]
    # Extend / mixed only (for decode: prefix = seq_len - 1, extend = 1).
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    attn_backend: AttentionBackend
    # [MoE layers, experts] int64 when the trace records expert load: each MoE layer adds its counts.
    expert_load: torch.Tensor | None = None
    # Extend / mixed only, when a request asks for prompt logprobs: the rows to score, and the
    # LogitsProcessor's results (labkit/model_executor/input_logprobs.py).
    input_logprobs: InputLogprobs | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
