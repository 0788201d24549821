"""Notebook 09's Build-it: check_router passes the given answer and labkit's select_experts, and
rejects routers that get Qwen's softmax top-k wrong (run in the MoE blocks of both tiny models: one
renormalizes its top k, the other does not)."""

from __future__ import annotations

import pytest
import torch

from labkit.layers.moe import TopKConfig, select_experts
from labkit.model_loader.loader import load_model
from tests.notebook_cells import run_cells


@pytest.fixture(scope="module")
def notebook():
    names = {"torch": torch, "select_experts": select_experts}
    return run_cells("09_moe", "build-router-answer", "build-router-check", **names)


@pytest.fixture(scope="module")
def blocks():
    qwen3, _ = load_model("tiny-qwen3-moe", load_format="dummy")
    qwen2, _ = load_model("tiny-qwen2-moe", load_format="dummy")
    assert qwen3.model.layers[0].mlp.topk.renormalize and not qwen2.model.layers[0].mlp.topk.renormalize
    return [qwen3.model.layers[0].mlp, qwen2.model.layers[0].mlp]


def check(notebook, blocks, select):
    with torch.no_grad():  # the notebook turns autograd off
        notebook["check_router"](select, blocks)


def test_the_notebooks_answer_and_labkits_router_pass(notebook, blocks, capsys):
    check(notebook, blocks, notebook["my_select_experts"])
    check(notebook, blocks, select_experts)
    assert "routed as labkit routes them" in capsys.readouterr().out


def test_the_order_of_the_k_choices_does_not_matter(notebook, blocks):
    def reversed_order(logits, config):
        weights, ids = select_experts(logits, config)
        return weights.flip(-1), ids.flip(-1)

    check(notebook, blocks, reversed_order)


def never_renormalizes(logits, config):
    return select_experts(logits, TopKConfig(config.top_k))


def always_renormalizes(logits, config):
    return select_experts(logits, TopKConfig(config.top_k, renormalize=True))


def sigmoid_scores(logits, config):
    return select_experts(logits, TopKConfig(config.top_k, config.renormalize, scoring="sigmoid"))


def the_k_least_probable(logits, config):
    return select_experts(-logits, config)


def logits_as_weights(logits, config):
    weights, ids = logits.float().topk(config.top_k, dim=-1)
    return weights, ids.to(torch.int32)


def int64_ids(logits, config):
    weights, ids = select_experts(logits, config)
    return weights, ids.long()


def one_expert_k_times(logits, config):
    weights, ids = select_experts(logits, config)
    return weights, ids[:, :1].expand_as(ids).contiguous()


def one_too_few(logits, config):
    return select_experts(logits, TopKConfig(config.top_k - 1, config.renormalize))


@pytest.mark.parametrize(
    ("wrong", "complaint"),
    [
        (never_renormalizes, "weight"),
        (always_renormalizes, "weight"),
        (sigmoid_scores, "weight"),
        (the_k_least_probable, "went to experts"),
        (logits_as_weights, "weight"),
        (int64_ids, "int32"),
        (one_expert_k_times, "chose an expert twice"),
        (one_too_few, "ids of shape"),
    ],
)
def test_check_router_rejects_a_wrong_router(notebook, blocks, wrong, complaint):
    with pytest.raises(AssertionError, match=complaint):
        check(notebook, blocks, wrong)
