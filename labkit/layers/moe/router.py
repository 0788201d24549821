"""Top-k routing: which experts each token goes to, and with what weight (SGLang's `select_experts`).

The router's linear layer (the "gate") scores every expert for every token; routing keeps the k best.
Qwen-MoE scores with a softmax and keeps the top k, optionally renormalized to sum to 1. DeepSeek-style
routing scores with a sigmoid, may add a per-expert correction bias that steers the choice (not the
weights), and may first restrict each token to its `topk_group` best groups of experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING = ("softmax", "sigmoid")


@dataclass(frozen=True)
class TopKConfig:
    """How a router turns scores into (weights, expert ids). num_expert_group/topk_group select grouped
    top-k (both or neither); routed_scaling_factor multiplies the final weights."""

    top_k: int
    renormalize: bool = False
    scoring: str = "softmax"
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"unknown scoring {self.scoring!r}; choose one of {SCORING}")
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError("grouped top-k needs both num_expert_group and topk_group")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")


def select_experts(
    router_logits: torch.Tensor, config: TopKConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32).

    Guarantees: ids are distinct per token, ordered by decreasing choice score (score + bias); weights
    are the unbiased scores of the chosen experts (renormalized to sum 1 per token if asked, then
    scaled). With groups, every chosen expert lies in one of the token's topk_group best groups, a
    group ranked by its best score (by the sum of its two best biased scores when a bias is given)."""
    num_experts = router_logits.shape[-1]
    if config.top_k > num_experts:
        raise ValueError(f"top_k {config.top_k} exceeds the {num_experts} experts")
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if config.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if config.num_expert_group is not None:
        choice = _mask_to_best_groups(choice, config, biased=correction_bias is not None)
    _, ids = choice.topk(config.top_k, dim=-1)
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights, ids.to(torch.int32)


def _mask_to_best_groups(choice: torch.Tensor, config: TopKConfig, biased: bool) -> torch.Tensor:
    """choice with the experts outside each token's topk_group best groups set to -inf."""
    groups, keep = config.num_expert_group, config.topk_group
    assert groups is not None and keep is not None  # checked by TopKConfig
    tokens, num_experts = choice.shape
    if num_experts % groups or keep > groups:
        raise ValueError(f"{num_experts} experts do not form {groups} groups of which {keep} are kept")
    per_group = choice.view(tokens, groups, num_experts // groups)
    if biased:  # DeepSeek-V3 ranks a group by the sum of its two best (biased) scores
        group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
    else:
        group_score = per_group.max(dim=-1).values
    best = group_score.topk(keep, dim=-1).indices
    group_mask = torch.zeros(tokens, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return choice.masked_fill(~group_mask[:, :, None].expand_as(per_group).reshape(tokens, num_experts), float("-inf"))
