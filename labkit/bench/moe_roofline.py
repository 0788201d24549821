"""What an MoE model's forward must read and compute, for the rooflines of the benchmarks: a token
touches only its top-k experts, so a decode step reads the dense weights plus the experts that the
batch's tokens were routed to, and a prefill token costs the FLOPs of its k experts, not all E."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from labkit.layers.moe import FusedMoE


@dataclass(frozen=True)
class ExpertShare:
    """A model's expert weights: how many per MoE layer, routed to how many per token, and their size
    (all MoE layers together, per expert)."""

    num_experts: int
    top_k: int
    params_per_expert: int  # summed over the MoE layers
    bytes_per_expert: int

    def expected_active(self, tokens: int) -> float:
        """Experts a batch of `tokens` reads in one layer if routing were uniform and independent:
        E (1 - (1 - k/E)^tokens). Random-weight routers are close to that; trained ones are skewed,
        which lowers it."""
        return self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** tokens)


def expert_share(model: nn.Module, top_k: int) -> ExpertShare | None:
    """The expert weights of `model`, or None for a dense model. For one rank holding every expert
    (the single-device benchmarks)."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        return None
    num_experts = layers[0].num_experts
    if len(layers[0].local) != num_experts:
        raise ValueError("expert_share counts one rank holding every expert (ep_size 1)")
    params = sum(p.numel() for m in layers for p in m.parameters())
    nbytes = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
    return ExpertShare(num_experts, top_k, params // num_experts, nbytes // num_experts)
