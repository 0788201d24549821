"""OpenAI function tools on /v1/chat/completions (labkit.server.tool_calls): the reader and the
schema without a model; then the in-process server on the tiny random-weight model (tests/conftest.py)
with the official `openai` client: forced calls valid under their schemas, streamed calls, auto and
none, a multi-turn history with a tool result, and bad input answered with a 400."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from labkit.constrained import GrammarSpec
from labkit.constrained.xgrammar_backend import XGrammarBackend
from labkit.server.tool_calls import ToolSpec, chat_prompt
from labkit.tokenizer.prompt import apply_chat_template

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ALARM = {
    "name": "set_alarm",
    "parameters": {
        "type": "object",
        "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
        "required": ["hour", "loud"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, ALARM)]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, ALARM)}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
AUTO = ToolSpec([WEATHER, ALARM])


# ---- without a model ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
        (' {"name": "set_alarm", "parameters": {"hour": 7}}\n', None, [("set_alarm", {"hour": 7})]),
        ('```json\n{"name": "set_alarm", "arguments": {}}\n```', None, [("set_alarm", {})]),
        ('```\n{"name": "set_alarm", "arguments": {}}```', None, [("set_alarm", {})]),
        (
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "set_alarm", "arguments": {"hour": 6}}</tool_call>',
            "Checking.",
            [("get_weather", {"city": "Oslo"}), ("set_alarm", {"hour": 6})],
        ),
    ],
)
def test_auto_recognizes_a_whole_output_call_and_tagged_calls(text, content, calls):
    read = AUTO.read(text)
    assert read is not None and read.content == content
    assert [(c.name, json.loads(c.arguments)) for c in read.calls] == calls
    assert len({c.id for c in read.calls}) == len(calls) and all(c.id.startswith("call_") for c in read.calls)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '{"name": "delete_everything", "arguments": {}}',  # not a tool
        '{"name": "get_weather", "arguments": "{}"}',  # arguments not an object
        '{"name": "get_weather", "arguments": {}, "extra": 1}',
        '{"name": "get_weather", "arguments": {}',  # cut short
        'Sure: {"name": "get_weather", "arguments": {}}',  # not the whole output
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "x", "arguments": {}}'
        "</tool_call>",  # one block names an unknown tool
    ],
)
def test_anything_else_is_plain_content(text):
    assert AUTO.read(text) is None


def test_a_named_function_s_output_is_its_arguments():
    spec = ToolSpec([WEATHER, ALARM], forced="set_alarm")
    assert json.loads(spec.grammar()["json_schema"]) == ALARM["parameters"]
    [call] = spec.read('{"hour": 5, "loud": true}').calls
    assert call.name == "set_alarm" and call.arguments == '{"hour": 5, "loud": true}'
    assert spec.read('{"hour": 5') is None


def test_required_schema_is_one_call_of_any_tool_and_the_backend_enforces_it():
    spec = ToolSpec([WEATHER, ALARM, {"name": "ping"}], required=True)
    schema = json.loads(spec.grammar()["json_schema"])
    XGrammarBackend.check(GrammarSpec("json_schema", json.dumps(schema)))  # anyOf is enforced
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}, schema)
    jsonschema.validate({"name": "ping", "arguments": {}}, schema)  # no parameters: no arguments
    for bad in (
        {"name": "get_weather", "arguments": {"hour": 1, "loud": True}},
        {"name": "ping", "arguments": {"x": 1}},
        {"name": "other", "arguments": {}},
        {"name": "ping"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert AUTO.grammar() == {}


def test_a_template_without_tools_gets_them_as_system_text(hf_tokenizer):
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {}}}]},
        {"role": "tool", "content": "20 C", "tool_call_id": "call_1"},
    ]
    prompt = chat_prompt(history, AUTO, hf_tokenizer)
    assert prompt == chat_prompt(history, AUTO, hf_tokenizer) and "tools" not in prompt  # deterministic
    system, _, assistant, tool = prompt["messages"]
    assert system["role"] == "system" and all(json.dumps(f) in system["content"] for f in (WEATHER, ALARM))
    assert assistant == {"role": "assistant", "content": '{"name": "get_weather", "arguments": {}}'}
    assert tool == history[2]
    merged = chat_prompt([{"role": "system", "content": "Be brief."}, *history], AUTO, hf_tokenizer)["messages"]
    assert merged[0]["content"].startswith("Be brief.\n\nYou can call") and len(merged) == 4
    assert chat_prompt(history[:1], None, hf_tokenizer) == {"messages": history[:1]}


def test_a_template_that_renders_tools_gets_them(hf_tokenizer):
    tokenizer = copy.deepcopy(hf_tokenizer)
    tokenizer.chat_template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ m.tool_calls | tojson if m.tool_calls }}\n{% endfor %}"
    )
    history = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    prompt = chat_prompt(history, AUTO, tokenizer)
    assert prompt["messages"] == history
    assert apply_chat_template(tokenizer, prompt["messages"], prompt["tools"]).startswith(
        '[get_weather][set_alarm]assistant: [{"function": {"name": "f", "arguments": {}}}]'
    )


# ---- through the server --------------------------------------------------------------------------
def assert_valid_call(choice, names=SCHEMAS) -> None:
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_forced_calls_auto_none_and_a_tool_result_through_the_openai_client(run_tiny_server):
    async def test(server, client):
        def create(**kw):
            body = {"model": server.model_name, "messages": CHAT, "tools": TOOLS, "max_tokens": 48, **kw}
            return server.serve(client.chat.completions.create(**body))

        required = await create(tool_choice="required", n=2, seed=1)
        for choice in required.choices:
            assert_valid_call(choice)
        named = await create(tool_choice={"type": "function", "function": {"name": "set_alarm"}}, temperature=0)
        assert_valid_call(named.choices[0], names=["set_alarm"])

        # auto reads a call out of free text; a regex stands in for a model that writes one.
        call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
        auto = await create(max_tokens=128, extra_body={"regex": call.replace("{", r"\{").replace("}", r"\}")})
        assert_valid_call(auto.choices[0])
        unknown = call.replace("get_weather", "get_news")
        plain = await create(
            tool_choice="auto", max_tokens=128, extra_body={"regex": unknown.replace("{", r"\{").replace("}", r"\}")}
        )
        assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.content == unknown
        assert plain.choices[0].message.tool_calls is None
        cut = await create(max_tokens=3)
        assert cut.choices[0].finish_reason == "length" and isinstance(cut.choices[0].message.content, str)
        none = await create(tool_choice="none", max_tokens=3)
        assert none.choices[0].finish_reason == "length" and none.choices[0].message.tool_calls is None
        assert none.usage.prompt_tokens < cut.usage.prompt_tokens  # "none" leaves the tools out of the prompt

        # The next turn: the assistant's call (the client's own message object) and its result.
        history = [*CHAT, required.choices[0].message, {"role": "tool", "tool_call_id": "x", "content": "20 C"}]
        follow = await create(messages=history, tool_choice="required")
        assert_valid_call(follow.choices[0])
        assert follow.usage.prompt_tokens > required.usage.prompt_tokens

    run_tiny_server(test)


def test_a_streamed_call_accumulates_as_the_client_expects(run_tiny_server):
    async def test(server, client):
        async def stream(**kw):
            state = ChatCompletionStreamState()
            chunks = []
            body = {"model": server.model_name, "messages": CHAT, "tools": TOOLS, "max_tokens": 48, **kw}
            async for chunk in await server.serve(client.chat.completions.create(stream=True, **body)):
                state.handle_chunk(chunk)
                chunks.append(chunk)
            return state, chunks

        state, chunks = await stream(tool_choice="required", seed=2)
        final = state.get_final_completion().choices[0]
        assert_valid_call(final)
        with_calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert len(with_calls) == 1 and with_calls[0].choices[0].delta.tool_calls[0].index == 0
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # The accumulated message goes back as history (the client adds `index`, `parsed_arguments`).
        tool = {"role": "tool", "tool_call_id": final.message.tool_calls[0].id, "content": "20 C"}
        next_turn, _ = await stream(messages=[*CHAT, final.message, tool], tool_choice="required", seed=2)
        assert_valid_call(next_turn.get_final_completion().choices[0])
        state, _ = await stream(max_tokens=3, temperature=0)
        plain = state.current_completion_snapshot  # the final completion refuses to parse a "length" one
        whole = await server.serve(
            client.chat.completions.create(
                model=server.model_name, messages=CHAT, tools=TOOLS, max_tokens=3, temperature=0
            )
        )
        assert plain.choices[0].finish_reason == "length"
        assert plain.choices[0].message.content == whole.choices[0].message.content

    run_tiny_server(test)


BAD = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [*TOOLS, TOOLS[0]]}, "unique"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "type"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            ]
        },
        "'f' parameters",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
                    },
                }
            ]
        },
        "uniqueItems",
    ),
    ({"tools": None, "tool_choice": "required"}, "needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "forced tool call"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [*CHAT, {"role": "tool", "content": "20 C"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "content is required"),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        "only assistant messages",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
                }
            ]
        },
        "JSON object",
    ),
]


def test_bad_tools_are_a_400_before_anything_is_queued(run_tiny_server):
    async def test(server, client):
        for body, reason in BAD:
            full = {"model": server.model_name, "messages": CHAT, "tools": TOOLS, "max_tokens": 4, **body}
            r = await server.client.post("/v1/chat/completions", json=full)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert reason in err["message"] and err["type"] == "invalid_request_error", (body, err)
        with pytest.raises(openai.BadRequestError, match="not in tools"):
            await client.chat.completions.create(
                model=server.model_name,
                messages=CHAT,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            )
        assert not server.tm.rid_to_state

    run_tiny_server(test)
