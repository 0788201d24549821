"""Per-layer KV scales from the checkpoint (HF fp8 names: model.layers.{i}.self_attn.k_scale / v_scale,
the older kv_scale for both, or k_proj / v_proj.output_scale): a float8 pool stores K / k_scale and
V / v_scale with them, so K and V far beyond float8's range stay accurate where scales of 1.0 saturate;
a pool in the model's dtype ignores them; scales the pool cannot use are refused at start; the disk
tier never mixes blocks stored with other scales."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import random_hf_checkpoint
from safetensors.torch import load_file, save_file

from labkit import Engine
from labkit.mem_cache.factory import storage_namespace
from labkit.mem_cache.memory_pool import TokenToKVPool

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
LAYERS = 2  # tiny-llama's
# K and V blown up by BLOW_UP (k_proj, v_proj), q and the attention output shrunk by it (q_proj,
# o_proj): the float model computes the same, but |K| and |V| reach thousands, far past 448.
BLOW_UP = 800.0
PROMPT = [(7 * i + 3) % 256 for i in range(40)]
# Prompt logprobs in chunks of 8: every chunk after the first attends to K and V read back from the pool.
CHUNKED: dict[str, Any] = {"max_total_tokens": 1024, "chunked_prefill_size": 8}
SCORE = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 1}
WEIGHTS = "model.safetensors"


def checkpoint_with(src: Path, dst: Path, scales: dict[str, torch.Tensor]) -> Path:
    """A copy of checkpoint `src` at `dst` with the tensors `scales` added to its weights."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(load_file(src / WEIGHTS) | scales, dst / WEIGHTS, metadata={"format": "pt"})
    return dst


def named_scales(k: list[float], v: list[float]) -> dict[str, torch.Tensor]:
    """The vLLM / SGLang names, 0-d float32 tensors as llm-compressor writes them."""
    out = {}
    for i in range(LAYERS):
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k[i])
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v[i])
    return out


def as_stored(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def prompt_logprobs(engine: Engine) -> torch.Tensor:
    out = engine.generate(input_ids=PROMPT, sampling_params=SCORE)
    assert isinstance(out, dict)  # one prompt, one output
    return torch.tensor([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]])


@pytest.fixture(scope="module")
def big_kv_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big-kv")
    random_hf_checkpoint("tiny-llama", False, None, path)
    weights = load_file(path / WEIGHTS)
    for i in range(LAYERS):
        attn = f"model.layers.{i}.self_attn"
        for proj, factor in (
            ("k_proj", BLOW_UP),
            ("v_proj", BLOW_UP),
            ("q_proj", 1 / BLOW_UP),
            ("o_proj", 1 / BLOW_UP),
        ):
            weights[f"{attn}.{proj}.weight"] *= factor
    save_file(weights, path / WEIGHTS, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def float_run(big_kv_checkpoint) -> tuple[torch.Tensor, list[float], list[float]]:
    """A pool in the model's dtype (float32 on CPU): its prompt logprobs, and each layer's largest |K|
    and |V| that it stored (read from the pool afterwards: the triton backend stores through its
    kernel, not set_kv_buffer)."""
    engine = Engine(model_path=str(big_kv_checkpoint), **CHUNKED)
    pool = engine.model_runner.token_to_kv_pool
    logprobs = prompt_logprobs(engine)
    k_amax = [pool.get_key_buffer(i).abs().max().item() for i in range(LAYERS)]
    v_amax = [pool.get_value_buffer(i).abs().max().item() for i in range(LAYERS)]
    return logprobs, k_amax, v_amax


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, big_kv_checkpoint, float_run) -> tuple[Path, list[float], list[float]]:
    """The checkpoint with k_scale / v_scale of amax / 448 per layer (what a calibration would write)."""
    _, k_amax, v_amax = float_run
    assert min(k_amax + v_amax) > 2 * E4M3_MAX  # really beyond float8 without a scale
    k, v = [a / E4M3_MAX for a in k_amax], [a / E4M3_MAX for a in v_amax]
    path = checkpoint_with(big_kv_checkpoint, tmp_path_factory.mktemp("calibrated"), named_scales(k, v))
    return path, k, v


def test_fp8_pool_takes_the_checkpoint_scales(calibrated, caplog):
    path, k, v = calibrated
    with caplog.at_level(logging.INFO, logger="labkit.model_executor.model_runner"):
        pool = Engine(model_path=str(path), kv_cache_dtype="fp8_e4m3", **CHUNKED).model_runner.token_to_kv_pool
    assert pool.k_scale == [as_stored(x) for x in k] and pool.v_scale == [as_stored(x) for x in v]
    assert len(set(pool.k_scale + pool.v_scale)) == 2 * LAYERS  # each layer's own, K and V not swapped
    assert "KV scales: from the checkpoint (2 layers)" in caplog.messages


# Largest |prompt logprob - the float32 pool's| with the checkpoint's scales, per attention backend.
# Measured: torch_native 0.061, triton 0.193 (its float8 prefix products run in float16; the same
# figure without the blow-up, so not the scales); with scales of 1.0 both about 1.5.
SCALED_ERROR = {"torch_native": 0.15, "triton": 0.4}


@pytest.mark.parametrize("backend", list(SCALED_ERROR))  # triton: the interpreter on CPU
def test_checkpoint_scales_keep_large_kv_accurate_where_1_0_saturates(
    calibrated, big_kv_checkpoint, float_run, backend
):
    reference = float_run[0]
    errors = {}
    for name, path in (("checkpoint scales", calibrated[0]), ("1.0", big_kv_checkpoint)):
        engine = Engine(model_path=str(path), kv_cache_dtype="fp8_e4m3", attention_backend=backend, **CHUNKED)
        errors[name] = (prompt_logprobs(engine) - reference).abs().max().item()
    print(errors)
    assert errors["checkpoint scales"] < SCALED_ERROR[backend]
    assert errors["1.0"] > 4 * errors["checkpoint scales"]


@pytest.mark.parametrize(
    "names",
    [
        {"k": "self_attn.kv_scale", "v": "self_attn.kv_scale"},  # older checkpoints: one for both, shape [1]
        {"k": "self_attn.k_proj.output_scale", "v": "self_attn.v_proj.output_scale"},
    ],
)
def test_other_scale_names_load_too(big_kv_checkpoint, tmp_path, names):
    scales = {
        f"model.layers.{i}.{names[which]}": torch.tensor([0.5 + i + (which == "v")])
        for i in range(LAYERS)
        for which in "kv"
    }  # with kv_scale the v entry (written last) is the one for both
    path = checkpoint_with(big_kv_checkpoint, tmp_path, scales)
    pool = Engine(model_path=str(path), kv_cache_dtype="fp8_e5m2", **CHUNKED).model_runner.token_to_kv_pool
    if names["k"] == names["v"]:
        assert pool.k_scale == pool.v_scale == [1.5, 2.5]
    else:
        assert (pool.k_scale, pool.v_scale) == ([0.5, 1.5], [1.5, 2.5])


def test_scales_of_some_layers_only_leave_the_rest_at_1_0(big_kv_checkpoint, tmp_path, caplog):
    path = checkpoint_with(big_kv_checkpoint, tmp_path, {"model.layers.1.self_attn.k_scale": torch.tensor(4.0)})
    with caplog.at_level(logging.WARNING, logger="labkit.model_loader.weight_utils"):
        pool = Engine(model_path=str(path), kv_cache_dtype="fp8_e4m3", **CHUNKED).model_runner.token_to_kv_pool
    assert (pool.k_scale, pool.v_scale) == ([1.0, 4.0], [1.0, 1.0])
    assert any("lacks 3 of the 4 per-layer K and V scales" in m for m in caplog.messages)


def test_checkpoint_without_scales_keeps_1_0(big_kv_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="labkit.model_executor.model_runner"):
        pool = Engine(
            model_path=str(big_kv_checkpoint), kv_cache_dtype="fp8_e4m3", **CHUNKED
        ).model_runner.token_to_kv_pool
    assert pool.k_scale == pool.v_scale == [1.0] * LAYERS
    assert "KV scales: 1.0 (none in the checkpoint)" in caplog.messages


@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf])
def test_a_scale_that_is_not_positive_and_finite_is_refused_at_start(big_kv_checkpoint, tmp_path, bad):
    path = checkpoint_with(big_kv_checkpoint, tmp_path, named_scales([1.0, 1.0], [1.0, bad]))
    with pytest.raises(ValueError, match=rf"positive finite numbers: V scale of layer 1 is {bad}"):
        Engine(model_path=str(path), kv_cache_dtype="fp8_e4m3", **CHUNKED)


@pytest.mark.parametrize(
    "scales, why",
    [
        ({"model.layers.0.self_attn.k_scale": torch.ones(2)}, r"shape \(2,\); only one scale per layer"),
        ({"model.layers.2.self_attn.v_scale": torch.tensor(1.0)}, "for layer 2, but the model has 2"),
    ],
)
def test_per_head_scales_and_scales_of_missing_layers_are_refused(big_kv_checkpoint, tmp_path, scales, why):
    path = checkpoint_with(big_kv_checkpoint, tmp_path, scales)
    with pytest.raises(ValueError, match=why):
        Engine(model_path=str(path), kv_cache_dtype="fp8_e4m3", **CHUNKED)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pool_in_the_model_dtype_ignores_the_scales(calibrated, big_kv_checkpoint, dtype, caplog):
    runs = {}
    for name, path in (("with", calibrated[0]), ("without", big_kv_checkpoint)):
        with caplog.at_level(logging.INFO, logger="labkit.model_executor.model_runner"):
            engine = Engine(model_path=str(path), dtype=dtype, **CHUNKED)
        assert engine.model_runner.token_to_kv_pool.k_scale == [1.0] * LAYERS
        runs[name] = prompt_logprobs(engine)
    assert torch.equal(runs["with"], runs["without"])
    assert f"KV scales: found in the checkpoint, not used by a {dtype} pool" in caplog.messages


@pytest.mark.parametrize(
    "k, v, why",
    [
        ([1.0], [1.0, 1.0], "1 K scales for a KV pool of 2 layers"),
        ([1.0, 2.0], [1.0, 2.0, 3.0], "3 V scales"),
        ([1.0, -2.0], [1.0, 1.0], "K scale of layer 1 is -2.0"),
        ([0.0, math.nan], [1.0, 1.0], r"K scale of layer 0 is 0.0 \(1 more bad\)"),
        ([1.0, True], [1.0, 1.0], "K scale of layer 1 is True"),
        ([1.0, 1.0], ["2", 1.0], "V scale of layer 0 is '2'"),
    ],
)
def test_set_kv_scales_refuses_what_is_not_one_positive_finite_number_per_layer(k, v, why):
    pool = TokenToKVPool(8, 1, torch.float8_e4m3fn, num_layers=LAYERS, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=why):
        pool.set_kv_scales(k, v)
    assert pool.k_scale == pool.v_scale == [1.0] * LAYERS  # unchanged
    pool.set_kv_scales([0.25, 3], [2.0, 1e-3])
    assert (pool.k_scale, pool.v_scale) == ([0.25, 3.0], [2.0, 1e-3])


def test_disk_blocks_of_other_scales_are_never_read(calibrated, big_kv_checkpoint):
    """The disk tier's namespace names a float8 pool's scales (unless all 1.0): blocks stored with
    other scales would dequantize wrong."""
    engines = {
        name: Engine(model_path=str(path), kv_cache_dtype=kv, **CHUNKED)
        for name, path, kv in (
            ("checkpoint scales", calibrated[0], "fp8_e4m3"),
            ("1.0", big_kv_checkpoint, "fp8_e4m3"),
            ("float32", calibrated[0], "auto"),
        )
    }

    def namespace(name: str) -> str:
        return storage_namespace(engines[name].config, engines[name].model_runner)

    assert "scales=" in namespace("checkpoint scales")
    assert "scales=" not in namespace("1.0") and "scales=" not in namespace("float32")
    before = namespace("1.0")
    engines["1.0"].model_runner.token_to_kv_pool.set_kv_scales([2.0, 1.0], [1.0, 1.0])
    assert "scales=" in namespace("1.0") and namespace("1.0") not in (before, namespace("checkpoint scales"))
