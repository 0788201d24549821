"""On CUDA, verify forwards replay the decode CUDA graphs (their rows are decode rows) and give the
tokens of plain decoding. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from labkit import Engine
from tests.speculative.conftest import FIXED_GAIN, NOISY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_steps_replay_cuda_graphs_and_keep_greedy_tokens(page_size):
    kw = dict(model_path="tiny-qwen3", load_format="dummy", device="cuda", dtype="float32", page_size=page_size)
    kw |= dict(max_total_tokens=8192, attention_backend="triton", cuda_graph_max_bs=64)
    prompts = [[3 + i, 40 + i, 90, 7 * i % 256] * (4 + i) for i in range(9)]
    params = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
    plain = Engine(**kw).generate(input_ids=prompts, sampling_params=params)
    engine = Engine(**kw, **FIXED_GAIN, enable_trace=True, speculative_algorithm=NOISY, speculative_num_draft_tokens=5)
    graphs = engine.model_runner.cuda_graph_runner
    assert graphs is not None
    out = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in out] == [o["output_ids"] for o in plain]
    verify_steps = sum(s.forward_mode == "TARGET_VERIFY" for s in engine.tracer.steps)
    assert verify_steps > 0 and graphs.num_replays >= verify_steps
    assert sum(o["meta_info"]["spec_accepted_tokens"] for o in out) > 0
    assert engine.scheduler.drafter.idle()
    usage = engine.pool_usage()
    assert usage.free + usage.evictable == usage.total
