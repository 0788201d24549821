"""Llama-family decoder (SmolLM2, Llama 3), also the base of Qwen2 and Qwen3.

Differences between the three are constructor switches: qkv / o_proj bias and per-head q/k RMSNorm.
q/k/v and gate/up projections are fused into one matmul each; `load_weights` stacks HF's separate
weights into them. Built over a TPGroup: with more than one rank each holds its share of the heads,
the MLP and the vocabulary (labkit/layers/linear.py says how), and the forward is the same code."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from labkit.distributed.parallel_state import TPGroup
from labkit.layers import Attention, LogitsProcessor, RMSNorm, SiluAndMul, get_rope
from labkit.layers.fused import triton_kernels
from labkit.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from labkit.layers.rotary import RopeInputs
from labkit.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from labkit.model_loader.weight_utils import load_param
from labkit.models.registry import register_model

if TYPE_CHECKING:
    from labkit.model_executor.forward_batch import ForwardBatch


# Decode and verify rows the GEMV does not take store their K/V from the rotary kernel
# (rotary_embedding_store). A constant for an A/B in one process (labkit.bench.offline_ab's and
# batch1_ab's --variant NAME:labkit.models.llama.STORE_KV_IN_ROTARY=False).
STORE_KV_IN_ROTARY = True


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TPGroup) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, qkv_bias, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)
        self._heads: tuple[torch.device, Any] | None = None  # (device, QKVHeads or None): _fused_heads

    def forward(self, rope: RopeInputs, qkv: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Attention from qkv_proj's output (the decoder layer runs qkv_proj: it fuses its norm in)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        pool = self._pool_to_store(rope, q, forward_batch)
        if pool is not None:  # rope and the KV store in one kernel (a decode or verify forward)
            v = v.reshape(-1, self.num_kv_heads, self.head_dim)
            k_buffer, v_buffer, k_scale, v_scale = pool
            loc = forward_batch.out_cache_loc
            q = rope.apply_and_store(q, k, v, self.q_norm, self.k_norm, k_buffer, v_buffer, loc, k_scale, v_scale)
            return self.o_proj(self.attn(q, None, None, forward_batch))
        q, k = rope.apply(q, k, self.q_norm, self.k_norm)  # q/k norm (Qwen3) fused into rope on CUDA
        return self.o_proj(self.attn(q, k, v, forward_batch))

    def _pool_to_store(
        self, rope: RopeInputs, q: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
        """This layer's (K, V) pool buffers and float8 scales where the rotary kernel stores the new
        K/V itself: on CUDA (the fused kernel's table), in a decode or verify forward of a backend that
        takes K/V stored, into a pool of the model's dtype or float8. Else None."""
        stores = STORE_KV_IN_ROTARY and rope.table is not None and fb.forward_mode.is_decode()
        if not (stores and fb.attn_backend.takes_stored_kv):
            return None
        pool, layer = fb.token_to_kv_pool, self.attn.spec.layer_id
        k_buffer, v_buffer = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
        if not triton_kernels().stores_into(k_buffer.dtype, q.dtype):
            return None
        return k_buffer, v_buffer, pool.k_scale[layer], pool.v_scale[layer]

    def forward_normed(
        self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention block's output, hidden + residual) from the layer's input: forward of
        qkv_proj(norm(hidden + residual)). For one decode token on CUDA, where the backend takes K/V
        stored, a single kernel from the norm to the pool (labkit.kernels.gemv_qkv_rope_store: the
        norm, qkv_proj, the q/k norm, the rotary and the KV store)."""
        heads = self._fused_heads(rope, hidden, fb)
        if heads is None:
            qkv, residual = self.qkv_proj.forward_normed(hidden, residual, norm)
            return self(rope, qkv, fb), residual
        pool, layer, proj = fb.token_to_kv_pool, self.attn.spec.layer_id, self.qkv_proj
        q, residual = triton_kernels().gemv_qkv_rope_store(
            hidden,
            residual,
            norm.weight,
            norm.eps,
            proj.weight,
            proj.bias,
            proj.gemv_split(hidden),
            heads,
            rope.table,
            pool.get_key_buffer(layer),
            pool.get_value_buffer(layer),
            fb.out_cache_loc,
            pool.k_scale[layer],
            pool.v_scale[layer],
        )
        return self.o_proj(self.attn(q, None, None, fb)), residual

    def _fused_heads(self, rope: RopeInputs, hidden: torch.Tensor, fb: ForwardBatch) -> Any:
        """This layer's labkit.kernels.QKVHeads where gemv_qkv_rope_store takes this forward, else
        None. Whether the layer fuses at all (its heads, the pool's dtype, the q/k norms' eps) is
        decided once per device, with the semaphores made then."""
        takes = rope.table is not None and fb.forward_mode.is_decode() and fb.attn_backend.takes_stored_kv
        if not takes or hidden.shape[0] != 1 or not self.qkv_proj.gemv_takes(hidden, hidden.shape[-1]):
            return None
        if self._heads is None or self._heads[0] != hidden.device:
            self._heads = (hidden.device, self._make_heads(hidden, fb))
        return self._heads[1]

    def _make_heads(self, hidden: torch.Tensor, fb: ForwardBatch) -> Any:
        kernels = triton_kernels()
        norms: dict[str, Any] = {}
        if self.q_norm is not None and self.k_norm is not None:
            if self.q_norm.eps != self.k_norm.eps:  # the kernel takes one eps for both
                return None
            norms = {"norm_weights": (self.q_norm.weight, self.k_norm.weight), "norm_eps": self.q_norm.eps}
        zeros = torch.zeros(self.num_heads + self.num_kv_heads, dtype=torch.int32, device=hidden.device)
        heads = kernels.QKVHeads(self.num_heads, self.num_kv_heads, self.head_dim, zeros, **norms)
        pool = fb.token_to_kv_pool.get_key_buffer(self.attn.spec.layer_id)
        return heads if kernels.fuses_qkv(heads, pool, hidden) else None


class MLPBlock(nn.Module):
    """A decoder layer's MLP block (the gated MLP, an MoE block): forward(hidden, forward_batch)
    -> [T, H] from the normalized hidden states, the ForwardBatch taken along."""

    def forward_normed(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(hidden + residual)), hidden + residual): the block with the norm before it,
        which a block may fuse into its first projection."""
        normed, residual = norm.add_and_norm(hidden, residual)
        return self(normed, forward_batch), residual


class LlamaMLP(MLPBlock):
    """The gated MLP; its activation runs in down_proj's GEMV prologue where that takes the row."""

    def __init__(self, config: Any, tp: TPGroup, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias, tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, forward_batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), self.act_fn)

    def forward_normed(
        self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up, residual = self.gate_up_proj.forward_normed(hidden, residual, norm)
        return self.down_proj(gate_up, self.act_fn), residual


MLPFactory = Callable[[Any, int, TPGroup], MLPBlock]  # (hf config, layer id, tp) -> the layer's MLP block


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TPGroup, mlp: MLPBlock
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, o_bias, qk_norm, tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, rope: RopeInputs, hidden: torch.Tensor, residual: torch.Tensor | None, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add runs in the next norm, (norm(h + r), h + r), and the norm in the projection
        # after it: one kernel at batch 1 on CUDA (labkit.kernels.gemv_rmsnorm; before attention, with
        # the rotary and the KV store too: gemv_qkv_rope_store).
        hidden, residual = self.self_attn.forward_normed(rope, hidden, residual, self.input_layernorm, forward_batch)
        return self.mlp.forward_normed(hidden, residual, self.post_attention_layernorm, forward_batch)


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TPGroup, build_mlp: MLPFactory
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = get_rope(head_dim_of(config), config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias, o_bias, qk_norm, tp, build_mlp(config, i, tp))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb.prepare(positions, hidden.dtype)  # shared by all layers
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF name fragment -> (fused labkit parameter fragment, its block in the fused output dim).
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(nn.Module):
    """Causal LM over the paged KV cache: `forward` returns the logits [bs, vocab] (model dtype) of
    each request's last new token, the full vocabulary on every rank. Built as
    `cls(hf_config, dtype, tp)`; call under torch.inference_mode()."""

    qk_norm = False

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.config = config
        self.dtype = dtype
        qkv_bias, o_bias = self.attention_biases(config)
        self.model = LlamaModel(config, qkv_bias, o_bias, self.qk_norm, tp, self.build_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.logits_processor = LogitsProcessor()
        self.to(dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch, gather_logits: bool = True
    ) -> torch.Tensor:
        """gather_logits=False returns this rank's vocabulary range only: the decode CUDA graphs
        gather after their replay (gather_logits()), keeping NCCL out of the graph."""
        return self.compute_logits(
            self.hidden_states(input_ids, positions, forward_batch), forward_batch, gather_logits
        )

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """The final hidden states [num_tokens, hidden] of every new token (before the logits)."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(
        self, hidden: torch.Tensor, forward_batch: ForwardBatch, gather_logits: bool = True
    ) -> torch.Tensor:
        """The logits of `forward` from `hidden_states`' output (the prefill CUDA graphs stop at the
        hidden states; this part runs after their replay, eagerly)."""
        logits = self.logits_processor(hidden, self.head, forward_batch)
        return self.gather_logits(logits) if gather_logits else logits

    def build_mlp(self, config: Any, layer_id: int, tp: TPGroup) -> MLPBlock:
        """Layer `layer_id`'s MLP block (an MoE model makes some of them experts)."""
        return LlamaMLP(config, tp)

    @property
    def head(self) -> VocabParallelEmbedding:
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """The full vocabulary's logits from every rank's range (the same tensor with one rank)."""
        return self.head.gather_logits(local_logits)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy this rank's slice of each HF-named (full) tensor into the (fused) parameters; returns
        the labkit names filled. A fused parameter counts as filled once any of its blocks arrives;
        the loader checks completeness."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.lm_head is None and name == "lm_head.weight"):
                continue  # rope is recomputed; a tied head has no tensor of its own
            target, block = name, None
            for frag, (fused, idx) in _STACKED.items():
                if frag in name:
                    target, block = name.replace(frag, fused), idx
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            load_param(self, target, params[target], tensor, block)
            loaded.add(target)
        return loaded
