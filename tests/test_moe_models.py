"""The MoE models end to end in float32 on the CPU (any machine): both checkpoint layouts load,
greedy tokens equal transformers' with chunked prefill and radix hits, the trace's expert-load record
adds up, and layouts that cannot split the experts are refused before anything starts."""

from __future__ import annotations

import pytest
import torch
from hf_checkpoints import random_hf_checkpoint
from safetensors.torch import save_file

from labkit.config import EngineConfig, check_parallel
from labkit.distributed.tp_worker import check_tp_shapes
from labkit.engine import Engine
from labkit.layers.moe.fused_moe import FusedMoE
from labkit.model_loader import load_config, load_model
from labkit.models.llama import LlamaMLP

MODELS = ["tiny-qwen2-moe", "tiny-qwen3-moe"]


@pytest.fixture(scope="module", params=MODELS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return random_hf_checkpoint(request.param, False, None, path), path


def test_stacked_and_per_expert_checkpoints_load_the_same_weights(checkpoint, tmp_path):
    hf, path = checkpoint  # transformers saves experts one by one, as published checkpoints are
    per_expert, _ = load_model(str(path), "auto")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}  # in memory they are stacked
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    stacked, _ = load_model(str(tmp_path), "auto")
    ours = dict(stacked.named_parameters())
    for name, p in per_expert.named_parameters():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0, msg=name)


def test_sparse_layers_follow_mlp_only_layers_and_the_sparse_step():
    model, config = load_model("tiny-qwen2-moe", "dummy")  # 3 layers, layer 2 dense
    assert config.mlp_only_layers == [2] and model.moe_layer_ids == [0, 1]
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds[2] is LlamaMLP and all(isinstance(layer.mlp.experts, FusedMoE) for layer in model.model.layers[:2])


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_greedy_tokens_equal_transformers_with_chunks_and_cache_hits(checkpoint):
    hf, path = checkpoint
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 256, (24,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 30, 9)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    engine = Engine(model_path=str(path), device="cpu", chunked_prefill_size=16, page_size=4, enable_trace=True)
    outs = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]  # one by one: cache hits
    assert sum(s.cache_hit_tokens for s in engine.tracer.steps) >= 2 * 24 - 2 * 4  # whole pages of the prefix
    assert any(s.chunked_rid for s in engine.tracer.steps)
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == _hf_greedy(hf, prompt, 8)


def test_the_trace_records_top_k_experts_per_token_per_moe_layer():
    engine = Engine(model_path="tiny-qwen3-moe", load_format="dummy", device="cpu", enable_trace=True)
    engine.generate(input_ids=[[5, 6, 7, 8, 9], [10, 11, 12]], sampling_params={"max_new_tokens": 3})
    config = engine.model_runner.hf_config
    for step in engine.tracer.steps:
        assert step.expert_tokens is not None and len(step.expert_tokens) == config.num_hidden_layers
        for row in step.expert_tokens:
            assert len(row) == config.num_experts and sum(row) == step.num_tokens * config.num_experts_per_tok
    dense = Engine(model_path="tiny-qwen3", load_format="dummy", device="cpu", enable_trace=True)
    dense.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert all(step.expert_tokens is None for step in dense.tracer.steps)


def test_layouts_that_cannot_split_the_experts_are_refused():
    with pytest.raises(ValueError, match="ep_size must be a divisor of tp_size 2"):
        check_parallel(EngineConfig(tp_size=2, ep_size=4))
    config = load_config("tiny-qwen3-moe")
    config.num_experts = 6
    with pytest.raises(ValueError, match="ep_size 4 does not divide the model's 6 experts"):
        check_tp_shapes(config, 4, 4)
    check_tp_shapes(config, 2, 2)  # 3 experts a rank: fine
