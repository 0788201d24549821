"""The real server with two tokenizer workers (--tokenizer-worker-num 2) on the tiny model with the
embedded tokenizer: both share the port and serve, each request's answer is the same whichever
worker takes it, an abort or /metrics asked of one worker covers the other's requests, nothing
leaks, and a worker that dies takes the server down."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_process import wait_idle

from labkit.server.metrics import parse_metrics
from labkit.server.process import ServerProcess, start_server

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def server_args(tiny_vocab_config, embedded_dir) -> list[str]:
    """The tiny model with the embedded tokenizer."""
    return [
        "--model-path", tiny_vocab_config, "--load-format", "dummy", "--tokenizer-path", str(embedded_dir),
        "--max-total-tokens", "8192", "--served-model-name", "tiny", "--log-level", "warning",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def server(server_args):
    s = start_server(*server_args, "--tokenizer-worker-num", "2", "--enable-metrics")
    yield s
    assert s.stop() == 0


def client_on_worker(server: ServerProcess, worker: int) -> httpx.Client:
    """A client whose one keep-alive connection the kernel gave to `worker`."""
    for _ in range(64):
        client = httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1))
        if client.get("/get_server_info").json()["tokenizer_worker"] == worker:
            return client
        client.close()
    raise AssertionError(f"64 connections and none went to worker {worker}")


def completion(url: str, prompt: str) -> str:
    """One greedy completion on a connection of its own (so the kernel picks the worker anew)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        r = client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_both_workers_serve_and_every_prompt_gets_one_answer(server):
    # Ready means every worker is: fresh connections, which the kernel spreads over both, all get 200.
    assert [httpx.get(server.url + "/health").status_code for _ in range(16)] == [200] * 16
    info = server.info()
    workers = info["tokenizer_workers"]
    assert [w["worker"] for w in workers] == [0, 1]
    assert workers[0]["pid"] == server.proc.pid and workers[1]["pid"] in server.child_pids()
    before = [w["requests_total"] for w in workers]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(functools.partial(completion, server.url), PROMPTS * 8))
    for i, prompt in enumerate(PROMPTS):  # greedy: the same text whichever worker answered
        assert len({texts[j] for j in range(i, len(texts), len(PROMPTS))}) == 1, prompt
    after = [w["requests_total"] for w in wait_idle(server)["tokenizer_workers"]]
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == 32 and min(served) > 0  # both took some: the odds of not are 2 in 2**32
    samples = {s["name"]: s["value"] for s in parse_metrics(server.get("/metrics").text)}
    assert samples["labkit:requests_total"] == sum(after)  # one scrape, every worker's count


@pytest.mark.parametrize("owner, asked", [(0, 1), (1, 0)])
def test_a_rid_in_flight_on_one_worker_is_refused_and_aborted_by_the_other(server, owner, asked):
    rid = f"long-{owner}"
    body = {"input_ids": [1, 2, 3], "rid": rid, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    mine, other = client_on_worker(server, owner), client_on_worker(server, asked)
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(mine.post("/generate", json=body, timeout=120)))
    try:
        thread.start()
        while other.get("/get_server_info").json()["in_flight"] == 0:  # counted over both workers
            pass
        again = other.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}})
        assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
        assert other.post("/abort_request", json={"rid": rid}).json() == {"aborted": [rid]}
        thread.join(timeout=60)
    finally:
        mine.close()
        other.close()
    assert result[0].json()["meta_info"]["finish_reason"] == "abort"
    wait_idle(server)


def test_ctrl_c_ends_every_workers_streams_with_an_error_event_and_exits_quietly(server_args):
    """Ctrl-C at a terminal reaches every process of its group: the main process shuts down, the
    other worker leaves that to it, and the streams on both end with the error event."""
    server = start_server(*server_args, "--tokenizer-worker-num", "2")
    body = {"input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    clients = [client_on_worker(server, w) for w in (0, 1)]
    ends: list[list[str]] = [[], []]

    def read(w: int, started: threading.Event) -> None:
        with clients[w].stream("POST", "/generate", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    ends[w].append(line[len("data: ") :])
                    started.set()

    started = [threading.Event(), threading.Event()]
    readers = [threading.Thread(target=read, args=(w, started[w])) for w in (0, 1)]
    try:
        for reader, event in zip(readers, started):
            reader.start()
            assert event.wait(60)
        for w in server.info()["tokenizer_workers"]:  # as the terminal sends it: to each process
            os.kill(w["pid"], signal.SIGINT)
        for reader in readers:
            reader.join(timeout=60)
    finally:
        for client in clients:
            client.close()
        code = server.stop()
    for events in ends:
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_unavailable"
    assert code == 0
    printed = "".join(server.output)
    assert "Traceback" not in printed and "CancelledError" not in printed, printed


def test_a_killed_worker_takes_the_server_down(server_args):
    server = start_server(*server_args, "--tokenizer-worker-num", "3")
    try:
        workers = server.info()["tokenizer_workers"]
        assert len({w["pid"] for w in workers}) == 3
        os.kill(workers[2]["pid"], signal.SIGKILL)
        code = server.proc.wait(timeout=30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert code == 1
    assert "the http-2 process died" in "".join(server.output)
    server.stop()  # raises if a child outlived it
