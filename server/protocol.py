"""OpenAI request bodies (pydantic, so FastAPI parses and type-checks them) and their mapping onto
labkit's sampling parameters. Unknown fields are refused with a 400 rather than silently ignored.

Types are strict, as OpenAI's API is: "8" is not an integer, 1 is not a boolean (an integer is still a
valid float). Integers must fit in 64 bits, and no string may hold a lone surrogate ("\\ud800" is
valid JSON but not Unicode): neither could cross to the scheduler."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from labkit.constrained import GRAMMAR_KINDS
from labkit.sampling.sampling_params import INT64_MAX, INT64_MIN, MAX_TOP_LOGPROBS
from labkit.server.tool_calls import ToolSpec

Int = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]


def only_neutral(is_neutral: Callable[[Any], bool], reason: str) -> AfterValidator:
    """A field clients send with a neutral value (SGLang's and vLLM's benchmark clients do): accepted
    with that value; any other asks for something labkit does not do, a 400 saying so."""

    def check(value: Any) -> Any:
        if not is_neutral(value):
            raise PydanticCustomError("unsupported_value", reason)
        return value

    return AfterValidator(check)


BestOf = Annotated[
    Int | None, only_neutral(lambda v: v in (None, 1), "labkit samples each choice once: best_of must be 1")
]
LoraPath = Annotated[
    str | list[str | None] | None,
    only_neutral(lambda v: not v or v == [None] * len(v), "labkit serves no LoRA adapters: lora_path must be empty"),
]


def _lone_surrogate_at(value: Any) -> tuple[str | int, ...] | None:
    """The path to the first string (or key) in a parsed JSON value that is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return ()
        return None
    if isinstance(value, list) and all(type(x) is int for x in value):  # token ids: hundreds, no strings
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate_at(key) is not None:
            return (key.encode(errors="backslashreplace").decode(),)  # the error names it, so it must encode
        path = _lone_surrogate_at(item)
        if path is not None:
            return (key, *path)
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Body(_Strict):
    """A request body: checked for lone surrogates anywhere (keys too) before anything else."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        path = _lone_surrogate_at(data)
        if path is not None:
            error = PydanticCustomError("invalid_unicode", "the string holds a lone surrogate (not valid Unicode)")
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(type=error, loc=path, input="")])
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class _Echoed(_Strict):
    """Part of a call the client sends back: the `openai` client's accumulated stream adds its own
    fields (`index`, `parsed_arguments`), ignored rather than refused."""

    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Echoed):
    name: str
    arguments: str  # a JSON object's text, as OpenAI returns it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be the text of a JSON object")
        return value


class MessageToolCall(_Echoed):
    """A call an earlier assistant message made (its `id` is what the tool message answers)."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow")  # name ... pass through to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null only beside an assistant's tool_calls
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None  # a tool message's: the call whose result it holds

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention: a call's arguments as a dict)."""
        content = "".join(p.text for p in self.content) if isinstance(self.content, list) else self.content or ""
        message = {**(self.model_extra or {}), "role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Strict):
    # OpenAI's rule for function names; it also keeps them plain in a prompt and a grammar.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the arguments' JSON schema; none: no arguments
    strict: bool | None = None  # a forced call is always held to the schema, so either

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type") != "object":
            raise ValueError('parameters must be a JSON schema of "type": "object" (the arguments are an object)')
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. The schema is always enforced (as SGLang does), so
    `strict` may be either."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and allowed only with it')
        return self

    def grammar(self) -> dict[str, str]:
        """The sampling parameter it maps onto (SGLang's mapping: json_object is any JSON object)."""
        if self.json_schema is not None:
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        return {"json_schema": '{"type": "object"}'} if self.type == "json_object" else {}


class _SamplingRequest(_Body):
    """Fields shared by both endpoints: OpenAI's, then labkit's extras (SGLang names)."""

    model: str
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=16)  # not Int: its bounds would override these
    stop: str | list[str] | None = None
    seed: Int | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    lora_path: LoraPath = None  # sent by SGLang's bench_serving for its vLLM-style LoRA convention
    # labkit extras
    top_k: Int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True
    # Structured output: OpenAI's response_format, or SGLang's extras (labkit.constrained)
    response_format: ResponseFormat | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @model_validator(mode="after")
    def _one_grammar(self) -> _SamplingRequest:
        extras = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if extras and self.response_format is not None and self.response_format.grammar():
            raise ValueError(f"give response_format or {extras[0]}, not both")
        return self

    def sampling_params(self, max_new_tokens: int, index: int) -> dict[str, Any]:
        """labkit SamplingParams for choice `index` (seeded choices differ: seed + index)."""
        return {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "seed": None if self.seed is None else self.seed + index,
            "skip_special_tokens": self.skip_special_tokens,
            **self.grammar_params(),
        }

    def grammar_params(self) -> dict[str, str]:
        """The grammar the body asks for (response_format or an extra), as a sampling parameter."""
        return {
            **{k: getattr(self, k) for k in GRAMMAR_KINDS if getattr(self, k) is not None},
            **(self.response_format.grammar() if self.response_format is not None else {}),
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: "auto"

    @model_validator(mode="after")
    def _valid_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tools: function names must be unique; {repeated} appear more than once")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and self.grammar_params():
            raise ValueError(
                "a forced tool call constrains the output itself: give no response_format, json_schema, regex or "
                "ebnf with it"
            )
        return self

    def tool_spec(self) -> ToolSpec | None:
        """The tools and what tool_choice asks of them; None when they play no part (none given, or
        tool_choice "none", which leaves them out of the prompt too, as SGLang does)."""
        if not self.tools or self.tool_choice == "none":
            return None
        functions = [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolSpec(functions, forced=self.tool_choice.function.name)
        return ToolSpec(functions, required=self.tool_choice == "required")

    def sampling_params(self, max_new_tokens: int, index: int) -> dict[str, Any]:
        spec = self.tool_spec()
        return {
            **super().sampling_params(max_new_tokens, index),
            "return_logprob": self.logprobs,
            "top_logprobs_num": (self.top_logprobs or 0) if self.logprobs else 0,
            **(spec.grammar() if spec is not None else {}),
        }


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(default=None, ge=0)  # 0 only to score the prompt: see below
    logprobs: Int | None = Field(default=None, ge=0, le=5)
    echo: bool = False  # the prompt before the completion; with logprobs, the prompt tokens' first
    best_of: BestOf = None

    @model_validator(mode="after")
    def _zero_tokens_score_the_prompt(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.scores_prompt:
            why = "max_tokens 0 only scores a prompt: it needs echo and logprobs"
            error = PydanticCustomError("zero_max_tokens", why)
            details = [InitErrorDetails(type=error, loc=("max_tokens",), input=0)]
            raise ValidationError.from_exception_data(type(self).__name__, details)
        return self

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs: the prompt tokens' logprobs are computed (logprob_start_len 0)."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[dict[str, Any]]:
        """Each prompt as GenerateReqInput keywords (text or input_ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [{"text": p}]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, str) for x in p):
            return [{"text": x} for x in p]
        if all(isinstance(x, int) for x in p):
            return [{"input_ids": p}]
        return [{"input_ids": x} for x in p]

    def sampling_params(self, max_new_tokens: int, index: int) -> dict[str, Any]:
        return {
            **super().sampling_params(max_new_tokens, index),
            "return_logprob": self.logprobs is not None,
            "top_logprobs_num": self.logprobs or 0,
            "logprob_start_len": 0 if self.scores_prompt else -1,
        }


class GenerateRequest(_Body):
    """labkit's native /generate (SGLang's shape)."""

    text: str | None = None
    input_ids: list[Int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    top_logprobs_num: Int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: Int = -1  # with return_logprob: the prompt's logprobs from this position on
    token_ids_logprob: Annotated[
        list[Int] | None, only_neutral(lambda v: v is None, "logprobs of chosen token ids are not supported")
    ] = None
    lora_path: LoraPath = None
    return_routed_experts: Annotated[
        bool,
        only_neutral(lambda v: not v, "labkit's models have no experts to report: return_routed_experts must be false"),
    ] = False

    def labkit_sampling_params(self) -> dict[str, Any]:
        """sampling_params with the top-level logprob switches (SGLang puts them there) folded in."""
        if not self.return_logprob:
            return self.sampling_params
        return {
            **self.sampling_params,
            "return_logprob": True,
            "top_logprobs_num": self.top_logprobs_num,
            "logprob_start_len": self.logprob_start_len,
        }


class AbortRequest(_Body):
    rid: str
