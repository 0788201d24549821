"""SGLang's own benchmark client (`sglang.bench_serving`, sglang 0.5.23, installed by setup.sh for the
tests only) runs against the server with each of its OpenAI and native backends: every request
completes with the output length asked for, and the server's pools come back afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import MODEL, wait_idle

from labkit.model_loader import embedded_model_dir

pytestmark = pytest.mark.slow
CLIENT = Path(__file__).with_name("sglang_bench_client.py")
CLIENT_SITE = Path(sys.prefix) / "peers" / "sglang"
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 32, 8


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_sglang_bench_serving_completes_every_request(server, backend, tmp_path):
    if not CLIENT_SITE.is_dir():
        pytest.fail(f"SGLang's client is not installed in {CLIENT_SITE}: run bash scripts/setup.sh")
    result_file = tmp_path / "result.jsonl"
    args = ["--backend", backend, "--base-url", server.url, "--model", MODEL]
    args += ["--tokenizer", str(embedded_model_dir()), "--dataset-name", "random-ids"]
    args += ["--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN)]
    args += ["--random-output-len", str(OUTPUT_LEN), "--random-range-ratio", "1.0"]
    args += ["--output-file", str(result_file), "--seed", "1"]
    env = os.environ | {"PYTHONPATH": str(CLIENT_SITE), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(CLIENT), *args], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(result_file.read_text().splitlines()[-1])
    assert result["completed"] == NUM_PROMPTS, run.stdout[-3000:]
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0
    wait_idle(server)
