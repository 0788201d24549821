"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before rope (no qkv bias by default)."""

from __future__ import annotations

from labkit.models.llama import LlamaForCausalLM
from labkit.models.registry import register_model


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
