"""Tensor and data parallelism in the server (CPU, gloo): --dp-size replicas complete every request
once, cache-aware routing finds more cached prefix than round robin, a dead worker rank takes the
server down cleanly, two "nodes" on localhost serve a chat request, bad layouts are clear errors."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from labkit.engine import Engine
from labkit.server.process import ServerProcess, free_port, start_server

# On CPU (gloo) even where a GPU is present: more ranks than GPUs would be refused.
TINY = ("--model-path", "tiny-llama", "--load-format", "dummy", "--max-total-tokens", "4096", "--device", "cpu")
pytestmark = pytest.mark.slow  # each test starts servers of several processes


def _generate(server: ServerProcess, ids: list[int], max_new: int, rid: str) -> dict:
    body = {
        "input_ids": ids,
        "rid": rid,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    r = server.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_idle(server: ServerProcess) -> dict:
    deadline = time.monotonic() + 20
    while True:
        info = server.info()
        pool = info["pool"]
        if info["in_flight"] == 0 and pool["request_owned"] == 0 and pool["protected"] == 0:
            assert pool["free"] + pool["evictable"] == pool["total"]
            assert info["req_slots"]["free"] == info["req_slots"]["total"]
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.2)


def test_dp2_of_tp2_completes_every_request_of_a_mixed_workload_exactly_once():
    rng = random.Random(0)
    work = [([rng.randrange(256) for _ in range(rng.randrange(1, 90))], rng.randrange(1, 24)) for _ in range(24)]
    engine = Engine(model_path="tiny-llama", load_format="dummy", max_total_tokens=4096, device="cpu")
    expected = [
        o["output_ids"]
        for o in engine.generate(
            input_ids=[w[0] for w in work],
            sampling_params=[{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for _, n in work],
        )
    ]
    server = start_server(*TINY, "--dp-size", "2", "--tp-size", "2", "--load-balance-method", "shortest_queue")
    try:
        before = sum(server.info()["dp_routed_requests"])
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: _generate(server, work[i][0], work[i][1], f"r{i}"), range(len(work))))
        assert [o["meta_info"]["id"] for o in outs] == [f"r{i}" for i in range(len(work))]
        assert [o["output_ids"] for o in outs] == expected  # each replica (two ranks) computes as one device
        assert len(info_processes := server.info()["processes"]) == 5, info_processes  # 2 x 2 ranks + detokenizer
        info = _wait_idle(server)
        routed = info["dp_routed_requests"]
        assert sum(routed) - before == len(work) and min(routed) > 0, routed
        assert len(info["replicas"]) == 2
    finally:
        assert server.stop() == 0


def _hit_rate(policy: str) -> tuple[float, list[int]]:
    """Cached prompt tokens / prompt tokens of a shared-prefix workload sent 4 at a time to --dp-size 2,
    and the requests each replica got."""
    rng = random.Random(1)
    groups = [[rng.randrange(256) for _ in range(96)] for _ in range(6)]
    prompts = [g + [rng.randrange(256) for _ in range(8)] for g in groups for _ in range(5)]
    rng.shuffle(prompts)
    server = start_server(*TINY, "--dp-size", "2", "--load-balance-method", policy)
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: _generate(server, prompts[i], 8, f"{policy}-{i}"), range(len(prompts))))
        routed = server.info()["dp_routed_requests"]
    finally:
        assert server.stop() == 0
    return sum(o["meta_info"]["cached_tokens"] for o in outs) / sum(map(len, prompts)), routed


def test_cache_aware_routing_reaches_a_higher_prefix_hit_rate_than_round_robin():
    results = {policy: _hit_rate(policy) for policy in ("round_robin", "cache_aware")}
    print(f"prefix hit rate and requests per replica on the shared-prefix workload, dp_size 2: {results}")
    rates = {policy: rate for policy, (rate, _) in results.items()}
    assert rates["cache_aware"] > rates["round_robin"] + 0.05, results
    assert min(results["cache_aware"][1]) >= 5, results  # both replicas work: not one replica for all


def test_a_killed_worker_rank_fails_requests_in_flight_and_takes_the_server_down():
    server = start_server(*TINY, "--tp-size", "2", "--log-level", "warning")
    worker = server.info()["processes"]["scheduler-tp1"]
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        assert next(events)
        os.kill(worker, signal.SIGKILL)
        rest = list(events)  # must end, not hang
    assert any('"error"' in line for line in rest)
    assert server.proc.wait(timeout=30) != 0
    server.stop()  # raises if a child outlived the server


def _node(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "labkit.server", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny random Llama with the embedded model's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from labkit.model_loader.loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_two_nodes_on_localhost_answer_a_chat_request(tiny_chat_model):
    addr = f"127.0.0.1:{free_port()}"
    layout = ("--model-path", tiny_chat_model, "--device", "cpu", "--tp-size", "2", "--nnodes", "2")
    layout += ("--dist-init-addr", addr)
    node1 = _node(*layout, "--node-rank", "1")
    try:
        server = start_server(*layout, "--node-rank", "0")
        try:
            body = {"model": tiny_chat_model, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8}
            r = server.post("/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["role"] == "assistant"
            assert r.json()["usage"]["completion_tokens"] > 0
        finally:
            assert server.stop() == 0
        node1.wait(timeout=30)  # its rank follows node 0's: it goes when node 0 goes
    finally:
        if node1.poll() is None:
            node1.kill()
        out = node1.communicate()[0]
    assert "labkit node 1 ready" in out, out


def test_an_unreachable_rendezvous_is_a_clear_error_not_a_hang():
    node1 = _node(
        *TINY,
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        f"127.0.0.1:{free_port()}",
        "--dist-timeout",
        "3",
    )
    out = node1.communicate(timeout=60)[0]
    assert node1.returncode != 0
    assert "could not join the tensor-parallel group" in out, out


def test_a_tp_size_the_model_cannot_split_is_refused_at_start():
    out = subprocess.run(
        [sys.executable, "-m", "labkit.server", *TINY, "--tp-size", "3"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert "tp_size 3 does not fit the model" in out.stderr + out.stdout


def test_a_tensor_parallel_server_trace_has_a_step_track_per_rank(tmp_path):
    from labkit.trace.export import from_perfetto

    path = tmp_path / "trace.json"
    server = start_server(*TINY, "--tp-size", "2", "--trace-file", str(path))
    try:
        _generate(server, [1, 2, 3, 4], 5, "traced")
    finally:
        assert server.stop() == 0
    tracer = from_perfetto(path)
    assert tracer.rank_steps and {s.rank for s in tracer.rank_steps} == {1}
    assert {s.step for s in tracer.rank_steps} == {s.step for s in tracer.steps}


def test_aborts_flush_info_and_metrics_cover_every_replica():
    server = start_server(*TINY, "--dp-size", "2", "--load-balance-method", "round_robin", "--enable-metrics")
    body = {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    try:
        streams, replicas = [], []
        for rid in ("a", "b"):
            response = httpx.stream("POST", server.url + "/generate", json={**body, "rid": rid}, timeout=60)
            streams.append((response, response.__enter__().iter_lines()))
            assert next(line for line in streams[-1][1] if line.startswith("data: "))
        info = server.info()
        replicas = [r["running"] for r in info["replicas"]]
        assert replicas == [1, 1], info  # one on each replica
        assert server.post("/flush_cache").status_code == 400  # refused while requests run, on any replica
        for rid in ("a", "b"):
            assert server.post("/abort_request", {"rid": rid}).json() == {"aborted": [rid]}
        for response, lines in streams:
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]" and '"abort"' in "".join(rest), rest[-3:]
            response.__exit__(None, None, None)
        info = _wait_idle(server)
        assert all(r["pool"]["request_owned"] == 0 for r in info["replicas"])
        assert server.post("/flush_cache").status_code == 200
        assert all(r["pool"]["evictable"] == 0 for r in server.info()["replicas"])
        metrics = server.get("/metrics").text
        assert "num_running_reqs 0" in metrics.replace(".0", "") and "aborted_requests_total" in metrics
    finally:
        assert server.stop() == 0


def test_an_expert_parallel_moe_server_gives_the_single_device_tokens_and_leaks_nothing():
    rng = random.Random(2)
    work = [[rng.randrange(256) for _ in range(rng.randrange(1, 60))] for _ in range(8)]
    engine = Engine(model_path="tiny-qwen3-moe", load_format="dummy", max_total_tokens=4096, device="cpu")
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    expected = [o["output_ids"] for o in engine.generate(input_ids=work, sampling_params=params)]
    moe = ("--model-path", "tiny-qwen3-moe", "--load-format", "dummy", "--max-total-tokens", "4096")
    server = start_server(*moe, "--tp-size", "2", "--ep-size", "2")
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: _generate(server, work[i], 12, f"m{i}"), range(len(work))))
        assert [o["output_ids"] for o in outs] == expected  # each rank holds 8 of the 16 experts
        _wait_idle(server)
    finally:
        assert server.stop() == 0
