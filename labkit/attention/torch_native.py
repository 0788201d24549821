"""Attention over the paged KV pool with plain PyTorch (scaled_dot_product_attention); CPU and CUDA.

Decode (and the one-token requests of a mixed batch) is one batched SDPA over a padded
[n, max_len, H_kv, D] gather of each request's KV with a length mask. Multi-token extends run one SDPA
per request (prefix from the pool + the new tokens, causal with the prefix offset). All index work
happens once per forward in `init_forward_metadata` and is reused by every layer. A float8 pool
(--kv-cache-dtype fp8_*) is dequantized as it is gathered: cast, times the layer's scale."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from labkit.attention.base import (
    AttentionBackend,
    AttentionBackendConfig,
    AttentionLayerSpec,
    register_attention_backend,
)
from labkit.mem_cache.memory_pool import dequantize_kv

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

    rows: torch.Tensor  # [n] token rows in the flat batch
    kv_indices: torch.Tensor  # [n, max_len] KV slots of the prefix; 0 (reserved slot) beyond it
    new_pos: torch.Tensor  # [n] column where this forward's token goes (= seq_len - 1)
    batch: torch.Tensor  # [n] arange, to place each request's new token
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
    padded: list[_PaddedGroup]  # one-token requests, in groups of similar length
    extends: list[_ExtendReq]


# One-token requests are sorted by length and split into up to this many groups, each padded only to
# its own longest sequence: less KV to gather and attend than padding all to the longest one.
MAX_PADDED_GROUPS = 4
MIN_GROUP_SIZE = 8


@register_attention_backend("torch_native")
class TorchNativeAttnBackend(AttentionBackend):
    """Reference backend for any device. See AttentionBackend for the contract."""

    supports_fp8_kv_cache = True

    def __init__(self, config: AttentionBackendConfig) -> None:
        super().__init__(config)
        self.metadata: _Metadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        req_to_token = fb.req_to_token_pool.req_to_token
        pool_idx_cpu = fb.req_pool_indices.tolist()
        single: list[int] = []  # batch indices of one-token requests
        single_rows: list[int] = []  # and their token rows
        extends: list[_ExtendReq] = []
        if fb.forward_mode.is_decode():
            prefix_lens, extend_lens = [n - 1 for n in fb.seq_lens_cpu], [1] * fb.batch_size
        else:
            prefix_lens, extend_lens = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
        start = 0
        for i, (prefix, n) in enumerate(zip(prefix_lens, extend_lens)):
            if n == 1:
                single.append(i)
                single_rows.append(start)
            else:
                extends.append(self._extend_req(req_to_token, pool_idx_cpu[i], start, prefix, n))
            start += n
        seq_lens = [prefix_lens[i] + 1 for i in single]
        order = sorted(range(len(single)), key=seq_lens.__getitem__)
        size = max(MIN_GROUP_SIZE, -(-len(order) // MAX_PADDED_GROUPS))
        padded = [
            self._padded_group(
                req_to_token,
                [pool_idx_cpu[single[j]] for j in part],
                [seq_lens[j] for j in part],
                [single_rows[j] for j in part],
            )
            for part in (order[g : g + size] for g in range(0, len(order), size))
        ]
        self.metadata = _Metadata(padded, extends)

    def _padded_group(
        self, req_to_token: torch.Tensor, pool_idx: list[int], seq_lens_cpu: list[int], rows: list[int]
    ) -> _PaddedGroup:
        max_len = max(seq_lens_cpu)
        seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int64, device=self.device)
        cols = torch.arange(max_len, device=self.device)
        in_prefix = cols[None, :] < (seq_lens - 1)[:, None]
        pool_idx_t = torch.tensor(pool_idx, dtype=torch.int64, device=self.device)
        kv_indices = req_to_token[pool_idx_t, :max_len].masked_fill(~in_prefix, 0)
        mask = (cols[None, :] < seq_lens[:, None])[:, None, None, :]
        return _PaddedGroup(
            rows=torch.tensor(rows, dtype=torch.int64, device=self.device),
            kv_indices=kv_indices,
            new_pos=seq_lens - 1,
            mask=mask,
            batch=torch.arange(len(seq_lens_cpu), device=self.device),
        )

    def _extend_req(self, req_to_token: torch.Tensor, pool_idx: int, start: int, prefix: int, n: int) -> _ExtendReq:
        if prefix == 0:
            return _ExtendReq(start, start + n, None, None)
        q_pos = torch.arange(n, device=self.device)[:, None] + prefix
        mask = torch.arange(prefix + n, device=self.device)[None, :] <= q_pos
        return _ExtendReq(start, start + n, req_to_token[pool_idx, :prefix], mask)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        self._attend_groups(q, k, v, layer, forward_batch, out)
        return out

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        md = self.metadata
        assert md is not None
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        pool, lid = forward_batch.token_to_kv_pool, layer.layer_id
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        for r in md.extends:
            ki, vi = k[r.start : r.end], v[r.start : r.end]
            if r.prefix_indices is not None:
                ki = torch.cat([dequantize_kv(_gather(k_buf, r.prefix_indices), pool.k_scale[lid], q.dtype), ki])
                vi = torch.cat([dequantize_kv(_gather(v_buf, r.prefix_indices), pool.v_scale[lid], q.dtype), vi])
            # [1, H, len, D]: 4-D inputs take the flash kernel on CPU (3-D falls back to the math
            # path, ~2.7x slower); enable_gqa maps query heads to KV heads without copying KV.
            o = F.scaled_dot_product_attention(
                q[r.start : r.end].transpose(0, 1)[None],
                ki.transpose(0, 1)[None],
                vi.transpose(0, 1)[None],
                attn_mask=r.mask,
                is_causal=r.mask is None,
                scale=layer.scaling,
                enable_gqa=True,
            )
            out[r.start : r.end] = o[0].transpose(0, 1).reshape(r.end - r.start, -1)
        self._attend_groups(q, k, v, layer, forward_batch, out)
        return out

    def _attend_groups(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        out: torch.Tensor,
    ) -> None:
        assert self.metadata is not None
        for g in self.metadata.padded:
            out[g.rows] = self._attend_padded(q[g.rows], k[g.rows], v[g.rows], layer, forward_batch, g)

    def _attend_padded(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        g: _PaddedGroup,
    ) -> torch.Tensor:
        pool, lid = forward_batch.token_to_kv_pool, layer.layer_id
        n = q.shape[0]
        # Prefix from the pool ([n, L, H_kv, D]), this forward's token from the arguments (so
        # save_kv_cache=False works).
        keys = dequantize_kv(_gather(pool.get_key_buffer(lid), g.kv_indices), pool.k_scale[lid], q.dtype)
        vals = dequantize_kv(_gather(pool.get_value_buffer(lid), g.kv_indices), pool.v_scale[lid], q.dtype)
        keys[g.batch, g.new_pos] = k
        vals[g.batch, g.new_pos] = v
        # GQA without copying KV: the G query heads sharing a KV head act as G "query rows".
        group = layer.num_heads // layer.num_kv_heads
        qg = q.view(n, layer.num_kv_heads, group, layer.head_dim)
        o = F.scaled_dot_product_attention(
            qg, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=g.mask, scale=layer.scaling
        )
        return o.reshape(n, layer.num_heads * layer.head_dim)
