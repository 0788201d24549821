"""The request bodies SGLang's benchmark client (`sglang.bench_serving`, sglang 0.5.23,
`sglang/benchmark/serving.py`) sends with its three OpenAI/native backends are served, and its way of
reading the streams finds tokens; fields it sends with neutral values are accepted, other values of
them are a 400 naming the field. The payloads are rebuilt here as that file builds them, to pin each
field down; test_sglang_bench_serving.py runs the client itself."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import MODEL

pytestmark = pytest.mark.slow
OUTPUT_LEN = 8
PROMPT = "Write a haiku about the sea."


def _stream(server, path: str, payload: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=payload, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_sglang_oai_completions_payload(server):  # backend "sglang-oai"
    payload = {"model": MODEL, "prompt": PROMPT, "best_of": 1, "max_tokens": OUTPUT_LEN, "stream": True}
    payload |= {"temperature": 0.0, "ignore_eos": True, "logprobs": 2}
    chunks = _stream(server, "/v1/completions", payload)
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    tokens = [t for c in chunks if c.get("choices") for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert text and len(tokens) == OUTPUT_LEN


def test_sglang_oai_chat_payload(server):  # backend "sglang-oai-chat"
    payload = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    payload |= {"max_completion_tokens": OUTPUT_LEN, "temperature": 0.0, "ignore_eos": True}
    chunks = _stream(server, "/v1/chat/completions", payload)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


@pytest.mark.parametrize("return_logprob", [False, True])
def test_sglang_native_generate_payload(server, return_logprob):  # backend "sglang"
    payload = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": OUTPUT_LEN, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": return_logprob,
        "return_routed_experts": False,
        "logprob_start_len": -1,
    }
    if return_logprob:
        payload["top_logprobs_num"] = 3
    chunks = _stream(server, "/generate", payload)
    # As the client reads them: cumulative text, and completion_tokens counting up to the output length.
    counts = [c["meta_info"]["completion_tokens"] for c in chunks if c.get("text")]
    assert counts == sorted(counts) and counts[-1] == OUTPUT_LEN
    meta = chunks[-1]["meta_info"]
    if return_logprob:
        assert [tok for _, tok, _ in meta["output_token_logprobs"]] == chunks[-1]["output_ids"]
        assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
        assert all(len(top) == 3 and top[0][0] >= top[-1][0] for top in meta["output_top_logprobs"])
        # The chosen token is greedy: the most likely of its top alternatives.
        assert all(
            top[0][1] == tok for top, (_, tok, _) in zip(meta["output_top_logprobs"], meta["output_token_logprobs"])
        )
    else:
        assert "output_token_logprobs" not in meta


@pytest.mark.parametrize(
    ("path", "field", "value", "says"),
    [
        ("/v1/completions", "best_of", 2, "best_of must be 1"),
        ("/v1/completions", "lora_path", "my-adapter", "no LoRA adapters"),
        ("/v1/chat/completions", "lora_path", ["a"], "no LoRA adapters"),
        ("/generate", "lora_path", "my-adapter", "no LoRA adapters"),
        ("/generate", "return_routed_experts", True, "return_routed_experts must be false"),
        ("/generate", "token_ids_logprob", [1, 2], "not supported"),
    ],
)
def test_non_neutral_values_are_a_400_naming_the_field(server, path, field, value, says):
    bodies = {
        "/v1/completions": {"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2},
        "/generate": {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}},
    }
    r = server.post(path, {**bodies[path], field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and says in error["message"]
