"""Attention over the paged KV pool with labkit's Triton kernels (labkit.kernels).

A thin adapter: `init_forward_metadata` prepares, once per forward, the index tensors every layer
reuses (split counts and the stage-1 workspace for decode; per-request prefix/extend lengths, row
offsets and the tile plan for extend and mixed batches); each layer then stores its new K/V with
`store_kv` (unless the layer has: takes_stored_kv) and runs `decode_attention` (DECODE) or
`extend_attention` (EXTEND, MIXED: one-token requests are extends of length 1). Without CUDA the
kernels run in Triton's interpreter (slow). A float8 pool's per-layer scales go to the kernels as
arguments (they quantize and dequantize).

Decode can run inside a CUDA graph (see the hooks in AttentionBackend): the split counts, the
stage-1 workspace and the semaphores of the splits' merge then live in buffers allocated once for
the largest captured batch, the grid's split bound depends on the batch size alone, and a replay
rewrites the split counts in place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from labkit.attention.base import (
    AttentionBackend,
    AttentionBackendConfig,
    AttentionLayerSpec,
    register_attention_backend,
)
from labkit.kernels.decode import (
    DEFAULT_MAX_KV_SPLITS,
    decode_attention,
    decode_kv_splits,
    decode_order,
    decode_semaphore_count,
    decode_workspace_splits,
    default_prefetch,
    longest_first,
    num_sms,
    takes_balanced,
)
from labkit.kernels.extend import ExtendPlan, extend_attention, extend_blocks
from labkit.kernels.kv_cache import store_kv

if TYPE_CHECKING:
    from labkit.model_executor.forward_batch import ForwardBatch


@dataclass
class _ExtendMetadata:
    prefix_lens: torch.Tensor  # [bs] cached tokens before this forward's
    extend_lens: torch.Tensor  # [bs] new tokens
    extend_start: torch.Tensor  # [bs] row of each request's first new token
    plan: ExtendPlan


@dataclass
class _DecodeMetadata:
    num_kv_splits: torch.Tensor  # [bs] int32
    max_kv_splits: int  # their bound (the grid's split axis)
    mid_o: torch.Tensor  # [bs, H, decode_workspace_splits, D] float32 workspace
    mid_lse: torch.Tensor  # [bs, H, decode_workspace_splits] float32 workspace
    semaphores: torch.Tensor | None  # int32 zeros left zero by every layer; None: one split, no merge
    order: torch.Tensor | None  # [bs] int32, longest request first (decode_order); None: batch order


@dataclass
class _GraphBuffers:
    """Decode state for CUDA graphs, allocated once for the largest captured batch (max_bs)."""

    num_kv_splits: torch.Tensor  # [max_bs] int32, rewritten in place before each replay
    mid_o: torch.Tensor  # [max_bs, H, max_kv_splits, D] float32 workspace
    mid_lse: torch.Tensor  # [max_bs, H, max_kv_splits] float32 workspace
    semaphores: torch.Tensor  # for max_bs requests, int32 zeros (left zero by every layer)
    order: torch.Tensor  # [max_bs] int32, rewritten in place before each replay of a graph in `ordered`
    ordered: set[int] = field(default_factory=set)  # the batch sizes whose graphs launch in `order`


@dataclass
class _PrefillGraphBuffers:
    """Extend state for the prefill CUDA graphs, allocated once (see init_prefill_graph_state)."""

    # Flat, so a replay fills each with one contiguous copy: a graph of `rows` rows and `tiles` tiles
    # reads lens[:3 rows] (prefix lens, extend lens, first rows) and tiles[:2 tiles] (ExtendPlan.tiles).
    lens: torch.Tensor  # [3 * max_rows] int64
    tiles: torch.Tensor  # [2 * max_tiles] int32


@register_attention_backend("triton")
class TritonAttnBackend(AttentionBackend):
    """Triton kernels on CUDA (interpreter elsewhere). See AttentionBackend for the contract."""

    supports_fp8_kv_cache = True
    takes_stored_kv = True  # a decode layer may store K/V itself (gemv_qkv_rope_store, rotary_embedding_store)

    def __init__(self, config: AttentionBackendConfig) -> None:
        super().__init__(config)
        # The interpreter runs the programs one after another in Python: fewer splits there.
        self.max_kv_splits = DEFAULT_MAX_KV_SPLITS if self.device.type == "cuda" else 4
        self.num_sms = num_sms(self.device)
        self.extend: _ExtendMetadata | None = None
        self.decode: _DecodeMetadata | None = None
        self.graph: _GraphBuffers | None = None  # set by init_cuda_graph_state
        self.prefill_graph: _PrefillGraphBuffers | None = None  # set by init_prefill_graph_state
        c = config
        self.extend_blocks = extend_blocks(c.head_dim, c.num_heads // c.num_kv_heads, c.dtype)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_decode():
            self.extend = None
            self.decode = self._decode_metadata(fb)
        else:
            self.decode = None
            self.extend = self._extend_metadata(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)

    def _extend_metadata(self, prefix_lens: list[int], extend_lens: list[int]) -> _ExtendMetadata:
        lens = torch.tensor(_extend_lens(prefix_lens, extend_lens), dtype=torch.int64)
        lens = lens.reshape(3, -1).to(self.device, non_blocking=True)
        plan = ExtendPlan.build(extend_lens, self.extend_blocks, self.device)
        return _ExtendMetadata(lens[0], lens[1], lens[2], plan)

    def _decode_metadata(self, fb: ForwardBatch) -> _DecodeMetadata:
        c, bs = self.config, fb.batch_size
        splits, bound = self._splits(fb)
        room = decode_workspace_splits(bs, bound, fb.token_to_kv_pool.dtype.itemsize, c.head_dim)
        mid_o = torch.empty(bs, c.num_heads, room, c.head_dim, dtype=torch.float32, device=self.device)
        mid_lse = torch.empty(bs, c.num_heads, room, dtype=torch.float32, device=self.device)
        semaphores = self._semaphores(bs) if room > 1 else None
        return _DecodeMetadata(splits, bound, mid_o, mid_lse, semaphores, self._order(fb, bound))

    def _splits(self, fb: ForwardBatch) -> tuple[torch.Tensor, int]:
        """Per-request KV split counts and their bound (decode_kv_splits)."""
        c, kv_bytes = self.config, fb.token_to_kv_pool.dtype.itemsize
        return decode_kv_splits(
            fb.seq_lens, c.num_heads, c.num_kv_heads, self.num_sms, self.max_kv_splits,
            kv_bytes=kv_bytes, head_dim=c.head_dim,
        )  # fmt: skip

    def _order(self, fb: ForwardBatch, bound: int) -> torch.Tensor | None:
        """The launch order of the batch's attention programs (decode_order), None for batch order."""
        c, kv_bytes = self.config, fb.token_to_kv_pool.dtype.itemsize
        return decode_order(fb.seq_lens, c.num_heads, c.num_kv_heads, bound, self.num_sms, kv_bytes, c.head_dim)

    def _semaphores(self, bs: int) -> torch.Tensor:
        count = decode_semaphore_count(bs, self.config.num_heads, self.config.num_kv_heads)
        return torch.zeros(count, dtype=torch.int32, device=self.device)

    def _decode_as_extend(self, fb: ForwardBatch) -> _ExtendMetadata:
        """The decode batch as extends of one token each: their K/V then come from the arguments."""
        bs = fb.batch_size
        return _ExtendMetadata(
            fb.seq_lens - 1,
            torch.ones_like(fb.seq_lens),
            torch.arange(bs, device=self.device),
            ExtendPlan.one_token_each(bs, self.extend_blocks, self.device),
        )

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        c = self.config
        self.graph = _GraphBuffers(
            torch.ones(max_bs, dtype=torch.int32, device=self.device),
            torch.empty(max_bs, c.num_heads, self.max_kv_splits, c.head_dim, dtype=torch.float32, device=self.device),
            torch.empty(max_bs, c.num_heads, self.max_kv_splits, dtype=torch.float32, device=self.device),
            self._semaphores(max_bs),
            torch.arange(max_bs, dtype=torch.int32, device=self.device),
        )

    def _graph_buffers(self, fb: ForwardBatch) -> _GraphBuffers:
        max_bs = 0 if self.graph is None else self.graph.num_kv_splits.shape[0]
        if self.graph is None or not 0 < fb.batch_size <= max_bs:
            raise ValueError(
                f"batch of {fb.batch_size} outside the CUDA graph buffers (1..{max_bs}); "
                "was init_cuda_graph_state called?"
            )
        return self.graph

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        bs, graph = forward_batch.batch_size, self._graph_buffers(forward_batch)
        # The bound comes from the (padded) batch size alone, so it is the same at every replay.
        splits, bound = self._splits(forward_batch)
        graph.num_kv_splits[:bs].copy_(splits)  # valid counts for the warm-up forwards too
        order = self._order(forward_batch, bound)  # fixed at capture: does this graph take an order
        if order is not None:
            graph.order[:bs].copy_(order)
            graph.ordered.add(bs)
        self.extend = None
        self.decode = _DecodeMetadata(
            graph.num_kv_splits[:bs],
            bound,
            graph.mid_o[:bs],
            graph.mid_lse[:bs],
            graph.semaphores,
            None if order is None else graph.order[:bs],
        )

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        fb, graph = forward_batch, self._graph_buffers(forward_batch)
        bs, kv_bytes = fb.batch_size, fb.token_to_kv_pool.dtype.itemsize
        if takes_balanced(bs, kv_bytes, self.config.head_dim, default_prefetch(bs), graph.mid_o.shape[2]):
            return  # the balanced partition reads no split counts
        graph.num_kv_splits[:bs].copy_(self._splits(fb)[0])
        if bs in graph.ordered:  # as captured, whatever decode_order would say now
            graph.order[:bs].copy_(longest_first(fb.seq_lens))

    # ---- prefill CUDA graphs ----------------------------------------------------------------
    def init_prefill_graph_state(self, max_tokens: int, max_rows: int) -> None:
        max_tiles = ExtendPlan.max_tiles(max_tokens, max_rows, self.extend_blocks)
        self.prefill_graph = _PrefillGraphBuffers(
            torch.zeros(3 * max_rows, dtype=torch.int64, device=self.device),
            torch.zeros(2 * max_tiles, dtype=torch.int32, device=self.device),
        )

    def _prefill_graph_views(self, fb: ForwardBatch) -> tuple[_PrefillGraphBuffers, int]:
        if self.prefill_graph is None:
            raise ValueError("init_prefill_graph_state was not called")
        return self.prefill_graph, ExtendPlan.max_tiles(fb.num_tokens, fb.batch_size, self.extend_blocks)

    def init_forward_metadata_capture_prefill_graph(self, forward_batch: ForwardBatch) -> None:
        g, num_tiles = self._prefill_graph_views(forward_batch)
        self.init_forward_metadata_replay_prefill_graph(forward_batch)  # valid values for the warm-ups
        prefix, extend, starts = g.lens[: 3 * forward_batch.batch_size].chunk(3)
        tile_req, tile_start = g.tiles[: 2 * num_tiles].chunk(2)
        self.decode = None
        self.extend = _ExtendMetadata(prefix, extend, starts, ExtendPlan(tile_req, tile_start, self.extend_blocks))

    def init_forward_metadata_replay_prefill_graph(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        g, num_tiles = self._prefill_graph_views(fb)
        lens = _extend_lens(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)
        tiles = ExtendPlan.tiles(fb.extend_seq_lens_cpu, self.extend_blocks, num_tiles)
        g.lens[: 3 * fb.batch_size].copy_(torch.tensor(lens, dtype=torch.int64), non_blocking=True)
        g.tiles[: 2 * num_tiles].copy_(torch.tensor(tiles, dtype=torch.int32), non_blocking=True)

    # ---- per layer ----------------------------------------------------------------------------
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if not save_kv_cache:  # the new tokens are not in the pool: read them from k, v
            assert self.decode is not None, "init_forward_metadata was not called for this decode batch"
            return self._extend(q, k, v, layer, forward_batch, self._decode_as_extend(forward_batch))
        pool, lid = forward_batch.token_to_kv_pool, layer.layer_id
        k_buf, v_buf = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v, pool.k_scale[lid], pool.v_scale[lid])
        return self.forward_decode_stored(q, layer, forward_batch)

    def forward_decode_stored(
        self, q: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        md = self.decode
        assert md is not None, "init_forward_metadata was not called for this decode batch"
        fb, pool, lid = forward_batch, forward_batch.token_to_kv_pool, layer.layer_id
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        decode_attention(
            q,
            pool.get_key_buffer(lid),
            pool.get_value_buffer(lid),
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            layer.scaling,
            out=out.view(q.shape),
            num_kv_splits=md.num_kv_splits,
            max_kv_splits=md.max_kv_splits,
            mid_o=md.mid_o,
            mid_lse=md.mid_lse,
            k_scale=pool.k_scale[lid],
            v_scale=pool.v_scale[lid],
            semaphores=md.semaphores,
            order=md.order,
        )
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
        assert self.extend is not None, "init_forward_metadata was not called for this extend batch"
        if save_kv_cache:
            pool, lid = forward_batch.token_to_kv_pool, layer.layer_id
            store_kv(
                pool.get_key_buffer(lid),
                pool.get_value_buffer(lid),
                forward_batch.out_cache_loc,
                k,
                v,
                pool.k_scale[lid],
                pool.v_scale[lid],
            )
        return self._extend(q, k, v, layer, forward_batch, self.extend)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        md: _ExtendMetadata,
    ) -> torch.Tensor:
        fb, pool, lid = forward_batch, forward_batch.token_to_kv_pool, layer.layer_id
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        extend_attention(
            q,
            k,
            v,
            pool.get_key_buffer(lid),
            pool.get_value_buffer(lid),
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            md.prefix_lens,
            md.extend_lens,
            md.extend_start,
            layer.scaling,
            out=out.view(q.shape),
            plan=md.plan,
            k_scale=pool.k_scale[lid],
            v_scale=pool.v_scale[lid],
        )
        return out


def _extend_lens(prefix_lens: list[int], extend_lens: list[int]) -> list[int]:
    """Prefix lens, extend lens and each request's first row among the new tokens, as one list."""
    starts, row = [], 0
    for n in extend_lens:
        starts.append(row)
        row += n
    return [*prefix_lens, *extend_lens, *starts]
