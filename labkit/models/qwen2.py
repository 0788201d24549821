"""Qwen2 / Qwen2.5: the Llama decoder with biases on q/k/v (not on o_proj)."""

from __future__ import annotations

from typing import Any

from labkit.models.llama import LlamaForCausalLM
from labkit.models.registry import register_model


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return True, False
