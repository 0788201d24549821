"""`RuntimeEndpoint`: a running labkit server (`python -m labkit.server`) as a backend, over its
native `/generate`, as SGLang's frontend talks to an SGLang server."""

from __future__ import annotations

from typing import Any

import httpx

from labkit.config import EngineConfig
from labkit.lang.backend import Backend
from labkit.lang.chat_template import ChatTemplate

# Sampling parameters /generate takes at the top level of its body (SGLang's shape), not in sampling_params.
_TOP_LEVEL = ("return_logprob", "logprob_start_len", "top_logprobs_num")


class RuntimeEndpoint(Backend):
    """A labkit server at `base_url`. The role blocks come from `chat_template`, else from the
    server's tokenizer, loaded here from the paths the server reports in `/get_server_info` (so on
    the same machine, or one with the same files). A 400 from the server is a ValueError, as the
    Engine's bad-input errors are; other failures a RuntimeError."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        chat_template: ChatTemplate | None = None,
        timeout_s: float = 600.0,
    ):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self._template = chat_template

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            r = self.client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise RuntimeError(f"{path}: no answer from {self.client.base_url}: {e}") from e
        if r.status_code == 200:
            return r.json()
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        error = ValueError if r.status_code == 400 else RuntimeError
        raise error(f"{path} answered {r.status_code}: {message}")

    def generate(self, prompt: str, sampling_params: dict[str, Any]) -> dict[str, Any]:
        params = {k: v for k, v in sampling_params.items() if k not in _TOP_LEVEL}
        top = {k: v for k, v in sampling_params.items() if k in _TOP_LEVEL}
        out = self._request("POST", "/generate", {"text": prompt, "sampling_params": params, **top})
        meta = out["meta_info"]
        if "input_token_logprobs" in meta:  # SGLang's [logprob, token_id, token_text] triples
            meta["input_token_logprobs"] = [(lp, tok) for lp, tok, _ in meta["input_token_logprobs"]]
        return {"text": out["text"], "meta_info": meta}

    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            # Here, not at the top: the loader brings in torch and transformers, which a program
            # without roles never needs.
            from labkit.model_loader.loader import model_dir_and_tokenizer

            args = self._request("GET", "/get_server_info")["server_args"]
            config = EngineConfig(**{k: args[k] for k in ("model_path", "tokenizer_path", "load_format")})
            self._template = ChatTemplate.from_tokenizer(model_dir_and_tokenizer(config)[1])
        return self._template

    def close(self) -> None:
        self.client.close()
