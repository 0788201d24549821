"""Bad input, overload, aborts and disconnects: a JSON error in OpenAI's shape, the server keeps
serving, and every request's KV memory and request slot come back."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_process import MODEL, wait_idle

from labkit.server.process import start_server

pytestmark = pytest.mark.slow  # a real server on the embedded model

KEY = "sk-test-key"
LONG = {
    "max_tokens": 200,
    "ignore_eos": True,
    "temperature": 0,
}  # seconds of decoding on CPU: still running when aborted


@pytest.fixture(scope="module")
def server():
    s = start_server(
        "--enable-metrics",
        "--log-level",
        "warning",
        "--context-length",
        "256",
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "1",
        api_key=KEY,
    )
    yield s
    assert s.stop() == 0


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"] and err["code"]
    return err


def chat(server, **body):
    return server.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body},
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_invalid_parameters_get_400_naming_the_parameter(server, body, param):
    assert error_of(chat(server, **body), 400)["param"] == param
    assert chat(server).status_code == 200  # and the server keeps serving


def test_malformed_json_and_missing_fields_get_400(server):
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={**server.headers(), "content-type": "application/json"},
    )
    assert error_of(bad, 400)["code"] == "invalid_json"
    missing = server.post("/v1/completions", {"model": MODEL})
    assert "prompt" in error_of(missing, 400)["message"]


def test_unknown_model_gets_404_model_not_found(server):
    assert error_of(chat(server, model="gpt-9"), 404)["code"] == "model_not_found"


def test_bad_prompts_get_400(server):
    too_long = server.post("/v1/completions", {"model": MODEL, "prompt": "hello " * 300})
    assert error_of(too_long, 400)["code"] == "context_length_exceeded"
    for prompt in ([1, 2, 10**9], [], [[]]):
        error_of(server.post("/v1/completions", {"model": MODEL, "prompt": prompt}), 400)
    error_of(chat(server, stop_token_ids=[10**9]), 400)
    error_of(server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "x"}}), 400)
    error_of(server.post("/generate", {"text": "hi", "sampling_params": {"nonsense": 1}}), 400)


def test_api_key_is_required_everywhere_but_health(server):
    for path in ("/v1/models", "/get_server_info", "/metrics"):
        assert error_of(httpx.get(server.url + path), 401)["code"] == "invalid_api_key"
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert httpx.get(server.url + "/health", timeout=60).status_code == 200


def _metric(server, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(f"labkit:{name} "):
            return float(line.split()[1])
    raise AssertionError(name)


def test_client_disconnect_mid_stream_aborts_and_frees_memory(server):
    aborted = _metric(server, "aborted_requests_total")
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers=server.headers(),
        timeout=60,
        json={"model": MODEL, "prompt": "Tell me a long story.", "stream": True, **LONG},
    ) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it is running
    start = time.monotonic()
    wait_idle(server, timeout=8)  # well before the 200 tokens could have finished
    assert time.monotonic() - start < 8
    assert _metric(server, "aborted_requests_total") == aborted + 1


def test_client_disconnect_mid_request_aborts_and_frees_memory(server):
    aborted = _metric(server, "aborted_requests_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            headers=server.headers(),
            timeout=1.5,
            json={"model": MODEL, "prompt": "Tell me a long story.", **LONG},
        )
    wait_idle(server, timeout=8)
    assert _metric(server, "aborted_requests_total") == aborted + 1


def _stream_in_background(server, results: list, ids: list) -> threading.Thread:
    def run():
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            headers=server.headers(),
            timeout=60,
            json={"model": MODEL, "messages": [{"role": "user", "content": "Story?"}], "stream": True, **LONG},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    ids.append(chunk["id"])
                    if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                        results.append(chunk["choices"][0]["finish_reason"])

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_abort_request_and_flush_cache_while_running(server):
    results, ids = [], []
    thread = _stream_in_background(server, results, ids)
    _wait_for(lambda: len(ids) >= 2)
    assert error_of(server.post("/flush_cache"), 400)["code"] == "requests_running"
    r = server.post("/abort_request", {"rid": ids[0]})
    assert r.status_code == 200 and len(r.json()["aborted"]) == 1
    thread.join(timeout=30)
    assert results == ["abort"]
    wait_idle(server)
    assert server.post("/flush_cache").status_code == 200
    assert server.info()["pool"]["evictable"] == 0


def test_too_many_queued_requests_get_503_with_retry_after(server):
    results, ids, threads = [], [], []
    for _ in range(3):  # 2 running + 1 queued fill the limits of this server
        threads.append(_stream_in_background(server, results, ids))
    _wait_for(lambda: server.info()["in_flight"] == 3 and len(set(ids)) == 3)
    r = chat(server)
    assert error_of(r, 503)["code"] == "queue_full" and r.headers["retry-after"]
    for rid in set(ids):
        assert server.post("/abort_request", {"rid": rid}).json()["aborted"]
    for t in threads:
        t.join(timeout=60)
    assert results == ["abort"] * 3
    wait_idle(server)
    assert chat(server).status_code == 200
