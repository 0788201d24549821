"""Attention over the paged KV pool with plain PyTorch (scaled_dot_product_attention); CPU and CUDA.

Decode (and the one-token requests of a mixed batch) is one batched SDPA over a padded
[n, max_len, H_kv, D] gather of each request's KV with a length mask. Multi-token extends run one SDPA
per request (prefix from the pool + the new tokens, causal with the prefix offset). All index work
happens once per forward in `init_forward_metadata` and is reused by every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from labkit.attention.base import (
    AttentionBackend, AttentionBackendConfig, AttentionLayerSpec, register_attention_backend,
)

if TYPE_CHECKING:
    from labkit.model_executor.forward_batch import ForwardBatch


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """buf[slots] for a [num_slots, H_kv, D] pool buffer, as one row gather on a 2-D view."""
    rows = buf.view(buf.shape[0], -1)
    if rows.device.type == "cpu":
        # CPU index_select copies byte rows about 4x faster than float rows (memcpy path).
        rows = rows.view(torch.uint8).index_select(0, slots.reshape(-1)).view(buf.dtype)
    else:
        rows = rows.index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *buf.shape[1:])


@dataclass
class _PaddedGroup:
    """Requests with exactly one new token, attended in one batched call."""

    rows: torch.Tensor | None  # [n] token rows in the flat batch; None = all rows in order
    kv_indices: torch.Tensor  # [n, max_len] KV slots of the prefix; 0 (reserved slot) beyond it
    new_pos: torch.Tensor  # [n] column where this forward's token goes (= seq_len - 1)
    mask: torch.Tensor  # [n, 1, 1, max_len] bool, True = attend


@dataclass
class _ExtendReq:
    """One request with several new tokens, attended on its own."""

    start: int  # token rows [start, end) in the flat batch
    end: int
    prefix_indices: torch.Tensor | None  # [prefix_len] KV slots of the cached prefix
    mask: torch.Tensor | None  # [q_len, prefix_len + q_len] bool; None = plain causal (no prefix)


@dataclass
class _Metadata:
    padded: _PaddedGroup | None
    extends: list[_ExtendReq]


@register_attention_backend("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    """Reference backend for any device. See AttentionBackend for the contract."""

    def __init__(self, config: AttentionBackendConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.metadata: _Metadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            self.metadata = _Metadata(
                self._padded_group(req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, None), [])
            return
        single: list[int] = []  # batch indices of one-token requests
        single_rows: list[int] = []  # and their token rows
        extends: list[_ExtendReq] = []
        start = 0
        pool_idx_cpu = fb.req_pool_indices.tolist()
        for i, (prefix, n) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            if n == 1 and prefix > 0:
                single.append(i)
                single_rows.append(start)
            else:
                extends.append(self._extend_req(req_to_token, pool_idx_cpu[i], start, prefix, n))
            start += n
        padded = None
        if single:
            rows = torch.tensor(single_rows, dtype=torch.int64, device=self.device)
            sel = torch.tensor(single, dtype=torch.int64, device=self.device)
            seq_lens = [fb.extend_prefix_lens_cpu[i] + 1 for i in single]
            padded = self._padded_group(req_to_token, fb.req_pool_indices[sel], seq_lens, rows)
        self.metadata = _Metadata(padded, extends)

    def _padded_group(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                      seq_lens_cpu: list[int], rows: torch.Tensor | None) -> _PaddedGroup:
        max_len = max(seq_lens_cpu)
        seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int64, device=self.device)
        cols = torch.arange(max_len, device=self.device)
        in_prefix = cols[None, :] < (seq_lens - 1)[:, None]
        kv_indices = req_to_token[req_pool_indices, :max_len].masked_fill(~in_prefix, 0)
        mask = (cols[None, :] < seq_lens[:, None])[:, None, None, :]
        return _PaddedGroup(rows, kv_indices, seq_lens - 1, mask)

    def _extend_req(self, req_to_token: torch.Tensor, pool_idx: int, start: int,
                    prefix: int, n: int) -> _ExtendReq:
        if prefix == 0:
            return _ExtendReq(start, start + n, None, None)
        q_pos = torch.arange(n, device=self.device)[:, None] + prefix
        mask = torch.arange(prefix + n, device=self.device)[None, :] <= q_pos
        return _ExtendReq(start, start + n, req_to_token[pool_idx, :prefix], mask)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerSpec, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        assert self.metadata is not None and self.metadata.padded is not None
        return self._attend_padded(q, k, v, layer, forward_batch, self.metadata.padded)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerSpec, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        md = self.metadata
        assert md is not None
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        group = layer.num_heads // layer.num_kv_heads
        for r in md.extends:
            ki, vi = k[r.start:r.end], v[r.start:r.end]
            if r.prefix_indices is not None:
                ki = torch.cat([_gather(k_buf, r.prefix_indices).to(q.dtype), ki])
                vi = torch.cat([_gather(v_buf, r.prefix_indices).to(q.dtype), vi])
            # [H, len, D] layout; GQA by repeating KV heads (cheap next to the attention itself).
            ki = ki.transpose(0, 1).repeat_interleave(group, dim=0)
            vi = vi.transpose(0, 1).repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(
                q[r.start:r.end].transpose(0, 1), ki, vi, attn_mask=r.mask,
                is_causal=r.mask is None, scale=layer.scaling)
            out[r.start:r.end] = o.transpose(0, 1).reshape(r.end - r.start, -1)
        if md.padded is not None:
            rows = md.padded.rows
            out[rows] = self._attend_padded(q[rows], k[rows], v[rows], layer, forward_batch, md.padded)
        return out

    def _attend_padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayerSpec, forward_batch: ForwardBatch,
                       g: _PaddedGroup) -> torch.Tensor:
        pool = forward_batch.token_to_kv_pool
        n = q.shape[0]
        batch = torch.arange(n, device=q.device)
        # Prefix from the pool, this forward's token from the arguments (so save_kv_cache=False works).
        keys = _gather(pool.get_key_buffer(layer.layer_id), g.kv_indices).to(q.dtype)  # [n, L, H_kv, D]
        vals = _gather(pool.get_value_buffer(layer.layer_id), g.kv_indices).to(q.dtype)
        keys[batch, g.new_pos] = k
        vals[batch, g.new_pos] = v
        # GQA without copying KV: the G query heads sharing a KV head act as G "query rows".
        group = layer.num_heads // layer.num_kv_heads
        qg = q.view(n, layer.num_kv_heads, group, layer.head_dim)
        o = F.scaled_dot_product_attention(
            qg, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=g.mask, scale=layer.scaling)
        return o.reshape(n, layer.num_heads * layer.head_dim)
