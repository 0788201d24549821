"""Station 3 (tokenize): a request's prompt, given as text, token ids or chat messages, to token ids.
`tokenize_request` is the station itself, called by the in-process Engine and by the server's
TokenizerManager alike."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from labkit.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from labkit.trace.events import Station

if TYPE_CHECKING:
    from labkit.scheduler.limits import RequestLimits
    from labkit.trace.recorder import Tracer

NO_TOKENIZER = (
    "this server has no tokenizer (dummy weights without tokenizer_path, or skip_tokenizer_init): pass input_ids"
)


def apply_chat_template(tokenizer, messages: Any, tools: list[dict[str, Any]] | None = None) -> str:
    """The model's chat template over `messages` (and `tools`, for a template that renders them),
    ending with the assistant's turn opened."""
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    if tokenizer is None:
        raise ValueError(NO_TOKENIZER)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    extra = {"tools": tools} if tools else {}  # only then: a tokenizer-like object need not know the keyword
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def encode_prompt(
    tokenizer, text: Any = None, input_ids: Any = None, messages: Any = None, tools: list[dict[str, Any]] | None = None
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids) for exactly one of text, input_ids or messages (with `tools`
    for the chat template). Raises ValueError for malformed input."""
    if sum(x is not None for x in (text, input_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt (text), input_ids or messages")
    if input_ids is not None:
        # The ids' distinct types, not every id, go through Python: a long prompt checks in C speed.
        if not isinstance(input_ids, list) or not all(
            issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, input_ids))
        ):
            raise ValueError("input_ids must be a list of ints")
        return None, list(input_ids)
    if tokenizer is None:
        raise ValueError(NO_TOKENIZER)
    if messages is not None:
        text = apply_chat_template(tokenizer, messages, tools)
        # The template already holds the special tokens (BOS and the turn markers).
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]
    if not isinstance(text, str):
        raise ValueError("prompt must be a string")
    return text, tokenizer(text)["input_ids"]


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for: its vocabulary string is at least as
    long (byte-level BPE spells each byte as one character, SentencePiece each character as one)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def _prompt_chars(req: GenerateReqInput) -> int:
    """Characters of a text prompt, or of a chat's message contents (the template only adds)."""
    if isinstance(req.text, str):
        return len(req.text)
    if isinstance(req.messages, list):
        return sum(len(m["content"]) for m in req.messages if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


def tokenize_request(
    tokenizer: Any,
    req: GenerateReqInput,
    rid: str,
    limits: RequestLimits | None = None,
    tracer: Tracer | None = None,
    max_prompt_chars: int | None = None,
) -> TokenizedGenerateReqInput:
    """Encode `req`'s prompt and, with `limits`, check it and its sampling parameters against what
    the scheduler accepts (so that bad input is refused before it travels). A prompt of more than
    `max_prompt_chars` characters cannot fit the context whatever its tokens: it is refused before
    tokenizing. Records the TOKENIZE station. Raises ValueError for bad input."""
    start = time.perf_counter()
    if max_prompt_chars is not None and (chars := _prompt_chars(req)) > max_prompt_chars:
        context = f"; this model's context length is {limits.context_len} tokens" if limits is not None else ""
        raise ValueError(f"the prompt has {chars} characters, more than its tokens could fit{context}")
    text, ids = encode_prompt(tokenizer, req.text, req.input_ids, req.messages, req.tools)
    if limits is not None:
        limits.check(ids, req.sampling_params)
    tokenized = TokenizedGenerateReqInput(
        rid=rid,
        input_text=text,
        input_ids=ids,
        sampling_params=req.sampling_params,
        stream=req.stream,
        received_time=start,
        created_time=time.perf_counter(),
    )
    if tracer is not None:
        tracer.station(rid, Station.TOKENIZE, start, tokenized.created_time, text=text, input_ids=ids)
    return tokenized
