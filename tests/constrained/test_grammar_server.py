"""Structured output through the server's real app, TokenizerManager, scheduler and detokenizer (in one
process, labkit.server.inprocess) with the official `openai` client: response_format and SGLang's
extras, and bad grammars answered with a 400 in OpenAI's error shape before anything is queued."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Name a city as JSON."}]


def test_response_format_and_extras_through_the_openai_client(run_tiny_server):
    async def test(server, client):
        model = server.model_name
        by_schema = await server.serve(
            client.chat.completions.create(
                model=model,
                messages=CHAT,
                max_tokens=64,
                n=2,
                seed=3,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
                },
            )
        )
        for choice in by_schema.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        any_object = await server.serve(
            client.completions.create(
                model=model,
                prompt="JSON:",
                max_tokens=48,
                temperature=0,
                extra_body={"response_format": {"type": "json_object"}},  # the client's completions lack it
            )
        )
        assert any_object.choices[0].finish_reason in ("stop", "length")
        assert any_object.choices[0].text.startswith("{")
        by_regex = await server.serve(
            client.completions.create(
                model=model, prompt="Code:", max_tokens=16, extra_body={"regex": "[A-Z]{3}-[0-9]{2}"}, temperature=0
            )
        )
        assert by_regex.choices[0].finish_reason == "stop"
        assert len(by_regex.choices[0].text) == 6 and by_regex.choices[0].text[3] == "-"
        text = await server.serve(
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, response_format={"type": "text"})
        )
        assert text.choices[0].finish_reason == "length"

    run_tiny_server(test)


def test_native_generate_takes_the_grammar_in_its_sampling_params(run_tiny_server):
    async def test(server, client):
        r = await server.serve(
            server.client.post(
                "/generate",
                json={"text": "x", "sampling_params": {"ebnf": 'root ::= "yes" | "no"', "max_new_tokens": 8}},
            )
        )
        assert r.status_code == 200, r.text
        assert r.json()["text"] in ("yes", "no") and r.json()["meta_info"]["finish_reason"] == "stop"

    run_tiny_server(test)


@pytest.mark.parametrize(
    "body, reason",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "nonsense",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "uniqueItems",
        ),
        ({"response_format": {"type": "json_schema"}}, "json_schema is required"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "not both"),
        ({"regex": "(unclosed"}, "parenthesis"),
        ({"ebnf": "root ::= missing"}, "not defined"),
        ({"json_schema": "{not json"}, "not valid JSON"),
    ],
)
def test_bad_grammars_are_a_400_with_the_backend_s_reason(run_tiny_server, body, reason):
    async def test(server, client):
        r = await server.client.post(
            "/v1/chat/completions", json={"model": server.model_name, "messages": CHAT, "max_tokens": 4, **body}
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert reason in err["message"] and err["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError, match=reason):
            await client.chat.completions.create(model=server.model_name, messages=CHAT, max_tokens=4, extra_body=body)
        assert not server.tm.rid_to_state  # nothing was queued

    run_tiny_server(test)
