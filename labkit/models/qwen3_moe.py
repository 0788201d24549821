"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm) with Qwen2-MoE's sparse block, without a shared expert."""

from __future__ import annotations

from labkit.models.llama import LlamaForCausalLM
from labkit.models.qwen2_moe import Qwen2MoeForCausalLM
from labkit.models.registry import register_model


@register_model("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True
    shared_expert = False
    attention_biases = staticmethod(LlamaForCausalLM.attention_biases)
