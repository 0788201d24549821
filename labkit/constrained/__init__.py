"""Structured output (SGLang's ``constrained``): grammar backends, per-request matchers and the
step's vocabulary bitmask. Backends load lazily: importing this package does not import xgrammar."""

from labkit.constrained.base_grammar_backend import (
    GRAMMAR_BACKENDS,
    GRAMMAR_KINDS,
    NO_GRAMMAR_BACKEND,
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarSpec,
    get_grammar_backend,
    grammar_backend_names,
    register_grammar_backend,
)
from labkit.constrained.bitmask import VocabMask, allocate_token_bitmask, build_vocab_mask

__all__ = [
    "GRAMMAR_BACKENDS",
    "GRAMMAR_KINDS",
    "NO_GRAMMAR_BACKEND",
    "BaseGrammarBackend",
    "BaseGrammarObject",
    "GrammarSpec",
    "VocabMask",
    "allocate_token_bitmask",
    "build_vocab_mask",
    "get_grammar_backend",
    "grammar_backend_names",
    "register_grammar_backend",
]
