"""What a program runs on: the `Backend` interface, and `EngineBackend`, an in-process labkit Engine."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any

from labkit.lang.chat_template import ChatTemplate

TokenLogprob = tuple[float | None, int]  # (logprob, token id); None for a prompt's first token


class Backend(ABC):
    """A backend provides two things, and may be called from several threads at once (`run_batch`):

    - `generate(prompt, sampling_params)`: one request for a text prompt with labkit's (SGLang's)
      sampling parameters, `return_logprob` and `logprob_start_len` among them (`max_new_tokens` 0
      with them only scores the prompt). It returns `/generate`'s shape, `{"text": ..., "meta_info":
      {...}}`, with `prompt_tokens`, `cached_tokens` and, when asked for, `input_token_logprobs` as
      `(logprob, token_id)` pairs;
    - `chat_template()`: the model's role blocks, for `system` / `user` / `assistant`.

    `cache_prefix(text)` (what `fork` sends) and `score(prefix, choices)` (what `select` asks) are
    built here on `generate`; a backend may override them."""

    @abstractmethod
    def generate(self, prompt: str, sampling_params: dict[str, Any]) -> dict[str, Any]: ...

    @abstractmethod
    def chat_template(self) -> ChatTemplate: ...

    def cache_prefix(self, text: str) -> int:
        """Have the backend prefill `text`, which leaves it in the radix cache for the requests that
        continue it; returns its length in tokens. A one-token generation: `max_new_tokens` 0 is
        only for scoring, whose prefill would not be cached."""
        return self.generate(text, {"max_new_tokens": 1, "temperature": 0})["meta_info"]["prompt_tokens"]

    def score(self, prefix: str, choices: list[str]) -> list[list[TokenLogprob]]:
        """The logprobs of each choice's tokens, appended to `prefix`, teacher-forced. Only text
        travels, so the choice's first token is found by comparison: `prefix + choice` is scored from
        the prefix's last token on, and that token counts as the choice's unless it is the prefix's
        own (a choice can merge into it, as "Answer: " + "Paris" ends in " Paris"). A merge reaching
        further back than one token is not detected."""
        n = self.cache_prefix(prefix)  # for the choices to reuse (SGLang's select sends it first too)
        scoring = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": n - 1}
        [(_, last)] = self.generate(prefix, scoring)["meta_info"]["input_token_logprobs"]
        scores = []
        for choice in choices:
            pairs = self.generate(prefix + choice, scoring)["meta_info"]["input_token_logprobs"]
            scores.append(pairs[1:] if pairs[0][1] == last else pairs)
        return scores


class EngineBackend(Backend):
    """A labkit `Engine` in this process. Programs running in several threads (`run_batch`) share
    its batches: each thread queues its request, then steps the engine, under one lock, until its
    request has finished. While programs run, nothing else should step the engine."""

    def __init__(self, engine: Any):
        if engine.tokenizer is None:
            raise ValueError("labkit.lang sends text prompts: the engine needs a tokenizer (tokenizer_path=)")
        self.engine = engine
        self._lock = threading.Lock()
        self._template: ChatTemplate | None = None

    def generate(self, prompt: str, sampling_params: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            rid = self.engine.add_request(prompt, sampling_params=sampling_params)
        while True:
            with self._lock:
                if rid in self.engine.results:
                    out = self.engine.results.pop(rid)
                    return {"text": out["text"], "meta_info": out["meta_info"]}
                self.engine.step()

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_tokenizer(self.engine.tokenizer)
        return self._template
