"""Structured output on the embedded model (free-form strings, which random logits would never end),
and `response_format` against a real `python -m labkit.server` through the openai client."""

from __future__ import annotations

import json

import jsonschema
import pytest
from grammar_helpers import assert_idle, assert_valid_json

from labkit import Engine
from labkit.server.process import start_server

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "email": {"type": ["string", "null"]},
    },
    "required": ["name", "age", "hobbies"],
}
CITIES = {"type": "array", "items": {"enum": ["Paris", "Rome", "Berlin", "Madrid"]}, "minItems": 2, "maxItems": 4}


def test_the_embedded_model_fills_schemas_with_free_form_strings():
    engine = Engine(device="cpu")
    messages = [
        [{"role": "user", "content": "Describe a fictional person as JSON with name, age and hobbies."}],
        [{"role": "user", "content": "List some European capitals."}],
    ]
    outs = engine.generate(
        messages=messages,
        sampling_params=[
            {"json_schema": json.dumps(PERSON), "max_new_tokens": 160, "temperature": 0},
            {"json_schema": json.dumps(CITIES), "max_new_tokens": 64, "temperature": 0.8, "seed": 1},
        ],
    )
    assert_valid_json(outs[0], PERSON)
    assert_valid_json(outs[1], CITIES)
    assert_idle(engine)


def test_response_format_against_a_real_server(tiny_vocab_config, embedded_dir):
    from openai import BadRequestError, OpenAI

    server = start_server(
        "--model-path", tiny_vocab_config, "--load-format", "dummy", "--tokenizer-path", str(embedded_dir)
    )
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "ok?"}],
            max_tokens=32,
            response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema, "strict": True}},
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        with pytest.raises(BadRequestError, match="uniqueItems"):
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "ok?"}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                },
            )
    finally:
        assert server.stop() == 0
