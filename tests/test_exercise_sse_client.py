"""Notebook 06's Build-it: check_reassemble passes the given streaming client and rejects clients
that misread the server's Server-Sent Events. The streams are recorded from the real app in this
process (the tiny random-weight model with the embedded tokenizer) for the notebook's own requests,
each answered whole and streamed on an emptied radix cache, as the notebook's `record` does, but
sampled: random tokens, multi-byte characters cut by max_tokens among them."""

from __future__ import annotations

import json

import pytest

from tests.notebook_cells import run_cells


@pytest.fixture(scope="module")
def notebook():
    names = {"json": json, "httpx": None, "server": None, "MODEL": None}  # `record` (the live server's) is not run
    return run_cells("06_serving", "build-sse-answer", "build-sse-check", **names)


@pytest.fixture(scope="module")
def recordings(notebook, run_tiny_server):
    async def record_all(server, client):
        async def post(path, body=None):
            response = await server.serve(server.client.post(path, json=body))
            response.raise_for_status()
            return response

        out = []
        for ask in notebook["ASKS"]:
            # Sampled (seeded, so both runs agree): the random model's greedy text is one token repeated.
            body = {"model": server.model_name, "temperature": 1.0, "seed": 1, **ask}
            await post("/flush_cache")
            whole = (await post("/v1/chat/completions", body)).json()
            texts = [c["message"]["content"] for c in sorted(whole["choices"], key=lambda c: c["index"])]
            await post("/flush_cache")
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            out.append((texts, (await post("/v1/chat/completions", stream)).text))
        return out

    recorded = run_tiny_server(record_all)
    assert any(len(texts) == 2 for texts, _ in recorded)  # n=2: the choices' events interleave
    return recorded


def test_the_notebooks_client_passes(notebook, recordings, capsys):
    notebook["check_reassemble"](notebook["reassemble"], recordings)
    assert "every choice reassembled" in capsys.readouterr().out


def _events(sse):
    """The JSON events of a stream, up to [DONE]."""
    for line in sse.splitlines():
        if line.startswith("data: "):
            if line == "data: [DONE]":
                return
            yield json.loads(line.removeprefix("data: "))


def ignores_the_index(sse):
    return ["".join(c["delta"].get("content") or "" for e in _events(sse) for c in e["choices"])]


def strips_each_piece(sse):
    texts: dict[int, str] = {}
    for e in _events(sse):
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "").strip()
    return [texts[i] for i in sorted(texts)]


def expects_a_choice_in_every_event(sse):
    texts: dict[int, str] = {}
    for e in _events(sse):
        c = e["choices"][0]  # the usage event has none
        texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    return [texts[i] for i in sorted(texts)]


def parses_done_as_json(sse):
    texts: dict[int, str] = {}
    for line in sse.splitlines():
        if line.startswith("data: "):
            for c in json.loads(line.removeprefix("data: "))["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    return [texts[i] for i in sorted(texts)]


def stops_at_the_first_finish(sse):
    texts: dict[int, str] = {}
    for e in _events(sse):
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        if any(c["finish_reason"] for c in e["choices"]):
            break
    return [texts[i] for i in sorted(texts)]


def drops_the_first_piece(sse):
    texts: dict[int, list[str]] = {}
    for e in _events(sse):
        for c in e["choices"]:
            if "content" in c["delta"] and "role" not in c["delta"]:
                texts.setdefault(c["index"], []).append(c["delta"]["content"])
    return ["".join(texts[i][1:]) for i in sorted(texts)]


def returns_a_dict(sse):
    return dict(enumerate(strips_each_piece(sse)))


@pytest.mark.parametrize(
    ("wrong", "complaint"),
    [
        (ignores_the_index, "1 texts for its 2 choices"),
        (strips_each_piece, "from character"),
        (expects_a_choice_in_every_event, "raised IndexError"),
        (parses_done_as_json, "raised JSONDecodeError"),
        (stops_at_the_first_finish, "choice 1: from character"),
        (drops_the_first_piece, "request 0, choice 0: from character"),
        (returns_a_dict, "returned a dict"),
    ],
)
def test_check_reassemble_rejects_a_client_that_misreads_the_stream(notebook, recordings, wrong, complaint):
    with pytest.raises(AssertionError, match=complaint):
        notebook["check_reassemble"](wrong, recordings)
