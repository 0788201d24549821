"""OpenAI function tools on /v1/chat/completions: the tools in the prompt, the grammar that forces a
call, and the calls read back out of a choice's text.

- Prompt: a chat template that refers to `tools` gets them (and the history's `tool_calls`) as
  transformers passes them; any other template (the embedded SmolLM2's ignores both) gets a system
  text describing the functions, and each earlier call written into its assistant message as the
  JSON object that text asks for.
- tool_choice "required": the output is a JSON schema's `{"name": ..., "arguments": {...}}`, an
  `anyOf` with one branch per function (its name a `const`, its arguments its `parameters`); a named
  function: the output is its arguments object, under its `parameters`.
- Reading (tool_choice "auto", and "required"): the whole output as one such object (`"parameters"`
  may stand for `"arguments"`), optionally in a ```json fence; or one or more
  `<tool_call>{...}</tool_call>` blocks (Qwen / Hermes), the text around them being the content.
  Anything else, an unknown function name, or arguments that are not a JSON object: plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from labkit.constrained import NO_GRAMMAR_BACKEND, GrammarSpec, get_grammar_backend

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
_CALL_KEYS = ({"name", "arguments"}, {"name", "parameters"})
# A template that mentions `tools` renders them itself (Qwen2.5, Qwen3, Llama 3.1 do).
_TEMPLATE_TAKES_TOOLS = re.compile(r"\btools\b")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolOutput:
    """A choice's text read as calls: `content` is the text outside them (None when there is none)."""

    content: str | None
    calls: list[ToolCall]

    def message(self) -> dict[str, Any]:
        return {"content": self.content, "tool_calls": [c.to_openai() for c in self.calls]}

    def delta(self) -> dict[str, Any]:
        """The whole message as one streamed delta (each call with its `index`, as OpenAI streams them)."""
        calls = [{"index": i, **c.to_openai()} for i, c in enumerate(self.calls)]
        return {"content": self.content, "tool_calls": calls}


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and what tool_choice asks of them (tool_choice "none" has no ToolSpec)."""

    functions: list[dict[str, Any]]  # OpenAI function definitions: name, description?, parameters
    required: bool = False  # tool_choice "required": a call of one of them is forced
    forced: str | None = None  # tool_choice names a function: its call is forced

    def check(self, grammar_backend: str) -> None:
        """ValueError naming the function whose parameters the grammar backend refuses, so a schema
        is refused whatever tool_choice says; with structured output off nothing is enforced (a
        forced call is refused as any grammar is)."""
        if grammar_backend == NO_GRAMMAR_BACKEND:
            return
        backend = get_grammar_backend(grammar_backend)
        for f in self.functions:
            try:
                backend.check(GrammarSpec("json_schema", json.dumps(parameters(f))))
            except ValueError as e:
                raise ValueError(f"tools: function {f['name']!r} parameters: {e}") from None

    def call_schema(self) -> dict[str, Any]:
        """The JSON schema of one call of any of the functions: {"name": ..., "arguments": {...}}."""
        branches = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": parameters(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        return {"anyOf": branches}

    def grammar(self) -> dict[str, str]:
        """The sampling parameter that forces a call ("required" or a named function), else none."""
        if self.forced is not None:
            function = next(f for f in self.functions if f["name"] == self.forced)
            return {"json_schema": json.dumps(parameters(function))}
        if self.required:
            return {"json_schema": json.dumps(self.call_schema())}
        return {}

    def read(self, text: str) -> ToolOutput | None:
        """The calls in a complete output, or None when it is plain content."""
        if self.forced is not None:  # the output is the arguments object itself
            return ToolOutput(None, [ToolCall(self.forced, text)]) if isinstance(_json(text), dict) else None
        blocks = _TAGGED.findall(text)
        if blocks:
            content = _TAGGED.sub("", text).strip() or None
        else:
            fenced = _FENCED.fullmatch(text.strip())
            blocks, content = [fenced.group(1) if fenced else text], None
        calls = [self._call(block) for block in blocks]
        if any(c is None for c in calls):
            return None
        return ToolOutput(content, [c for c in calls if c is not None])

    def _call(self, text: str) -> ToolCall | None:
        obj = _json(text)
        if not isinstance(obj, dict) or set(obj) not in _CALL_KEYS:
            return None
        args = obj.get("arguments", obj.get("parameters"))
        if obj["name"] not in {f["name"] for f in self.functions} or not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def system_text(self) -> str:
        """The functions described for a template that ignores `tools`: same text for the same tools."""
        lines = [
            "You can call these functions. To call one, answer with only a JSON object "
            '{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}.',
            *(json.dumps(f, ensure_ascii=False) for f in self.functions),
        ]
        return "\n".join(lines)


def parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema; none given means no arguments (as OpenAI reads it)."""
    return function.get("parameters") or NO_ARGUMENTS


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def template_takes_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and _TEMPLATE_TAKES_TOOLS.search(template) is not None


def chat_prompt(messages: list[dict[str, Any]], spec: ToolSpec | None, tokenizer: Any) -> dict[str, Any]:
    """GenerateReqInput keywords for a chat: `messages` (ChatMessage.to_template's, calls' arguments
    as dicts) and the tools, in the form the model's chat template takes them."""
    if template_takes_tools(tokenizer):
        tools = [{"type": "function", "function": f} for f in spec.functions] if spec is not None else None
        return {"messages": messages, "tools": tools}
    rendered = [_calls_as_text(m) for m in messages]
    if spec is not None:
        if rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + spec.system_text()}
        else:
            rendered.insert(0, {"role": "system", "content": spec.system_text()})
    return {"messages": rendered}


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's calls appended to its content, one JSON object a line, as the system
    text asks the model to write them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = [
        json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
        for c in calls
    ]
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": "\n".join(filter(None, [message["content"], *text]))}
