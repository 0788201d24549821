"""--enable-torch-compile: decode batches up to torch_compile_max_bs run the torch.compile'd model
(attention excluded, see labkit/layers/attention.py) and give the same greedy tokens."""

from __future__ import annotations

import torch._dynamo

from labkit import Engine


def test_compiled_decode_gives_the_same_tokens():
    prompts = [[5 + i] * (7 + 3 * i) for i in range(5)]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    kw = dict(model_path="tiny-llama", load_format="dummy", dtype="float32")
    eager = Engine(**kw)
    expected = [o["output_ids"] for o in eager.generate(input_ids=prompts, sampling_params=params)]
    # Count this engine's compiles only (reset() keeps the counters). On CUDA they happen while the
    # engine captures its decode graphs, at construction; on CPU at the first compiled decode.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = Engine(**kw, enable_torch_compile=True, torch_compile_max_bs=8)
    assert compiled.model_runner.decode_model(8) is compiled.model_runner.compiled_model
    assert compiled.model_runner.decode_model(9) is compiled.model_runner.model
    got = [o["output_ids"] for o in compiled.generate(input_ids=prompts, sampling_params=params)]
    assert got == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # something was compiled
    # ... around the attention backend's calls, which the graphs leave out (compile_with_eager_attention)
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert any("torch.compiler.disable()" in reason for reason in breaks), dict(breaks)
