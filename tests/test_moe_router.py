"""select_experts against a per-token reference written from the routing rules, on random scores."""

from __future__ import annotations

import math

import pytest
import torch

from labkit.layers.moe import TopKConfig, select_experts


def _reference(logits: torch.Tensor, cfg: TopKConfig, bias: torch.Tensor | None) -> list[tuple[list[int], list[float]]]:
    """Token by token, in plain Python: scores, groups, choice, weights."""
    out = []
    for row in logits.double().tolist():
        if cfg.scoring == "softmax":
            m = max(row)
            exps = [math.exp(x - m) for x in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-x)) for x in row]
        choice = [s + (float(bias[i]) if bias is not None else 0.0) for i, s in enumerate(scores)]
        allowed = range(len(row))
        if cfg.num_expert_group:
            size = len(row) // cfg.num_expert_group
            groups = [choice[g * size : (g + 1) * size] for g in range(cfg.num_expert_group)]
            rank = [sum(sorted(g)[-2:]) if bias is not None else max(g) for g in groups]
            best = sorted(range(len(groups)), key=lambda g: -rank[g])[: cfg.topk_group]
            allowed = [e for e in range(len(row)) if e // size in best]
        ids = sorted(allowed, key=lambda e: -choice[e])[: cfg.top_k]
        weights = [scores[e] for e in ids]
        if cfg.renormalize:
            weights = [w / sum(weights) for w in weights]
        out.append((ids, [w * cfg.routed_scaling_factor for w in weights]))
    return out


CONFIGS = {
    "softmax": TopKConfig(top_k=2),
    "softmax-renorm": TopKConfig(top_k=4, renormalize=True),
    "top1": TopKConfig(top_k=1),
    "sigmoid-grouped-biased": TopKConfig(
        top_k=4, renormalize=True, scoring="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5
    ),
    "softmax-grouped": TopKConfig(top_k=3, num_expert_group=8, topk_group=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_select_experts_matches_the_per_token_reference(name):
    cfg = CONFIGS[name]
    gen = torch.Generator().manual_seed(len(name))
    logits = torch.randn(37, 16, generator=gen) * 3
    bias = torch.randn(16, generator=gen) * 0.3 if cfg.scoring == "sigmoid" else None
    weights, ids = select_experts(logits, cfg, bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (37, cfg.top_k)
    for t, (ref_ids, ref_w) in enumerate(_reference(logits, cfg, bias)):
        assert ids[t].tolist() == ref_ids
        assert weights[t].tolist() == pytest.approx(ref_w, rel=1e-5)


def test_renormalized_weights_sum_to_one_and_ids_are_distinct():
    logits = torch.randn(64, 60, generator=torch.Generator().manual_seed(3))
    weights, ids = select_experts(logits, TopKConfig(top_k=4, renormalize=True))
    assert torch.allclose(weights.sum(-1), torch.ones(64))
    assert all(len(set(r)) == 4 for r in ids.tolist())


def test_the_bias_steers_the_choice_but_not_the_weights():
    logits = torch.zeros(1, 4)
    logits[0, 0] = 1.0  # expert 0 scores highest
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0])  # ... but the bias picks expert 1
    weights, ids = select_experts(logits, TopKConfig(top_k=1, scoring="sigmoid"), bias)
    assert ids.tolist() == [[1]]
    assert weights.item() == pytest.approx(0.5)  # sigmoid(0): the unbiased score


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 2, "scoring": "relu"}, "unknown scoring"),
        ({"top_k": 2, "num_expert_group": 4}, "both num_expert_group and topk_group"),
        ({"top_k": 0}, "top_k must be"),
    ],
)
def test_bad_router_configs_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TopKConfig(**kwargs)


def test_top_k_beyond_the_experts_and_groups_that_do_not_divide_are_value_errors():
    with pytest.raises(ValueError, match="exceeds the 4 experts"):
        select_experts(torch.randn(2, 4), TopKConfig(top_k=5))
    with pytest.raises(ValueError, match="do not form 3 groups"):
        select_experts(torch.randn(2, 8), TopKConfig(top_k=2, num_expert_group=3, topk_group=1))
