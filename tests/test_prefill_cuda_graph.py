"""Prefill CUDA graphs (labkit.model_executor.prefill_graph_runner).

Everywhere: the captured token counts, the config check, the hooks other backends refuse, and the
padded static-buffer path run eagerly (use_cuda_graph=False) through the triton backend's prefill
hooks (Triton's interpreter on CPU): same tokens and logprobs as plain extends, for fresh prompts,
cached prefixes, chunked prefill and mixed batches, with no slot leaked. On CUDA: greedy outputs and
logprobs with the graphs equal those of eager extends (float32 and bfloat16, page sizes 1 and 16),
and forwards beyond the graphs fall back to eager."""

from __future__ import annotations

import pytest
import torch

from labkit import Engine
from labkit.attention import TorchNativeAttnBackend
from labkit.model_executor.prefill_graph_runner import PrefillGraphRunner, capture_token_counts
from tests.test_cuda_graph import _assert_pool_clean, _check_same, checkpoint, engine_kwargs  # noqa: F401

CUDA = torch.cuda.is_available()
NO_CUDA = pytest.mark.skipif(not CUDA, reason="no CUDA")


def _workload(n: int, shared: int) -> tuple[list[list[int]], list[dict]]:
    """n prompts of 3..(3 + 7 n) tokens, the first `shared` tokens common to all (a cached prefix
    for every prompt after the first), stopping at different steps."""
    head = [11 + j % 200 for j in range(shared)]
    prompts = [head + [5 + (13 * i + 7 * j) % 240 for j in range(3 + 7 * i)] for i in range(n)]
    params = [{"temperature": 0, "max_new_tokens": 2 + i, "ignore_eos": True, "return_logprob": True} for i in range(n)]
    return prompts, params


def test_capture_token_counts():
    assert capture_token_counts(2048) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert capture_token_counts(5) == [5]
    assert capture_token_counts(16) == [16]
    assert capture_token_counts(20) == [16, 20]
    assert capture_token_counts(100) == [16, 24, 32, 48, 64, 96, 100]
    with pytest.raises(ValueError):
        capture_token_counts(0)


def test_config_check_and_cpu_builds_no_runner(checkpoint):  # noqa: F811
    engine = Engine(model_path=str(checkpoint), device="cpu", max_total_tokens=256)
    assert engine.model_runner.prefill_graph_runner is None
    with pytest.raises(ValueError, match="cuda_graph_max_prefill_tokens"):
        Engine(model_path=str(checkpoint), device="cpu", cuda_graph_max_prefill_tokens=-1)


def test_default_backend_hooks_refuse_prefill_graphs():
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    for call in (
        lambda: backend.init_prefill_graph_state(64, 8),
        lambda: backend.init_forward_metadata_capture_prefill_graph(None),
        lambda: backend.init_forward_metadata_replay_prefill_graph(None),
    ):
        with pytest.raises(NotImplementedError):
            call()


@pytest.mark.parametrize("page_size", [1, 16])
def test_padded_static_prefill_path_matches_eager_extends(checkpoint, page_size):  # noqa: F811
    """The graph path minus the capture, on fresh prompts, cached prefixes, prompts cut into chunks
    (chunks of 32 tokens; with a 40-token runner for up to 3 requests, larger forwards run
    eagerly) and mixed batches (the chunks ride with running decodes)."""
    kwargs = engine_kwargs(
        checkpoint, page_size, disable_cuda_graph=True, chunked_prefill_size=32, enable_mixed_chunk=True
    )
    prompts, params = _workload(5, shared=20)

    def run(engine: Engine) -> list[dict]:  # the first prompt alone: the others then hit its prefix
        return [
            *engine.generate(input_ids=prompts[:1], sampling_params=params[:1]),
            *engine.generate(input_ids=prompts[1:], sampling_params=params[1:]),
        ]

    base = run(Engine(**kwargs))
    engine = Engine(**kwargs)
    runner = PrefillGraphRunner(engine.model_runner, max_tokens=40, max_reqs=3, use_cuda_graph=False)
    engine.model_runner.prefill_graph_runner = runner
    eager_extends = []
    forward = engine.model_runner.forward

    def counting_forward(fb):
        if fb.forward_mode.is_extend() and not runner.can_run(fb):
            eager_extends.append(fb.num_tokens)
        return forward(fb)

    engine.model_runner.forward = counting_forward
    _check_same(base, run(engine), tol=2e-4)
    assert runner.num_replays > 0 and runner.num_padded_tokens > 0
    assert eager_extends  # and some fell back: more than 40 tokens or 3 requests
    _assert_pool_clean(engine)


# ---- CUDA ---------------------------------------------------------------------------------------
@NO_CUDA
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-4), ("bfloat16", 0.15)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_graph_outputs_equal_eager_extends(checkpoint, dtype, tol, page_size):  # noqa: F811
    kwargs = engine_kwargs(
        checkpoint, page_size, dtype=dtype, max_total_tokens=4096, chunked_prefill_size=32, enable_mixed_chunk=True
    )
    prompts, params = _workload(9, shared=20)
    eager = Engine(**kwargs, cuda_graph_max_prefill_tokens=0)
    assert eager.model_runner.prefill_graph_runner is None
    base = eager.generate(input_ids=prompts, sampling_params=params)
    del eager
    engine = Engine(**kwargs, cuda_graph_max_prefill_tokens=40)
    runner = engine.model_runner.prefill_graph_runner
    assert runner is not None and sorted(runner.graphs) == [16, 24, 32, 40]
    _check_same(base, engine.generate(input_ids=prompts, sampling_params=params), tol)
    assert runner.num_replays > 0 and runner.num_padded_tokens > 0
    _assert_pool_clean(engine)
    # Again (cached prefixes, shorter extends, reused request slots): still the same results.
    _check_same(base, engine.generate(input_ids=prompts, sampling_params=params), tol)
    _assert_pool_clean(engine)
