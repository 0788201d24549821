"""The OpenAI-compatible API of a real server, through the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import torch
from server_process import MODEL, wait_idle

pytestmark = pytest.mark.slow  # a real server on the embedded model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat_prompt_len(hf_tokenizer, messages) -> int:
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion_answers_with_exact_usage(client, hf_tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == chat_prompt_len(hf_tokenizer, QUESTION)
    assert (
        r.usage.completion_tokens
        == len(hf_tokenizer(choice.message.content, add_special_tokens=False)["input_ids"]) + 1
    )  # + the EOS token that ended it
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_with_token_id_and_text_prompts(client, hf_tokenizer):
    ids = hf_tokenizer("The capital of France is")["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 8
    assert by_text.choices[0].finish_reason == "length"


def test_completion_batch_of_prompts_gives_one_choice_per_prompt_and_n(client):
    r = client.completions.create(model=MODEL, prompt=["One, two,", "Red, green,"], n=2, max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in r.choices}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: both choices of a prompt agree
    assert r.usage.completion_tokens == 16


def test_streaming_chat_has_role_first_one_finish_and_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_n2_gives_each_choice_its_role_and_finish(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=8, n=2, stream=True
    )
    roles, finishes, texts = {}, {}, {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = roles.get(c.index, 0) + 1
            if c.finish_reason:
                finishes[c.index] = finishes.get(c.index, 0) + 1
            texts[c.index] += c.delta.content or ""
    assert roles == {0: 1, 1: 1} and finishes == {0: 1, 1: 1}
    assert texts[0] == texts[1] != ""


def test_stop_string_cuts_the_text_and_is_reported(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert " 5" in text, text
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0, stop=[" 5"])
    assert r.choices[0].text == text[: text.index(" 5")]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == " 5"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed)
        return r.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1


def test_chat_logprobs_list_the_chosen_and_top_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)
    assert "".join(e.token for e in content[:-1]) in r.choices[0].message.content


def test_completion_logprobs_have_openai_shape(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_completion_echo_scores_the_prompt_as_transformers_does(server, client, hf_tokenizer, hf_model):
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = hf_tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]

    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    [choice] = scored.choices
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)

    greedy = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    continued = client.completions.create(**greedy, echo=True, logprobs=1)
    plain = client.completions.create(**greedy)
    assert continued.choices[0].text == prompt + plain.choices[0].text
    assert continued.choices[0].logprobs.token_logprobs[: len(ids)] == pytest.approx(
        choice.logprobs.token_logprobs, abs=1e-5
    )
    assert len(continued.choices[0].logprobs.tokens) == len(ids) + 4

    native = server.post(
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 3},
    ).json()["meta_info"]
    assert [lp for lp, _, _ in native["input_token_logprobs"]] == pytest.approx(want[2:], abs=1e-4)
    wait_idle(server)


def test_native_generate(server):
    r = server.post(
        "/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    )
    body = r.json()
    assert r.status_code == 200 and len(body["output_ids"]) == 4 and body["meta_info"]["finish_reason"] == "length"


def test_64_concurrent_streams_match_sequential_greedy(server, client):
    prompts = [f"Write the number {i} in words, then count down from it:" for i in range(64)]

    async def one(http: httpx.AsyncClient, prompt: str) -> str:
        text = ""
        async with http.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True},
        ) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    concurrent = asyncio.run(all_at_once())
    sequential = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts
    ]
    assert concurrent == sequential
    wait_idle(server)


def test_metrics_report_requests_tokens_and_latencies(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    text = server.get("/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^labkit:{name} (\S+)$", text, re.M)
        assert m, f"{name} missing from /metrics"
        return float(m.group(1))

    assert value("num_running_reqs") == 0 and value("num_queued_reqs") == 0
    assert value("prompt_tokens_total") > 0 and value("generation_tokens_total") >= 3
    assert value("requests_total") >= 1 and 0 <= value("cache_hit_rate") <= 1
    assert value("time_to_first_token_seconds_count") >= 1
    assert value("inter_token_latency_seconds_count") >= 2
    assert value("e2e_request_latency_seconds_count") == value("requests_total") + value("aborted_requests_total")
    assert 'labkit:e2e_request_latency_seconds_bucket{le="+Inf"}' in text


@pytest.mark.parametrize("backend, dataset", [("openai", "random"), ("openai-chat", "multiturn")])
def test_bench_serving_runs_against_the_server(server, backend, dataset):
    from labkit.bench.serving import main

    result = main(
        [
            "--backend",
            backend,
            "--base-url",
            server.url,
            "--dataset",
            dataset,
            "--num-prompts",
            "6",
            "--random-input-len",
            "32",
            "--random-output-len",
            "8",
            "--multiturn-max-tokens",
            "8",
            "--max-concurrency",
            "3",
            "--disable-tqdm",
        ]
    )
    m = result["metrics"]
    assert m["completed"] == 6 and m["failed"] == 0
    if dataset == "random":
        assert m["total_input_tokens"] == 6 * 32 and m["total_output_tokens"] == 6 * 8
    assert m["ttft_ms"]["mean"] > 0 and m["output_throughput"] > 0
