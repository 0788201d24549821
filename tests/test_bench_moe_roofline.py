"""The MoE share of the benchmarks' rooflines: expert weights counted from the model, and the expected
number of experts a batch reads."""

from __future__ import annotations

import pytest

from labkit.bench.moe_roofline import expert_share
from labkit.model_loader import load_model


def test_expert_share_counts_every_moe_layers_experts_and_nothing_else():
    model, config = load_model("tiny-qwen2-moe", "dummy")  # 2 sparse layers of 8 experts, 1 dense layer
    share = expert_share(model, config.num_experts_per_tok)
    assert share is not None
    h, i = config.hidden_size, config.moe_intermediate_size
    assert (share.num_experts, share.top_k) == (8, 2)
    assert share.params_per_expert == 2 * (2 * i * h + h * i)  # gate|up and down, in 2 layers
    assert share.bytes_per_expert == 4 * share.params_per_expert  # float32
    assert expert_share(load_model("tiny-qwen3", "dummy")[0], 0) is None


def test_one_token_reads_its_k_experts_and_a_large_batch_reads_them_all():
    model, config = load_model("tiny-qwen3-moe", "dummy")  # top-4 of 16
    share = expert_share(model, config.num_experts_per_tok)
    assert share is not None
    assert share.expected_active(1) == pytest.approx(share.top_k)
    assert share.expected_active(0) == 0
    assert share.expected_active(2) == pytest.approx(16 * (1 - (1 - 4 / 16) ** 2))
    assert share.expected_active(1000) == pytest.approx(16)
