"""CPU cost of detokenizing one decode step (station 9, DetokenizerManager.handle) with the embedded
model's tokenizer: every request of the batch gets one new token of README text.

    .venv/bin/python -m pytest benchmarks -m microbench --benchmark-enable -k detokenize
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from labkit.io_struct import BatchTokenIDOutput, DetokenizeParams, ReqOutput
from labkit.model_loader.embedded import embedded_model_dir
from labkit.tokenizer.detokenizer_manager import DetokenizerManager

pytestmark = pytest.mark.microbench
TEXT = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.mark.parametrize("batch_size", [1, 16, 64])
def test_detokenize_step(benchmark, batch_size):
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    manager = DetokenizerManager(tokenizer)
    params = DetokenizeParams(stop=["\n\n\n"], skip_special_tokens=True, spaces_between_special_tokens=True)
    step = iter(range(1 << 30))

    def one_step() -> None:
        s = next(step)
        outs = [
            ReqOutput(rid=str(r), token_ids=[ids[(r * 300 + s) % len(ids)]], detokenize=params if s == 0 else None)
            for r in range(batch_size)
        ]
        manager.handle(BatchTokenIDOutput(outputs=outs, step=s))

    benchmark.pedantic(one_step, rounds=300, warmup_rounds=5)
    assert len(manager.decode_status) == batch_size
