"""The grammar backend interface (structured output, station 8) and its registry.

A backend turns a request's grammar (a JSON schema, a regex or an EBNF grammar; OpenAI's
``json_object`` is the schema ``{"type": "object"}``, as in SGLang) into a matcher for one vocabulary.
The scheduler keeps one matcher per request, advances it with each committed token, and asks it
which tokens may come next; the sampler masks the others out (``labkit.constrained.bitmask``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")  # SamplingParams' field names (SGLang's)
NO_GRAMMAR_BACKEND = "none"  # --grammar-backend none: requests with a grammar are refused
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per backend (least recently used ones go first)


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar: `kind` is one of GRAMMAR_KINDS, `value` its text."""

    kind: str
    value: str


class BaseGrammarObject(ABC):
    """One request's matcher: where its output stands in its grammar.

    An implementation must guarantee: the tokens `fill_vocab_mask` allows are exactly those that
    `accept_token` accepts next; once the grammar is complete the allowed tokens include the
    backend's stop tokens (only them when nothing may follow), and accepting one terminates the
    matcher."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by a committed token. False, with the state unchanged, if the grammar rejects it."""

    @abstractmethod
    def fill_vocab_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row `row` of `bitmask` (``allocate_token_bitmask``'s layout: int32, bit ``j`` of
        word ``i`` set when token ``32 * i + j`` may come next). Not called once terminated."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and a stop token was accepted."""

    @abstractmethod
    def copy(self) -> BaseGrammarObject:
        """A new matcher at the grammar's start, sharing the compiled grammar: each request (each of
        n > 1 choices too) gets its own from the backend's cache."""


class BaseGrammarBackend(ABC):
    """Compiles grammars for one tokenizer and vocabulary, and caches them.

    An implementation must guarantee: `check` raises ValueError, with the backend's reason, for a
    grammar it cannot compile or whose constraints it would not enforce (so every output under an
    accepted grammar matches it), and needs no tokenizer (the server's tokenizer side runs it);
    `compile` raises ValueError for what `check` refuses and never returns a matcher that allows
    no token at its start unless the grammar's language is empty."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self._cache: OrderedDict[GrammarSpec, BaseGrammarObject] = OrderedDict()

    @classmethod
    @abstractmethod
    def check(cls, spec: GrammarSpec) -> None:
        """Raise ValueError if `spec` is invalid or uses what this backend cannot enforce."""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> BaseGrammarObject:
        """A matcher at the start of `spec`'s grammar; ValueError if it does not compile."""

    def new_matcher(self, spec: GrammarSpec) -> BaseGrammarObject:
        """A fresh matcher for one request: compiled once per distinct grammar (cached), then copied."""
        template = self._cache.get(spec)
        if template is None:
            template = self.compile(spec)
            self._cache[spec] = template
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return template.copy()


GRAMMAR_BACKENDS: dict[str, type[BaseGrammarBackend]] = {}
# Each backend needs its own package: it registers itself when first asked for, so importing labkit
# never imports them (xgrammar alone takes about a second).
LAZY_GRAMMAR_BACKENDS = {"xgrammar": "labkit.constrained.xgrammar_backend"}


def grammar_backend_names() -> list[str]:
    """The choices of --grammar-backend."""
    return [NO_GRAMMAR_BACKEND, *sorted(GRAMMAR_BACKENDS.keys() | LAZY_GRAMMAR_BACKENDS.keys())]


def get_grammar_backend(name: str) -> type[BaseGrammarBackend]:
    """The backend class registered as `name`; ValueError for "none", an unknown name, or a backend
    whose package is missing."""
    if name == NO_GRAMMAR_BACKEND:
        raise ValueError("structured output is off (grammar_backend 'none'): json_schema, regex and ebnf are refused")
    if name not in GRAMMAR_BACKENDS and name in LAZY_GRAMMAR_BACKENDS:
        try:
            importlib.import_module(LAZY_GRAMMAR_BACKENDS[name])
        except ImportError as e:
            raise ValueError(f"grammar backend {name!r} needs a package that is missing: {e}") from None
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {grammar_backend_names()}")
    return GRAMMAR_BACKENDS[name]


def register_grammar_backend(name: str) -> Callable[[type[BaseGrammarBackend]], type[BaseGrammarBackend]]:
    def wrap(cls: type[BaseGrammarBackend]) -> type[BaseGrammarBackend]:
        GRAMMAR_BACKENDS[name] = cls
        return cls

    return wrap
