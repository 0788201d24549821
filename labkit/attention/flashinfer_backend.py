"""Attention over the paged KV pool with FlashInfer's kernels (optional: the `gpu` extra, CUDA only).

FlashInfer reads the pool page by page: each layer's k_buffer [num_slots, H_kv, D] viewed as
[num_pages, page_size, H_kv, D] (the allocator's page p is slots p*P .. p*P+P-1), and each request as
the list of its page numbers (CSR: indptr + indices) and how full its last page is.
`init_forward_metadata` builds those once per forward from req_to_token, on the device and without
a host sync, and plans FlashInfer's wrapper; each layer then stores its new K/V and runs the wrapper:
the decode kernel for DECODE, the paged prefill kernel, causal over prefix + new tokens, for EXTEND
and MIXED (so the new K/V must be in the pool first: save_kv_cache=False is not supported).

Planning writes the schedule into a page-locked host buffer that the device copies from later in
stream order. With overlap scheduling the next forward is planned while the current one may not have
started, so two sets of wrappers take turns.

Decode runs from CUDA graphs: one FlashInfer decode wrapper per captured batch size, in its CUDA-graph
mode (a fixed batch size; its page table in buffers of ours, shared by every size, that the graph
reads). Before each replay that wrapper is planned again, eagerly, from the step's real lengths (the
CudaGraphRunner hands them over in seq_lens_cpu). One wrapper per size, not two taking turns: an event
recorded after each plan makes the next plan of the same wrapper wait until the device has copied the
previous schedule out of the host buffer. No float8 KV pool (--kv-cache-dtype fp8_*: the ModelRunner
refuses it at start; FlashInfer's prefill with bf16 queries over a float8 pool is untested here)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import flashinfer
import torch

from labkit.attention.base import (
    AttentionBackend,
    AttentionBackendConfig,
    AttentionLayerSpec,
    register_attention_backend,
)
from labkit.kernels.kv_cache import store_kv

if TYPE_CHECKING:
    from labkit.model_executor.forward_batch import ForwardBatch

WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-KV scratch (its docs recommend 128 MB and up)


class _Wrappers:
    def __init__(self, workspace: torch.Tensor, use_tensor_cores: bool):
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")


@register_attention_backend("flashinfer")
class FlashInferAttnBackend(AttentionBackend):
    """FlashInfer on CUDA. See AttentionBackend for the contract; the module docstring for the layout."""

    def __init__(self, config: AttentionBackendConfig) -> None:
        super().__init__(config)
        if self.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Tensor cores pay off once a KV head serves several query heads (FlashInfer's own advice).
        gqa = config.num_heads // config.num_kv_heads
        self.workspace, self.use_tensor_cores = workspace, gqa >= 4
        self._sets = [_Wrappers(workspace, self.use_tensor_cores) for _ in range(2)]
        self._turn = 0
        self.wrapper = None  # the planned decode or prefill wrapper of this forward
        self._graph_wrappers: dict[int, flashinfer.BatchDecodeWithPagedKVCacheWrapper] = {}  # by batch size
        self._graph_planned: dict[int, torch.cuda.Event] = {}  # by batch size: recorded after its latest plan

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        tables = self._page_table(fb)
        wrappers = self._sets[self._turn]
        self._turn ^= 1
        if fb.forward_mode.is_decode():
            self._plan(wrappers.decode, *tables)
        else:
            self._plan(wrappers.prefill, _indptr(fb.extend_seq_lens_cpu), *tables, causal=True)

    def _plan(self, wrapper, *tables: torch.Tensor, **options: bool) -> None:
        """Plan `wrapper` over this forward's page table (a prefill's query indptr first) and make it
        the one the layers run."""
        c = self.config
        shape = (c.num_heads, c.num_kv_heads, c.head_dim, c.page_size)
        wrapper.plan(*tables, *shape, q_data_type=c.dtype, kv_data_type=c.dtype, **options)
        self.wrapper = wrapper

    # ---- CUDA graphs (decode) ------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        c = self.config
        pages_per_req = -(-c.max_context_len // c.page_size)
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_indices = torch.zeros(max_bs * pages_per_req, dtype=torch.int32, device=self.device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        bs = forward_batch.batch_size
        if bs not in self._graph_wrappers:
            self._graph_wrappers[bs] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
            )
        self._plan_graph(forward_batch)  # from the capture's placeholder lengths (one token a row)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        self._plan_graph(forward_batch)

    def _plan_graph(self, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        planned = self._graph_planned.get(bs)
        if planned is not None:
            planned.synchronize()  # the previous schedule has left the page-locked host buffer
        self._plan(self._graph_wrappers[bs], *self._page_table(fb))
        self._graph_planned.setdefault(bs, torch.cuda.Event()).record()

    def _page_table(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, last_page_len) on the host from the lengths the host knows; the page numbers
        gathered from req_to_token on the device (every P-th slot of a row, divided by P)."""
        p = self.config.page_size
        pages = [-(-s // p) for s in fb.seq_lens_cpu]
        indptr = _indptr(pages)
        last_page_len = torch.tensor([(s - 1) % p + 1 for s in fb.seq_lens_cpu], dtype=torch.int32)
        total = int(indptr[-1])
        counts = torch.tensor(pages).to(self.device, non_blocking=True)
        starts = indptr[:-1].to(self.device, non_blocking=True)
        rows = torch.repeat_interleave(fb.req_pool_indices, counts, output_size=total)
        first = torch.repeat_interleave(starts.long(), counts, output_size=total)
        cols = (torch.arange(total, device=self.device) - first) * p
        indices = (fb.req_to_token_pool.req_to_token[rows, cols] // p).to(torch.int32)
        return indptr, indices, last_page_len

    def _paged_kv(self, fb: ForwardBatch, layer: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor]:
        pool, c = fb.token_to_kv_pool, self.config
        shape = (-1, c.page_size, c.num_kv_heads, c.head_dim)
        return pool.get_key_buffer(layer.layer_id).view(shape), pool.get_value_buffer(layer.layer_id).view(shape)

    def _run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        fb: ForwardBatch,
        save_kv_cache: bool,
    ) -> torch.Tensor:
        if not save_kv_cache:
            raise NotImplementedError("the flashinfer backend reads the new tokens' K/V from the pool")
        if not math.isclose(layer.scaling, layer.head_dim**-0.5):
            raise NotImplementedError("the flashinfer backend is planned with the default 1/sqrt(head_dim) scale")
        assert self.wrapper is not None, "init_forward_metadata was not called for this batch"
        pool = fb.token_to_kv_pool
        store_kv(pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), fb.out_cache_loc, k, v)
        out = self.wrapper.run(q.contiguous(), self._paged_kv(fb, layer))
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out
