"""Qwen2-MoE (Qwen1.5-MoE) and the MoE block Qwen3-MoE shares: the Llama decoder whose MLP is, in the
sparse layers, a router over many small experts (plus, in Qwen2-MoE, an always-on shared expert
scaled by a sigmoid gate).

A layer is sparse unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th layer. The
experts are stacked into two tensors per layer at load (labkit/layers/moe/fused_moe.py); a HF
checkpoint may store them per expert (`experts.3.gate_proj.weight`, as published) or already stacked
(`experts.gate_up_proj`, as transformers keeps them in memory): both load."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from labkit.distributed.parallel_state import TPGroup
from labkit.layers.moe import FusedMoE, TopKConfig, select_experts
from labkit.models.llama import LlamaForCausalLM, LlamaMLP, MLPBlock
from labkit.models.registry import register_model

if TYPE_CHECKING:
    from labkit.model_executor.forward_batch import ForwardBatch


def moe_layer_ids(config: Any) -> list[int]:
    """The layers whose MLP is a mixture of experts (HF's rule)."""
    skip = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1)
    if config.num_experts <= 0:
        return []
    return [i for i in range(config.num_hidden_layers) if i not in skip and (i + 1) % step == 0]


class SparseMoeBlock(MLPBlock):
    """Router, top-k, experts (and the gated shared expert when `shared`). forward(hidden [T, H],
    forward_batch) -> [T, H]; with forward_batch.expert_load set, adds how many tokens each expert
    received to row `moe_index` of it (the trace's expert-load record)."""

    def __init__(self, config: Any, moe_index: int, tp: TPGroup, shared: bool) -> None:
        super().__init__()
        hidden, num_experts = config.hidden_size, config.num_experts
        self.moe_index = moe_index
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router: whole on every rank
        self.topk = TopKConfig(config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob))
        self.experts = FusedMoE(num_experts, hidden, config.moe_intermediate_size, tp)
        self.shared_expert = LlamaMLP(config, tp, config.shared_expert_intermediate_size) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None

    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch | None = None) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.topk)
        load = forward_batch.expert_load if forward_batch is not None else None
        if load is not None:
            flat = topk_ids.reshape(-1).long()
            load[self.moe_index].index_add_(0, flat, torch.ones_like(flat))
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return out


# A per-expert HF tensor: (experts module path, expert id, projection).
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Stacked HF tensors -> labkit's stacked weights.
_STACKED_EXPERTS = {
    ".mlp.experts.gate_up_proj": ".mlp.experts.w13.weight",
    ".mlp.experts.down_proj": ".mlp.experts.w2.weight",
}


@register_model("Qwen2MoeForCausalLM")
class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """`moe_layer_ids`: the sparse layers, in the order of their rows in the expert-load record."""

    shared_expert = True

    @staticmethod
    def attention_biases(config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    @property
    def moe_layer_ids(self) -> list[int]:
        return moe_layer_ids(self.config)

    def build_mlp(self, config: Any, layer_id: int, tp: TPGroup) -> MLPBlock:
        sparse = moe_layer_ids(config)
        if layer_id not in sparse:
            return LlamaMLP(config, tp)
        return SparseMoeBlock(config, sparse.index(layer_id), tp, self.shared_expert)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                match = _PER_EXPERT.match(name)
                if match is None:
                    for frag, ours in _STACKED_EXPERTS.items():
                        if name.endswith(frag):
                            name = name.removesuffix(frag) + ours
                    yield name, tensor
                    continue
                path, expert, proj = match[1], int(match[2]), match[3]
                experts = self.get_submodule(path)
                target = experts.w2 if proj == "down_proj" else experts.w13
                block = {"gate_proj": 0, "up_proj": 1}.get(proj)
                if target.load_expert(expert, tensor, block):
                    loaded.add(f"{path}.{'w2' if proj == 'down_proj' else 'w13'}.weight")

        return loaded | super().load_weights(others())
