"""Decode CUDA graphs (labkit.model_executor.cuda_graph_runner).

On CUDA: greedy outputs and logprobs with graphs equal those without (triton in float32 and bfloat16,
FlashInfer in bfloat16 where it is installed; page sizes 1 and 16, batches that need padding,
requests finishing at different steps so the batch shrinks through the captured sizes, batches
above the largest size falling back to eager), and the
KV pool's accounting is untouched by padding. Everywhere: the capture sizes, the config checks, and
the padded static-buffer path run eagerly (use_cuda_graph=False) through the triton backend's graph
hooks, which on CPU runs in Triton's interpreter."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from labkit import Engine
from labkit.attention import TorchNativeAttnBackend
from labkit.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes
from labkit.model_loader.loader import CONFIGS_DIR

CUDA = torch.cuda.is_available()
NO_CUDA = pytest.mark.skipif(not CUDA, reason="no CUDA")


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def checkpoint(request, tmp_path_factory):
    config = AutoConfig.from_pretrained(CONFIGS_DIR / f"{request.param}.json")
    config.initializer_range = 0.2  # peaked logits, so greedy choices do not hinge on rounding
    config.head_dim = 64  # a size every backend supports (FlashInfer: 64, 128, 256)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _workload(n: int) -> tuple[list[list[int]], list[dict]]:
    """n prompts of different lengths; request i stops after 3 + 2*i tokens, so a decode batch
    shrinks one request every other step (through sizes that need padding)."""
    prompts = [[5 + (13 * i + 7 * j) % 240 for j in range(9 + 11 * i)] for i in range(n)]
    params = [
        {"temperature": 0, "max_new_tokens": 3 + 2 * i, "ignore_eos": True, "return_logprob": True} for i in range(n)
    ]
    return prompts, params


def _check_same(base: list[dict], other: list[dict], tol: float) -> None:
    assert [o["output_ids"] for o in other] == [o["output_ids"] for o in base]
    worst = 0.0
    for a, b in zip(base, other):
        for (lp_a, _), (lp_b, _) in zip(
            a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
        ):
            worst = max(worst, abs(lp_a - lp_b))
    assert worst <= tol, f"logprobs differ by up to {worst:.3g}"


def _assert_pool_clean(engine: Engine) -> None:
    engine.flush_cache()
    assert engine.allocator.available_size() == engine.allocator.size
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    assert engine.scheduler.pool_usage().free == engine.allocator.size


# ---- everywhere ---------------------------------------------------------------------------------
def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(16) == [1, 2, 4, 8, 16]
    sizes = capture_batch_sizes(160)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 160 and len(sizes) == 23
    assert capture_batch_sizes(300)[-4:] == [256, 272, 288, 300]
    assert sizes == sorted(set(sizes))
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def test_config_checks_and_cpu_builds_no_runner(checkpoint):
    engine = Engine(model_path=str(checkpoint), device="cpu", max_total_tokens=256)
    assert engine.model_runner.cuda_graph_runner is None  # silently: CPU has no graphs
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        Engine(model_path=str(checkpoint), device="cpu", cuda_graph_max_bs=0)


def test_default_backend_hooks_refuse_graphs():
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    for call in (
        lambda: backend.init_cuda_graph_state(8),
        lambda: backend.init_forward_metadata_capture_cuda_graph(None),
        lambda: backend.init_forward_metadata_replay_cuda_graph(None),
    ):
        with pytest.raises(NotImplementedError):
            call()


def engine_kwargs(checkpoint, page_size: int, **overrides) -> dict:
    """Engine keywords of the graph tests: the checkpoint in float32 on CUDA if there is one, the
    triton backend (Triton's interpreter on CPU), a 1024-token pool; `overrides` replace or add."""
    return {
        "model_path": str(checkpoint),
        "device": "cuda" if CUDA else "cpu",
        "dtype": "float32",
        "page_size": page_size,
        "max_total_tokens": 1024,
        "attention_backend": "triton",
    } | overrides


@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_static_path_matches_eager_decode(checkpoint, page_size):
    """The graph path minus the capture: padding rows, static buffers, the triton backend's
    capture/replay hooks. Same tokens and logprobs as plain decode, and no slot leaks."""
    kwargs = engine_kwargs(checkpoint, page_size, disable_cuda_graph=True)
    prompts, params = _workload(5 if CUDA else 3)  # Triton's interpreter is slow: fewer steps on CPU
    base = Engine(**kwargs).generate(input_ids=prompts, sampling_params=params)
    engine = Engine(**kwargs)
    runner = CudaGraphRunner(engine.model_runner, max_bs=4, use_cuda_graph=False)
    engine.model_runner.cuda_graph_runner = runner
    out = engine.generate(input_ids=prompts, sampling_params=params)
    _check_same(base, out, tol=2e-4)
    assert runner.num_replays > 0 and runner.num_padded_rows > 0  # batches of 3 ran padded to 4
    _assert_pool_clean(engine)


# ---- CUDA ---------------------------------------------------------------------------------------
FLASHINFER = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")
BACKEND_DTYPES = [
    ("triton", "float32", 2e-4),
    ("triton", "bfloat16", 0.15),
    pytest.param("flashinfer", "bfloat16", 0.15, marks=FLASHINFER),  # FlashInfer has no float32 kernels
]


@NO_CUDA
@pytest.mark.parametrize("backend, dtype, tol", BACKEND_DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_reqs, max_bs", [(11, 16), (1, 16), (13, 4)])
def test_cuda_graph_outputs_equal_eager(checkpoint, backend, dtype, tol, page_size, num_reqs, max_bs):
    kwargs = engine_kwargs(checkpoint, page_size, dtype=dtype, max_total_tokens=4096, attention_backend=backend)
    prompts, params = _workload(num_reqs)
    eager = Engine(**kwargs, disable_cuda_graph=True)
    assert eager.model_runner.cuda_graph_runner is None
    base = eager.generate(input_ids=prompts, sampling_params=params)
    del eager
    engine = Engine(**kwargs, cuda_graph_max_bs=max_bs)
    runner = engine.model_runner.cuda_graph_runner
    assert runner is not None and runner.max_bs == min(max_bs, 16) and len(runner.graphs) == len(runner.batch_sizes)
    out = engine.generate(input_ids=prompts, sampling_params=params)
    _check_same(base, out, tol)
    assert runner.num_replays > 0
    if num_reqs > 1:
        assert runner.num_padded_rows > 0
    _assert_pool_clean(engine)
    # Again on the same engine (cached prefixes, reused request slots): still the same results.
    _check_same(base, engine.generate(input_ids=prompts, sampling_params=params), tol)
    _assert_pool_clean(engine)


@NO_CUDA
def test_cuda_graph_padding_writes_only_the_reserved_page(checkpoint):
    """Every KV slot outside page 0 that no real token was given stays exactly as it was."""
    engine = Engine(
        model_path=str(checkpoint),
        device="cuda",
        dtype="float32",
        page_size=16,
        max_total_tokens=2048,
        attention_backend="triton",
        cuda_graph_max_bs=16,
    )
    runner, pool = engine.model_runner, engine.token_to_kv_pool
    written: list[torch.Tensor] = []  # the slots of every real token of every forward
    build = runner.build_forward_batch

    def recording_build(batch):
        fb = build(batch)
        written.append(fb.out_cache_loc.clone())
        return fb

    runner.build_forward_batch = recording_build
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(7.0)
    prompts, params = _workload(7)
    engine.generate(input_ids=prompts, sampling_params=params)
    assert runner.cuda_graph_runner.num_padded_rows > 0
    assert runner.prefill_graph_runner.num_padded_tokens > 0  # the prefills' padding too
    untouched = torch.ones(pool.k_buffer[0].shape[0], dtype=torch.bool, device="cuda")
    untouched[torch.cat(written)] = False
    untouched[:16] = False  # the reserved page, where padding writes
    assert untouched.sum() > 1000
    for buf in pool.k_buffer + pool.v_buffer:
        assert (buf[untouched] == 7.0).all()
    _assert_pool_clean(engine)


@NO_CUDA
def test_torch_native_on_cuda_runs_without_graphs(checkpoint):
    engine = Engine(model_path=str(checkpoint), device="cuda", max_total_tokens=1024, attention_backend="torch_native")
    assert engine.model_runner.cuda_graph_runner is None
    prompts, params = _workload(3)
    assert len(engine.generate(input_ids=prompts, sampling_params=params)) == 3
