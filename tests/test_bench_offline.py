"""The offline benchmark's helpers: labkit's outputs kept for comparison, the optional llama.cpp peer
(exactly output-len greedy tokens per request, EOS ignored, nothing carried from one request to the
next) on the real embedded GGUF, and the clear error when llama-cpp-python is missing."""

from __future__ import annotations

import sys
from typing import cast

import pytest

from labkit import Engine
from labkit.bench import offline

OUTPUT_LEN = 4


@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("llama_cpp")
    return offline.load_llama([[0] * 32], OUTPUT_LEN)  # room for the test prompts, all shorter than 32


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return offline.make_requests(2, 8, 8, llm.n_vocab(), seed=0)


def test_llama_cpp_peer_yields_output_len_tokens_per_request(llm, prompts):
    seconds, per_token, outs = offline.bench_llama_cpp(llm, prompts, OUTPUT_LEN)
    assert [len(o) for o in outs] == [OUTPUT_LEN] * len(prompts)
    assert seconds > 0 and per_token > 0
    assert outs == [offline.llama_generate(llm, p, OUTPUT_LEN)[0] for p in prompts]  # greedy: repeatable


def test_llama_cpp_peer_resets_between_requests(llm, prompts, monkeypatch):
    evaluated: list[int] = []
    real_eval = llm.eval

    def counting_eval(tokens):
        evaluated.append(len(tokens))
        real_eval(tokens)

    monkeypatch.setattr(llm, "eval", counting_eval)
    # The same prompt twice: without a reset, Llama.generate would reuse the first request's KV cache
    # and evaluate one prompt token instead of all of them.
    for _ in range(2):
        evaluated.clear()
        offline.llama_generate(llm, prompts[0], OUTPUT_LEN)
        assert sum(evaluated) == len(prompts[0]) + OUTPUT_LEN - 1


def test_llama_cpp_peer_ignores_eos(llm):
    chat = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nHello! How can I help you today?"
    prompt = llm.tokenize(chat.encode(), add_bos=False, special=True)
    tokens, _ = offline.llama_generate(llm, prompt, OUTPUT_LEN)
    assert tokens[0] == llm.token_eos()  # the model is done answering ...
    assert len(tokens) == OUTPUT_LEN  # ... and generation goes on regardless


def test_llama_cpp_flag_without_llama_cpp_names_the_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail

    def no_engine(*args, **kwargs):
        raise AssertionError("the missing peer must be reported before the benchmark starts")

    monkeypatch.setattr(offline, "Engine", no_engine)
    with pytest.raises(SystemExit):
        offline.main(["--llama-cpp"])
    assert "pip install llama-cpp-python" in capsys.readouterr().err


def test_bench_labkit_returns_each_prompts_output_ids(tiny_engine_kwargs):
    engine = Engine(**tiny_engine_kwargs)
    prompts = offline.make_requests(2, 8, 8, vocab=49152, seed=0)
    _, per_token, outs = offline.bench_labkit(engine, prompts, OUTPUT_LEN)
    params = {"temperature": 0, "max_new_tokens": OUTPUT_LEN, "ignore_eos": True}
    alone = [cast(dict, engine.generate(input_ids=p, sampling_params=params))["output_ids"] for p in prompts]
    assert outs == alone and per_token > 0


def test_count_agreeing_compares_leading_tokens_only():
    assert offline.count_agreeing([[1, 2, 3], [1, 2, 4], [5]], [[1, 2, 9], [1, 7, 4], [6]], prefix=2) == 1
