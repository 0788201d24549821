"""OpenAI request bodies (pydantic, so FastAPI parses and type-checks them) and their mapping onto
labkit's sampling parameters. Unknown fields are refused with a 400 rather than silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from labkit.sampling.sampling_params import MAX_TOP_LOGPROBS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ... pass through to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def to_template(self) -> dict[str, Any]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints: OpenAI's, then labkit's extras (SGLang names)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # labkit extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

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
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def sampling_params(self, max_new_tokens: int, index: int) -> dict[str, Any]:
        return {
            **super().sampling_params(max_new_tokens, index),
            "return_logprob": self.logprobs,
            "top_logprobs_num": (self.top_logprobs or 0) if self.logprobs else 0,
        }


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: Literal[False] = False

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
        }


class GenerateRequest(BaseModel):
    """labkit's native /generate (SGLang's shape)."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str
