"""skip_tokenizer_init (--skip-tokenizer-init): no tokenizer is loaded even where the model has one;
token ids go in and come out (no text), text-only features are refused with a clear error, and the
serving benchmark's `generate` backend measures such a server on the same requests as the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from server_process import wait_idle

from labkit import Engine
from labkit.bench import datasets
from labkit.bench.backends import HttpTarget, run_http, server_info
from labkit.config import EngineConfig
from labkit.server.inprocess import InProcessServer

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPT = [1, 422, 1030, 314, 3485, 30]


def test_engine_without_tokenizer_takes_and_returns_token_ids_only(tiny_engine_kwargs):
    with_text = Engine(**tiny_engine_kwargs).generate(input_ids=PROMPT, sampling_params=GREEDY)
    engine = Engine(**tiny_engine_kwargs, skip_tokenizer_init=True)
    assert engine.tokenizer is None  # tokenizer_path names one: it is still not loaded
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert out["output_ids"] == with_text["output_ids"] and out["text"] is None and with_text["text"]
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.generate(prompt="Hello", sampling_params=GREEDY)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        engine.generate(messages=[{"role": "user", "content": "Hi"}], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "stop": ["x"]})
    ids = out["output_ids"]
    stopped = engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "stop_token_ids": [ids[-1]]})
    assert stopped["output_ids"] == ids[: ids.index(ids[-1]) + 1]  # stop token ids need no tokenizer


@pytest.mark.parametrize("incremental", [False, True])
def test_server_without_tokenizer_streams_ids_and_benchmarks_like_the_engine(tiny_engine_kwargs, incremental):
    """Streamed /generate chunks hold all ids so far, or (incremental_streaming_output) only new ones."""
    config = EngineConfig(**tiny_engine_kwargs, skip_tokenizer_init=True)
    reqs = datasets.random_requests(6, 12, 5, 0.5, vocab_size=49152, seed=3)
    engine = Engine(dataclasses.replace(config))
    expected = [
        engine.generate(input_ids=r.prompt, sampling_params={**GREEDY, "max_new_tokens": r.output_len})["output_ids"]
        for r in reqs
    ]

    async def main():
        server = InProcessServer(config)
        server.args.incremental_streaming_output = incremental
        await server.start()
        try:
            client = server.client
            chat = {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}]}
            refused = await server.serve(client.post("/v1/chat/completions", json=chat))
            assert refused.status_code == 400 and "skip_tokenizer_init" in refused.json()["error"]["message"]
            body = {"input_ids": PROMPT, "sampling_params": GREEDY}
            whole = (await server.serve(client.post("/generate", json=body))).json()
            assert whole["text"] is None and whole["meta_info"]["completion_tokens"] == 6
            streamed = await server.serve(client.post("/generate", json={**body, "stream": True}))
            chunks = [json.loads(line[5:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
            ids = [c["output_ids"] for c in chunks]
            assert (sum(ids, []) if incremental else ids[-1]) == whole["output_ids"]
            # A chunk per step, or several steps' tokens in one where the handler fell behind: the
            # ids so far, or the new ones, match the count the chunk reports.
            so_far = [sum(len(i) for i in ids[: k + 1]) if incremental else len(ids[k]) for k in range(len(ids))]
            assert [c["meta_info"]["completion_tokens"] for c in chunks] == so_far
            assert all(a < b for a, b in zip(so_far, so_far[1:])) and so_far[-1] == 6

            target = HttpTarget("http://labkit", "", "generate", incremental=incremental)
            assert (await server.serve(server_info(client, target)))["limits"]["vocab_size"] == 49152
            outs, _ = await server.serve(run_http(client, target, reqs, [0.0] * len(reqs), max_concurrency=3))
            usage = server.scheduler.pool_usage()
            assert usage.request_owned == 0 and usage.protected == 0
            return whole, outs
        finally:
            await server.close()

    whole, outs = asyncio.run(main())
    assert whole["output_ids"] == engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    assert all(o.success for o in outs), [o.error for o in outs]
    assert [o.output_len for o in outs] == [len(e) for e in expected] == [r.output_len for r in reqs]
    assert [o.prompt_len for o in outs] == [r.prompt_len for r in reqs]
    # A gap between every two chunks, at most one chunk a token (a step's, or several steps' merged).
    assert all(o.ttft > 0 and len(o.itl) <= o.output_len - 1 and o.ttft + sum(o.itl) <= o.latency for o in outs)


@pytest.mark.slow
def test_served_without_tokenizer_the_generate_benchmark_completes_every_request(tiny_vocab_config, tmp_path):
    """The real three-process server on a random-weight model given only its config (no tokenizer
    anywhere), measured by `python -m labkit.bench.serving --backend generate` (which reads from
    /get_server_info that the chunks hold only new ids)."""
    from labkit.bench import serving
    from labkit.server.process import start_server

    server = start_server(
        "--model-path", tiny_vocab_config, "--load-format", "dummy", "--skip-tokenizer-init",
        "--max-total-tokens", "4096", "--log-level", "warning", "--incremental-streaming-output",
    )  # fmt: skip
    argv = ["--backend", "generate", "--base-url", server.url, "--num-prompts", "8", "--random-input-len", "24"]
    argv += ["--random-output-len", "6", "--max-concurrency", "4", "--disable-tqdm"]
    try:
        results = [serving.main(argv + ["--client-processes", str(n)]) for n in (1, 3)]
        wait_idle(server)
    finally:
        assert server.stop() == 0
    for result in results:  # one client process, and three sending 3 + 3 + 2 requests
        m = result["metrics"]
        assert (m["completed"], m["failed"], m["total_output_tokens"], m["total_input_tokens"]) == (8, 0, 48, 8 * 24)
        assert m["itl_ms"]["p99"] > 0 and m["ttft_ms"]["p99"] > 0
