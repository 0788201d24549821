"""Structured output through the Engine on a tiny random-weight model with the embedded tokenizer:
random logits, so the grammar mask alone makes the output well-formed. Every output must parse and
validate, finish on the grammar's stop token, and leave no memory behind."""

from __future__ import annotations

import json

import pytest
from grammar_helpers import assert_full_match, assert_idle, assert_valid_json

from labkit import Engine

SHORT = {"type": "string", "maxLength": 6}
SCHEMAS: dict[str, dict | bool] = {
    "flat object": {
        "type": "object",
        "properties": {
            "name": SHORT,
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
    },
    "nested with optional": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "nick": SHORT},
                "required": ["id"],
            },
            "note": {"type": "null"},
        },
        "required": ["user"],
    },
    "array minItems maxItems": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum and const": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", 3, None]}, "v": {"const": "x"}},
        "required": ["color", "v"],
    },
    "string pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
    },
    "number range": {"type": "number", "minimum": -1.5, "maximum": 2.25},
    "anyOf": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        ]
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/point"},
        "minItems": 1,
        "maxItems": 3,
    },
    "type list": {"type": ["boolean", "null"]},
    "tuple": {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": ["a", "b"]}], "items": False},
    "bounded string only": {"type": "string", "minLength": 1, "maxLength": 3},
    "additionalProperties false": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_under_a_json_schema_validates(engine, name):
    schema = SCHEMAS[name]
    params = [
        {"json_schema": json.dumps(schema), "max_new_tokens": 200, "temperature": t, "seed": s}
        for t, s in ((0, None), (1.0, 1), (1.0, 2), (1.0, 3))
    ]
    for out in engine.generate(["Hello", "JSON please:", "x", "{"], params):
        assert_valid_json(out, schema)
    assert_idle(engine)


@pytest.mark.parametrize(
    "regex",
    [
        r"[a-z]{3}-\d{2}",
        r"(yes|no|maybe)",
        r"\d{1,3}(\.\d{1,2})?",
        r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
        r"0x[0-9a-f]{4}",
    ],
)
def test_every_output_under_a_regex_matches_it_fully(engine, regex):
    outs = engine.generate(
        ["a", "b", "c"], [{"regex": regex, "max_new_tokens": 64, "temperature": t, "seed": 5} for t in (0, 1.0, 1.5)]
    )
    for out in outs:
        assert_full_match(out, regex)
    assert_idle(engine)


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


EBNF = {
    "list": ('root ::= item ("," item)*\nitem ::= "a" | "b" [0-9]', r"(a|b[0-9])(,(a|b[0-9]))*"),
    # Bounded: greedy decoding on random logits would open parentheses for ever.
    "arithmetic": (
        'root ::= term (op term){0,3}\nterm ::= [1-9] | "(" [1-9] (op [1-9]){0,2} ")"\nop ::= "+" | "-"',
        r"[0-9+\-()]+",
    ),
}


@pytest.mark.parametrize("name", EBNF)
def test_every_output_under_an_ebnf_grammar_is_in_its_language(engine, name):
    grammar, regex = EBNF[name]
    outs = engine.generate(
        ["a", "b", "c"], [{"ebnf": grammar, "max_new_tokens": 128, "temperature": t, "seed": 9} for t in (0, 1.0, 0.7)]
    )
    for out in outs:
        assert_full_match(out, regex)
        assert _balanced(out["text"])
    assert_idle(engine)


def test_a_mixed_batch_leaves_the_unconstrained_outputs_unchanged(engine):
    plain = [{"max_new_tokens": 24, "temperature": 0}, {"max_new_tokens": 24, "temperature": 1.0, "seed": 11}]
    alone = engine.generate(["Once upon", "The sky"], plain)
    constrained = [
        {"json_schema": json.dumps(SCHEMAS["flat object"]), "max_new_tokens": 64, "temperature": 1.0, "seed": 3},
        {"regex": "[0-9]{40}", "max_new_tokens": 64},
    ]
    mixed = engine.generate(["Once upon", "The sky", "Hello", "Hi"], plain + constrained)
    assert [o["output_ids"] for o in mixed[:2]] == [o["output_ids"] for o in alone]
    assert_valid_json(mixed[2], SCHEMAS["flat object"])
    assert_full_match(mixed[3], "[0-9]{40}")
    assert_idle(engine)


def test_a_grammar_not_finished_within_max_new_tokens_ends_with_length(engine):
    out = engine.generate("x", {"json_schema": json.dumps(SCHEMAS["nested with optional"]), "max_new_tokens": 3})
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["completion_tokens"] == 3
    endless = engine.generate("x", {"ebnf": 'root ::= "a" root', "max_new_tokens": 5})
    assert endless["meta_info"]["finish_reason"]["type"] == "length"
    assert set(endless["text"]) == {"a"}
    assert_idle(engine)


def test_a_grammar_that_allows_nothing_ends_the_request_instead_of_sampling_garbage(engine):
    out = engine.generate("x", {"ebnf": r"root ::= [^\x00-\U0010FFFF]", "max_new_tokens": 8})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] is None and "grammar" in reason["message"]
    assert out["output_ids"] == sorted(engine.model_runner.eos_token_ids)[:1]  # the stop token the mask gave it
    assert_idle(engine)


def test_the_grammar_ends_the_request_even_with_ignore_eos(engine):
    out = engine.generate("x", {"regex": "(yes|no)", "ignore_eos": True, "max_new_tokens": 16, "temperature": 0})
    assert_full_match(out, "(yes|no)")
    assert out["meta_info"]["finish_reason"]["matched"] in engine.model_runner.eos_token_ids  # as SGLang
    assert_idle(engine)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"json_schema": '{"type": "object",'}, "json_schema is not valid JSON"),
        ({"json_schema": '{"type": "nonsense"}'}, "invalid json_schema: .*nonsense"),
        ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "uniqueItems"),
        ({"json_schema": '{"type": "object", "required": ["a"]}'}, "not declared"),
        ({"json_schema": '{"type": "string", "pattern": "^a+$", "maxLength": 3}'}, "maxLength"),
        ({"regex": "(ab"}, "invalid regex: .*parenthesis"),
        ({"ebnf": "root ::= undefined_rule"}, 'invalid ebnf: .*"undefined_rule" is not defined'),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
        ({"json_schema": {"type": "object"}}, "json_schema must be a non-empty string"),
        ({"regex": "a", "min_new_tokens": 2}, "min_new_tokens"),
    ],
)
def test_bad_grammars_raise_value_error_with_the_backend_s_reason(engine, params, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(["ok", "x"], [{"max_new_tokens": 2}, params])  # all or nothing
    assert_idle(engine)


LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99}, "minItems": 8, "maxItems": 8}
LONG_RUNS = [
    {"json_schema": json.dumps(LONG_ARRAY), "max_new_tokens": 60, "temperature": 1.0, "seed": 4},
    {"regex": "[0-9]{30}", "max_new_tokens": 40, "temperature": 1.0, "seed": 5},
]


def test_retracted_requests_keep_their_matchers_in_step(tiny_engine_kwargs):
    engine = Engine(**{**tiny_engine_kwargs, "max_total_tokens": 160, "schedule_conservativeness": 0.2})
    prompts = [[7 + i] * 20 for i in range(6)]
    outs = engine.generate(input_ids=prompts, sampling_params=LONG_RUNS * 3)
    assert sum(o["meta_info"]["retractions"] for o in outs) > 0
    for out in outs[::2]:
        assert_valid_json(out, LONG_ARRAY)
    for out in outs[1::2]:
        assert_full_match(out, "[0-9]{30}")
    assert_idle(engine)


def test_tensor_parallel_ranks_build_the_same_matchers(tiny_engine_kwargs, engine):
    prompts = [[7 + i] * 5 for i in range(4)]
    expected = engine.generate(input_ids=prompts, sampling_params=LONG_RUNS * 2)
    with Engine(**tiny_engine_kwargs, tp_size=2) as tp:
        got = tp.generate(input_ids=prompts, sampling_params=LONG_RUNS * 2)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]


def test_overlap_scheduling_gives_the_same_outputs(tiny_engine_kwargs, engine):
    params = [
        {"json_schema": json.dumps(SCHEMAS["flat object"]), "max_new_tokens": 64, "temperature": 1.0, "seed": 8},
        {"max_new_tokens": 16, "temperature": 0},
        {"regex": r"\d{5}", "max_new_tokens": 16, "temperature": 1.0, "seed": 2},
    ]
    expected = engine.generate(["a", "b", "c"], params)
    overlapped = Engine(**tiny_engine_kwargs, overlap_schedule_on_cpu=True)
    assert overlapped.scheduler.overlap
    assert [o["output_ids"] for o in overlapped.generate(["a", "b", "c"], params)] == [
        o["output_ids"] for o in expected
    ]
    assert_idle(overlapped)


def test_requests_with_one_grammar_share_its_compilation(engine):
    schema = json.dumps({"type": "array", "items": {"type": "boolean"}, "maxItems": 2})
    before = len(engine.scheduler.grammar_backend._cache) if engine.scheduler.grammar_backend else 0
    outs = engine.generate(["a"] * 3, [{"json_schema": schema, "temperature": 1.0, "seed": s} for s in range(3)])
    assert len(engine.scheduler.grammar_backend._cache) == before + 1
    for out in outs:
        assert_valid_json(out, json.loads(schema))


def test_grammars_need_a_tokenizer_and_a_backend(tiny_engine_kwargs):
    off = Engine(**tiny_engine_kwargs, grammar_backend="none")
    with pytest.raises(ValueError, match="structured output is off"):
        off.generate("x", {"regex": "a"})
    assert off.generate("x", {"max_new_tokens": 2, "ignore_eos": True})["meta_info"]["completion_tokens"] == 2
    bare = Engine(model_path="tiny-llama", load_format="dummy", max_total_tokens=1024)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.generate(input_ids=[1, 2], sampling_params={"regex": "a"})
    assert_idle(bare)
