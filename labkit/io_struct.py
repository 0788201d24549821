"""The messages between the stations (SGLang's names). They are msgspec Structs so that the server
can send them across processes with a schema'd, non-executable encoding (never pickle)."""
from __future__ import annotations

from typing import Any

import msgspec


class GenerateReqInput(msgspec.Struct, kw_only=True):
    """What a client asks for (station 1-2). Exactly one of text, input_ids, messages."""

    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat messages: the model's chat template is applied
    sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)
    stream: bool = False
    rid: str | None = None


class TokenizedGenerateReqInput(msgspec.Struct, kw_only=True):
    """A request after tokenization (station 3), as the scheduler receives it (station 4-5)."""

    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: dict[str, Any]
    stream: bool = False
    created_time: float = 0.0


class AbortReq(msgspec.Struct, kw_only=True):
    rid: str
