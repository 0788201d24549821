"""The decoder layer's norms and the MLP's activation fused into the projections after them (the GEMV
kernel's prologues, taken by a single 16-bit row on CUDA), the rotary and the KV store fused into
qkv_proj (gemv_qkv_rope_store, under the triton backend), and for rows the GEMV does not take the KV
store fused into the rotary (rotary_embedding_store): a model decodes through them as through the
separate kernels. On CPU the GEMV path is forced for float32 rows and runs in Triton's
interpreter; on CUDA the layers take it by themselves in bfloat16 (from the decode CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

import labkit.kernels
import labkit.layers.rotary
import labkit.models.llama
from labkit import Engine
from labkit.layers.linear import LinearBase

CUDA = torch.cuda.is_available()
PROMPT = [5, 17, 42, 99, 42, 7]
PARAMS = {"temperature": 0, "max_new_tokens": 5, "return_logprob": True, "ignore_eos": True}
FUSED = ["gemv_rmsnorm", "gemv_silu_and_mul"]


def count_calls(monkeypatch: pytest.MonkeyPatch, fused: list[str] = FUSED) -> dict[str, int]:
    calls = dict.fromkeys(fused, 0)

    def counting(name: str):
        kernel = getattr(labkit.kernels, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return counted

    for name in calls:
        monkeypatch.setattr(labkit.kernels, name, counting(name))
    return calls


def decode_with_and_without_gemv(model: str, monkeypatch: pytest.MonkeyPatch, fused: list[str], **kw):
    """(calls of the fused kernels, output through them, output through the separate kernels)."""
    device, dtype = ("cuda", "bfloat16") if CUDA else ("cpu", "float32")
    kw |= {"model_path": model, "load_format": "dummy", "device": device, "dtype": dtype}
    with monkeypatch.context() as m:  # the separate kernels
        m.setattr(LinearBase, "gemv_takes", lambda self, x, width: False)
        m.setattr(labkit.models.llama, "STORE_KV_IN_ROTARY", False)
        ref = Engine(**kw).generate(input_ids=PROMPT, sampling_params=PARAMS)
    if not CUDA:  # float32 rows take the GEMV path only when forced
        monkeypatch.setattr(LinearBase, "gemv_takes", lambda self, x, width: x.numel() == width)
    calls = count_calls(monkeypatch, fused)
    engine = Engine(**kw)
    for module in engine.model_runner.model.modules():
        if isinstance(module, LinearBase):  # the GEMV reads rows: undo the CPU runner's [in, out] layout
            module.weight.data = module.weight.data.contiguous()
    return calls, engine.generate(input_ids=PROMPT, sampling_params=PARAMS), ref


def assert_same_decode(out: dict, ref: dict) -> None:
    assert out["output_ids"] == ref["output_ids"]
    tol = 2e-2 if CUDA else 1e-4  # bfloat16: the fused kernel sums in another order
    for (a, _), (b, _) in zip(out["meta_info"]["output_token_logprobs"], ref["meta_info"]["output_token_logprobs"]):
        assert a == pytest.approx(b, abs=tol)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-qwen2-moe"])
def test_fused_projections_decode_as_the_separate_kernels(model, monkeypatch):
    calls, out, ref = decode_with_and_without_gemv(model, monkeypatch, FUSED)
    assert all(calls.values()), calls  # the decode steps took both fused kernels
    assert_same_decode(out, ref)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-qwen3"])
def test_qkv_with_rotary_and_kv_store_decodes_as_the_separate_kernels(model, kv_cache_dtype, monkeypatch):
    """Under the triton backend, every decode step's layers write q and the pool's K/V from
    gemv_qkv_rope_store (the rotary kernel's table forced on CPU), and the tokens are the same, on a
    pool of the model's dtype and on a float8 one (the kernel quantizes as store_kv)."""
    if not CUDA:
        monkeypatch.setattr(labkit.layers.rotary, "use_triton_kernels", lambda x: True)
    calls, out, ref = decode_with_and_without_gemv(
        model,
        monkeypatch,
        ["gemv_qkv_rope_store"],
        attention_backend="triton",
        disable_cuda_graph=True,
        disable_overlap_schedule=True,  # on CUDA an overlapped run forwards one decode step past the last token
        kv_cache_dtype=kv_cache_dtype,
    )
    layers = 2  # the tiny models'
    assert calls["gemv_qkv_rope_store"] == layers * (PARAMS["max_new_tokens"] - 1), calls  # not in the prefill
    assert_same_decode(out, ref)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_rotary_with_kv_store_decodes_as_the_separate_kernels(model, kv_cache_dtype, monkeypatch):
    """Rows the GEMV does not take (two requests, and the GEMV off) run qkv_proj as a matmul, then
    under the triton backend rotary_embedding_store in every decode step's layers: the same tokens as
    rotary_embedding then store_kv, and the logprobs within the dtype's rounding, on a pool of the
    model's dtype and on a float8 one."""
    if not CUDA:
        monkeypatch.setattr(labkit.layers.rotary, "use_triton_kernels", lambda x: True)
    monkeypatch.setattr(LinearBase, "gemv_takes", lambda self, x, width: False)
    device, dtype = ("cuda", "bfloat16") if CUDA else ("cpu", "float32")
    kw = {"model_path": model, "load_format": "dummy", "device": device, "dtype": dtype, "attention_backend": "triton"}
    kw |= {"disable_cuda_graph": True, "disable_overlap_schedule": True, "kv_cache_dtype": kv_cache_dtype}
    prompts = [PROMPT, PROMPT[::-1] + [3]]
    with monkeypatch.context() as m:
        m.setattr(labkit.models.llama, "STORE_KV_IN_ROTARY", False)
        ref = Engine(**kw).generate(input_ids=prompts, sampling_params=PARAMS)
    calls = count_calls(monkeypatch, ["rotary_embedding_store"])
    out = Engine(**kw).generate(input_ids=prompts, sampling_params=PARAMS)
    layers = 2  # the tiny models'
    assert calls["rotary_embedding_store"] == layers * (PARAMS["max_new_tokens"] - 1), calls  # not in the prefill
    for a, b in zip(out, ref):
        assert_same_decode(a, b)
