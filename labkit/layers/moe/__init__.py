"""Mixture-of-experts building blocks: top-k routing and the experts layer."""

from labkit.layers.moe.fused_moe import FusedMoE
from labkit.layers.moe.router import TopKConfig, select_experts

__all__ = ["FusedMoE", "TopKConfig", "select_experts"]
