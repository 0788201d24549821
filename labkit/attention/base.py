"""The attention backend interface. One backend instance serves all layers of one ModelRunner."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from labkit.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayerSpec:
    """What a backend needs to know about the layer calling it."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


@dataclass(frozen=True)
class AttentionBackendConfig:
    """What a backend is built from (GPU backends size workspaces and graphs from it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_context_len: int
    max_batch_size: int
    dtype: torch.dtype
    device: torch.device


class AttentionBackend(ABC):
    """Paged attention over the TokenToKVPool.

    Constructed as `cls(AttentionBackendConfig)`. Contract every implementation must keep:
    - `init_forward_metadata(fb)` is called once per forward, before any layer; all per-batch index
      work (gathering req_to_token rows, lengths, masks) belongs there, not in the per-layer calls.
    - `forward(q, k, v, layer, fb)` gets q [T, num_heads, head_dim] and k, v [T, num_kv_heads, head_dim]
      for the T = fb.num_tokens new tokens (in request order). Unless `save_kv_cache` is False it first
      writes k, v into the pool at fb.out_cache_loc, then returns attention output [T, num_heads*head_dim].
    - Token t of request i attends causally to all KV of request i at positions <= its own position: the
      extend_prefix_lens cached tokens (read through req_to_token) and the new tokens before it. Nothing
      from other requests, nothing at a later position. GQA: query head h reads KV head h // (H / H_kv).
    - Results must not depend on how requests are grouped into a batch beyond floating-point rounding,
      and must work for any page_size (slots come from req_to_token; no contiguity is assumed).
    - DECODE has exactly one token per request; EXTEND and MIXED any number >= 1 per request.
    - With `takes_stored_kv`, `forward(q, None, None, layer, fb)` of a DECODE (or TARGET_VERIFY) batch is
      attention where the layer has already written the new tokens' K and V into the pool at
      fb.out_cache_loc (fused into its qkv projection, labkit.kernels.gemv_qkv_rope_store, or into
      its rotary, rotary_embedding_store); `forward_decode_stored` runs it.
    - With `supports_fp8_kv_cache`, a float8 pool (--kv-cache-dtype fp8_*) works too: K, V are
      stored through the pool's quantization (divided by its per-layer k_scale / v_scale, saturated)
      and read back dequantized (times the scale). Without it the ModelRunner refuses such a pool.
    """

    supports_fp8_kv_cache: ClassVar[bool] = False
    takes_stored_kv: ClassVar[bool] = False

    def __init__(self, config: AttentionBackendConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor: ...

    def forward_decode_stored(
        self, q: torch.Tensor, layer: AttentionLayerSpec, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """forward_decode with the new tokens' K and V already in the pool (backends that set
        takes_stored_kv)."""
        raise NotImplementedError(f"{type(self).__name__} reads the new tokens' K and V from k and v")

    # ---- CUDA graphs (decode only). A backend that cannot be captured keeps these defaults, and the
    # ModelRunner then runs every decode eagerly. The sequence the CudaGraphRunner follows:
    #   init_cuda_graph_state(max_bs)                          once
    #   init_forward_metadata_capture_cuda_graph(fb_bs)        once per captured batch size bs, then
    #       eager warm-up forwards and the captured forward of fb_bs
    #   init_forward_metadata_replay_cuda_graph(fb_bs)         before every replay of that graph
    # fb_bs is the same ForwardBatch object each time for one bs: DECODE, batch_size bs, its tensors
    # views of the runner's static buffers (rewritten in place before each replay, padded rows
    # included: a padded row has seq_len >= 1, a valid req_pool_idx and out_cache_loc 0, the
    # reserved slot). Its *_cpu lists are placeholders and must not be read by forward_decode in
    # graph mode (they would be baked into the graph); the hooks may read seq_lens_cpu, which holds
    # the step's lengths at each replay hook (padded rows: 1) and ones at capture.

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate, once, every buffer that captured kernels will read or write as metadata
        (sized for batches of up to max_bs requests). Raise NotImplementedError when this backend
        cannot run inside a CUDA graph (the default)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Set up the metadata of the next forwards (warm-up and capture) of this batch size, in
        place of `init_forward_metadata`. Must guarantee: every tensor the per-layer calls then
        read or write, other than the forward's own inputs and activations, is a view of the
        buffers of `init_cuda_graph_state` (so the addresses baked into the graph stay valid), the
        launch configuration (grids, block sizes) depends on the batch size only, and nothing
        forces a host-device sync."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: ForwardBatch) -> None:
        """Before a replay: recompute the metadata of this step from forward_batch's (already
        refilled) tensors and seq_lens_cpu, writing it in place into the buffers the graph captured.
        Must not allocate anything the graph reads or change shapes, and must not sync with the host
        beyond waiting for its own earlier copies; the result must equal what `init_forward_metadata`
        would give for the same padded batch."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    # ---- Prefill CUDA graphs (extend and mixed forwards of few tokens; PrefillGraphRunner). The
    # same sequence with these hooks: init_prefill_graph_state(max_tokens, max_rows) once, then per
    # captured token count T its capture hook, warm-ups and capture, and its replay hook before every
    # replay. fb_T is an EXTEND ForwardBatch of exactly T new tokens over its batch_size rows; its
    # extend_*_cpu and seq_lens_cpu lists hold the step's real requests, then a padding request
    # (prefix 0) holding the padded tokens (possibly none), then empty requests (prefix 0, no new
    # tokens): the last row is always empty. The lists change at every replay, the row count and
    # T do not.

    def init_prefill_graph_state(self, max_tokens: int, max_rows: int) -> None:
        """Allocate, once, the metadata buffers of extend forwards of up to max_tokens new tokens
        and max_rows rows. Raise NotImplementedError when extends cannot be captured (the default)."""
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")

    def init_forward_metadata_capture_prefill_graph(self, forward_batch: ForwardBatch) -> None:
        """As init_forward_metadata_capture_cuda_graph, for an extend: views of the buffers of
        init_prefill_graph_state, a launch configuration fixed by (T, rows), no host sync."""
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")

    def init_forward_metadata_replay_prefill_graph(self, forward_batch: ForwardBatch) -> None:
        """As init_forward_metadata_replay_cuda_graph, for an extend: the step's metadata from the
        *_cpu lists, written in place; the padding and empty rows must leave real rows' outputs and
        the pool's real slots untouched."""
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayerSpec,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if k is None or v is None:
            if not (self.takes_stored_kv and forward_batch.forward_mode.is_decode()):
                raise ValueError(f"{type(self).__name__} needs the new tokens' K and V in this forward")
            return self.forward_decode_stored(q, layer, forward_batch)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}
# Backends that need optional packages (triton, flashinfer) register themselves when first asked for,
# so importing labkit never imports them.
LAZY_BACKENDS = {"triton": "labkit.attention.triton_backend", "flashinfer": "labkit.attention.flashinfer_backend"}


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """ "auto" is triton on CUDA and torch_native elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch_native"
    return name


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; ValueError if there is none (or it cannot load)."""
    if name not in ATTENTION_BACKENDS and name in LAZY_BACKENDS:
        try:
            importlib.import_module(LAZY_BACKENDS[name])
        except ImportError as e:
            raise ValueError(f"attention backend {name!r} needs a package that is missing: {e}") from None
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose auto or one of "
            f"{sorted(set(ATTENTION_BACKENDS) | set(LAZY_BACKENDS))}"
        )
    return ATTENTION_BACKENDS[name]


def register_attention_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    def wrap(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        ATTENTION_BACKENDS[name] = cls
        return cls

    return wrap
