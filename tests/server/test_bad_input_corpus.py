"""A corpus of bad requests against a real server on the embedded model: every one gets a 4xx in
OpenAI's error shape, none a 5xx or a hang, and afterwards the server is idle (no request running
or waiting, the KV pool free or evictable) and answers a greedy request as it did before."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from server_process import MODEL, wait_idle

from labkit.server.process import start_server

pytestmark = pytest.mark.slow  # a real server on the embedded model

KEY = "sk-corpus"
S = "\ud800"  # a lone surrogate
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
GENERATE = {"text": "Hi", "sampling_params": {"max_new_tokens": 4}}
GREEDY = {
    **CHAT,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 12,
    "temperature": 0,
}

INT_BAD = ["8", 8.5, True, [], {}, 2**64, -(2**63) - 1, 10**30]
FLOAT_BAD = ["0.5", True, [], {}, 1e308, -1e308]
BOOL_BAD = ["yes", "true", 1, 0, [], {}]
STR_BAD = [5, True, [], {}, S]
# The protocol's fields by type, with values out of their range.
SAMPLING_FIELDS = {
    "max_tokens": (INT_BAD, [0, -1]),
    "n": (INT_BAD, [0, 17]),
    "seed": (INT_BAD[:5] + [2**63], []),
    "top_k": (INT_BAD, [0, -2]),
    "min_tokens": (INT_BAD, [-1, 5]),  # 5 > max_tokens
    "temperature": (FLOAT_BAD, [-0.1, 2.5]),
    "top_p": (FLOAT_BAD, [0, 1.5, -1]),
    "frequency_penalty": (FLOAT_BAD, [-2.5, 3]),
    "presence_penalty": (FLOAT_BAD, [-2.5, 3]),
    "min_p": (FLOAT_BAD, [-0.1, 1.5]),
    "repetition_penalty": (FLOAT_BAD, [0, 2.5, 1e-300]),
    "stream": (BOOL_BAD, []),
    "ignore_eos": (BOOL_BAD, []),
    "skip_special_tokens": (BOOL_BAD, []),
    "stop": ([5, [5], [S], S, True], [[""], ""]),
    "stop_token_ids": ([5, ["1"], [True], [2**64]], [[-1], [10**9]]),
    "user": (STR_BAD, []),
    "model": (STR_BAD, []),
    "stream_options": (["yes", [], {"include_usage": "yes"}, {"other": True}], []),
}
BAD_MESSAGES = [
    [],
    "Hi",
    [{"content": "Hi"}],
    [{"role": "user"}],
    [{"role": "wizard", "content": "Hi"}],
    [{"role": "user", "content": S}],
    [{"role": "user", "content": [{"type": "image", "url": "x"}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [5],
    [None],
]
BAD_CHAT_FIELDS = [
    ("max_completion_tokens", 0),
    ("max_completion_tokens", "4"),
    ("max_completion_tokens", 2**64),
    ("logprobs", "yes"),
    ("top_logprobs", 21),
    ("top_logprobs", -1),
    ("top_logprobs", "1"),
]
BAD_PROMPTS = [[], [[]], [True], [1, "a"], [[1], "a"], [1, 10**9], [-1], [2**64], S, ["a", S], None, 5, {}]
BAD_GENERATE = [
    {},
    {"text": "Hi", "input_ids": [1]},
    {"text": 5},
    {"text": S},
    {"input_ids": []},
    {"input_ids": [-1]},
    {"input_ids": [10**9]},
    {"input_ids": [2**64]},
    {"input_ids": "1"},
    {"input_ids": [True]},
    {"input_ids": [1, 2, False]},
    {"input_ids": [1, 2.0]},
    {"input_ids": [1, None]},
    {"text": "Hi", "rid": 5},
    {"text": "Hi", "rid": S},
    {"text": "Hi", "stream": "yes"},
    {"text": "Hi", "frobnicate": 1},
    {"text": "Hi", "sampling_params": "x"},
]
BAD_GENERATE_PARAMS = [
    {"nonsense": 1},
    {"max_new_tokens": "x"},
    {"max_new_tokens": 0},
    {"max_new_tokens": 2**64},
    {"seed": 2**64},
    {"temperature": -1},
    {"temperature": 10**400},
    {"top_p": 0},
    {"top_k": 0},
    {"repetition_penalty": 1e308},
    {"stop": [S]},
    {"ignore_eos": 1},
    {"stop_token_ids": [10**9]},
    {"top_logprobs_num": 50},
    {"min_new_tokens": 10, "max_new_tokens": 4},
]
WRONG_METHODS = [
    ("PUT", "/flush_cache"),
    ("DELETE", "/flush_cache"),
    ("GET", "/abort_request"),
    ("GET", "/v1/chat/completions"),
    ("PUT", "/v1/completions"),
    ("GET", "/generate"),
    ("POST", "/v1/models"),
    ("POST", "/nowhere"),
]


def cases() -> Iterator[tuple[str, str, dict]]:
    """(name, path, httpx.request keywords) of each bad request."""
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        for field, (wrong_types, out_of_range) in SAMPLING_FIELDS.items():
            for value in wrong_types + out_of_range:
                yield f"{path} {field}={value!r:.30}", path, {"json": {**base, field: value}}
        for field in ("model", next(k for k in ("messages", "prompt") if k in base)):
            yield f"{path} without {field}", path, {"json": {k: v for k, v in base.items() if k != field}}
        yield f"{path} unknown field", path, {"json": {**base, "frobnicate": 1}}
        yield f"{path} unknown field with a surrogate", path, {"json": {**base, S: 1}}
        yield f"{path} unknown model", path, {"json": {**base, "model": "gpt-9"}}
        yield from _not_json(path)
    chat = "/v1/chat/completions"
    for messages in BAD_MESSAGES:
        yield f"chat messages={messages!r:.40}", chat, {"json": {**CHAT, "messages": messages}}
    for field, value in BAD_CHAT_FIELDS:
        yield f"chat {field}={value!r}", chat, {"json": {**CHAT, field: value}}
    yield "chat prompt too long", chat, {"json": {**CHAT, "messages": [{"role": "user", "content": "hi " * 9000}]}}
    completions = "/v1/completions"
    for prompt in BAD_PROMPTS:
        yield f"completion prompt={prompt!r:.30}", completions, {"json": {**COMPLETION, "prompt": prompt}}
    for field, value in (("logprobs", 6), ("logprobs", -1), ("logprobs", True), ("echo", "yes"), ("max_tokens", 0)):
        yield f"completion {field}={value!r}", completions, {"json": {**COMPLETION, field: value}}
    generate = "/generate"
    for body in BAD_GENERATE:
        yield f"generate {body!r:.40}", generate, {"json": body}
    for params in BAD_GENERATE_PARAMS:
        yield f"generate sampling_params={params!r:.40}", generate, {"json": {**GENERATE, "sampling_params": params}}
    yield from _not_json(generate)
    abort = "/abort_request"
    for body in ({}, {"rid": 5}, {"rid": None}, {"rid": ["a"]}, {"rid": S}, {"rid": "a", "extra": 1}, [], "a"):
        yield f"abort {body!r}", abort, {"json": body}
    yield from _not_json(abort)
    for method, path in WRONG_METHODS:
        yield f"{method} {path}", path, {"method": method}
    for path in (chat, completions, generate, abort, "/flush_cache", "/get_server_info"):
        for auth in (None, "Bearer wrong", KEY, f"Basic {KEY}"):
            yield f"{path} with Authorization {auth}", path, {"json": {}, "auth": auth}


def _not_json(path: str) -> Iterator[tuple[str, str, dict]]:
    """Bodies that are not a JSON object, or not JSON at all, and wrong content types."""
    for raw in (b"", b"{not json", b"[]", b"null", b"1", b'"text"', b'{"model": ', b"\xff\xfe\x00", b"{}" * 2):
        yield f"{path} body {raw!r}", path, {"content": raw, "headers": {"content-type": "application/json"}}
    body = json.dumps(COMPLETION).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        yield f"{path} as {content_type}", path, {"content": body, "headers": {"content-type": content_type}}


@pytest.fixture(scope="module")
def server():
    s = start_server("--log-level", "warning", api_key=KEY)
    yield s
    assert s.stop() == 0


def test_every_bad_request_gets_a_4xx_in_openai_shape_and_leaves_the_server_as_it_was(server):
    corpus = list(cases())
    assert len(corpus) > 300
    before = server.post("/v1/chat/completions", GREEDY).json()["choices"][0]["message"]["content"]
    failures = []
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for name, path, kw in corpus:
            method = kw.pop("method", "POST")
            auth = kw.pop("auth", f"Bearer {KEY}")
            headers = {**kw.pop("headers", {}), **({"Authorization": auth} if auth else {})}
            if "json" in kw:  # json.dumps escapes lone surrogates (httpx would refuse to encode them)
                kw = {"content": json.dumps(kw["json"]).encode()}
                headers = {"content-type": "application/json", **headers}
            try:
                r = client.request(method, path, headers=headers, **kw)
                err = r.json()["error"]
                if not 400 <= r.status_code < 500 or set(err) != {"message", "type", "param", "code"}:
                    failures.append(f"{name}: {r.status_code} {r.text[:200]}")
                elif not (isinstance(err["message"], str) and err["message"] and err["type"] and err["code"]):
                    failures.append(f"{name}: empty error fields {err}")
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                failures.append(f"{name}: {type(e).__name__} {e}")
    assert not failures, f"{len(failures)} of {len(corpus)} cases:\n" + "\n".join(failures)
    wait_idle(server)
    after = server.post("/v1/chat/completions", GREEDY).json()["choices"][0]["message"]["content"]
    assert after == before
