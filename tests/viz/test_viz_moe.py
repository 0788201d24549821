"""The expert-load views, checked against the step records of real traced runs of the tiny MoE models."""

from __future__ import annotations

import io

import numpy as np
import pytest

from labkit import Engine
from labkit.bench.datasets import random_workload
from labkit.bench.runner import run_requests
from labkit.viz import draw_expert_load, expert_load, load_imbalance


def moe_run(model: str):
    engine = Engine(model_path=model, load_format="dummy", enable_trace=True, chunked_prefill_size=32)
    reqs = random_workload(num=6, input_len=(4, 40), output_len=(3, 6), vocab_size=256)
    for i, r in enumerate(reqs):
        r.arrive_step = i  # staggered: prefill steps of a few requests, then decodes
    run = run_requests(engine, reqs, label=model)
    return run, engine.model_runner.model


@pytest.fixture(scope="module")
def qwen3():
    return moe_run("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def qwen2():
    return moe_run("tiny-qwen2-moe")


@pytest.mark.parametrize("which", ["qwen3", "qwen2"])
def test_every_step_routes_top_k_tokens_per_token_in_every_moe_layer(which, request):
    run, model = request.getfixturevalue(which)
    config = model.config
    frame = expert_load(run)
    assert all(len(s.expert_tokens) == len(model.moe_layer_ids) for s in run.steps)
    assert sorted(frame.layer.unique()) == list(range(len(model.moe_layer_ids)))
    assert sorted(frame.expert.unique()) == list(range(config.num_experts))
    sums = frame.groupby(["step", "layer"]).agg(tokens=("tokens", "sum"), num_tokens=("num_tokens", "first"))
    assert (sums.tokens == sums.num_tokens * config.num_experts_per_tok).all()
    assert sums.index.get_level_values("step").nunique() == len(run.steps)
    for s in run.steps:
        rows = frame[frame.step == s.step].sort_values(["layer", "expert"])
        assert rows.tokens.tolist() == [n for layer in s.expert_tokens for n in layer]
    one = expert_load(run, layer=1)
    assert set(one.layer) == {1} and len(one) == len(run.steps) * config.num_experts


def test_qwen2_moe_records_its_two_sparse_layers_of_three(qwen2):
    run, model = qwen2
    assert model.config.num_hidden_layers == 3 and model.moe_layer_ids == [0, 1]
    assert set(expert_load(run).layer) == {0, 1}


@pytest.mark.parametrize("which", ["qwen3", "qwen2"])
def test_imbalance_is_max_over_mean_per_step_and_over_the_run(which, request):
    run, model = request.getfixturevalue(which)
    table = load_imbalance(run)
    assert len(table) == len(run.steps) * len(model.moe_layer_ids)
    assert (table.imbalance >= 1.0).all()
    for s in run.steps:
        for layer, counts in enumerate(s.expert_tokens):
            row = table[(table.step == s.step) & (table.layer == layer)].iloc[0]
            assert row.imbalance == pytest.approx(max(counts) / (sum(counts) / len(counts)))
            assert counts[row.busiest] == max(counts) and row.num_tokens == s.num_tokens
    whole = load_imbalance(run, over="run")
    assert whole.layer.tolist() == list(range(len(model.moe_layer_ids)))
    for layer in whole.layer:
        totals = np.sum([s.expert_tokens[layer] for s in run.steps], axis=0)
        assert whole.imbalance[layer] == pytest.approx(totals.max() / totals.mean())
        assert whole.num_tokens[layer] == sum(s.num_tokens for s in run.steps)


def test_heatmap_is_the_recorded_counts(qwen3):
    run, _ = qwen3
    for layer in (0, 1):
        fig = draw_expert_load(run, layer=layer)
        image = next(im for ax in fig.axes for im in ax.images if im.get_gid() == "expert-load")
        want = np.array([s.expert_tokens[layer] for s in run.steps]).T
        np.testing.assert_array_equal(np.asarray(image.get_array()), want)
        line = next(ln for ax in fig.axes for ln in ax.lines if ln.get_gid() == "imbalance")
        np.testing.assert_allclose(np.asarray(line.get_ydata(), dtype=float), want.max(axis=0) / want.mean(axis=0))
        assert len(fig.axes) == 3  # heatmap, imbalance, colorbar
    first, last = run.steps[2].step, run.steps[5].step
    fig = draw_expert_load(run, layer=1, steps=(first, last))
    image = next(im for im in fig.axes[0].images if im.get_gid() == "expert-load")
    assert np.asarray(image.get_array()).shape == (16, 4)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.getvalue()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="MoE layer index"):
        draw_expert_load(run, layer=2)


def test_a_dense_or_untraced_run_is_a_clear_error():
    dense = Engine(model_path="tiny-llama", load_format="dummy", enable_trace=True)
    dense.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    for view in (expert_load, load_imbalance, draw_expert_load):
        with pytest.raises(ValueError, match="mixture-of-experts"):
            view(dense)
    with pytest.raises(ValueError, match="enable_trace"):
        expert_load(Engine(model_path="tiny-qwen3-moe", load_format="dummy"))
