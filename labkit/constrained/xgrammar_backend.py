"""The xgrammar grammar backend (SGLang's default; PyPI ``xgrammar``).

xgrammar compiles a JSON schema, a regex or an EBNF grammar against the tokenizer's vocabulary into
a pushdown automaton whose per-token checks are precomputed, so filling a step's bitmask costs tens
of microseconds per request. JSON is compiled without free whitespace (`", "` and `": "` between
items): with it a model can emit whitespace until max_tokens, which random-weight models always do
and trained ones sometimes. Its JSON-schema converter silently ignores some keywords (it accepts
them but does not enforce them); `check` refuses those, as OpenAI's structured outputs do, so
that every output under an accepted schema validates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import xgrammar as xgr

from labkit.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarSpec,
    register_grammar_backend,
)

# Accepted by xgrammar's converter but not enforced (checked against jsonschema on sampled outputs).
_UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
)
# Where a schema holds subschemas: one, a list of them, or a map of names to them.
_ONE = ("items", "additionalItems", "additionalProperties", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
# Parsing alone (no vocabulary) finds every error compiling would.
_PARSERS: dict[str, Callable[[str], Any]] = {
    "json_schema": xgr.Grammar.from_json_schema,
    "regex": xgr.Grammar.from_regex,
    "ebnf": xgr.Grammar.from_ebnf,
}
# xgrammar's C++ errors start with a time stamp and a source location.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def _reason(e: Exception) -> str:
    return _LOG_PREFIX.sub("", str(e).strip())


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    for key in _ONE:
        if key in schema:
            yield schema[key], f"{path}/{key}"
    for key in _LIST:
        for i, sub in enumerate(_list(schema.get(key))):
            yield sub, f"{path}/{key}/{i}"
    for key in _MAP:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield sub, f"{path}/{key}/{name}"


def _check_enforced(schema: Any, path: str = "#") -> None:
    """ValueError naming the first keyword xgrammar would accept without enforcing it."""
    if not isinstance(schema, dict):
        return
    for key in _UNENFORCED:
        if key in schema:
            raise ValueError(f"json_schema: xgrammar does not enforce {key!r} (at {path})")
    if schema.get("uniqueItems"):
        raise ValueError(f"json_schema: xgrammar does not enforce 'uniqueItems' (at {path})")
    for key in ("oneOf", "allOf"):
        if len(_list(schema.get(key))) > 1:
            raise ValueError(
                f"json_schema: xgrammar does not enforce {key!r} over several schemas (at {path}; anyOf is)"
            )
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        raise ValueError(
            f"json_schema: xgrammar does not enforce minLength/maxLength beside a pattern or format (at {path})"
        )
    declared = schema.get("properties")
    declared = declared if isinstance(declared, dict) else {}
    missing = [name for name in _list(schema.get("required")) if name not in declared]
    if missing:
        raise ValueError(f"json_schema: required {missing} not declared in 'properties' (at {path})")
    for sub, sub_path in _subschemas(schema, path):
        _check_enforced(sub, sub_path)


def _bounded_strings_as_patterns(schema: Any) -> Any:
    """`schema` with each length-bounded string as a pattern of as many plain characters: xgrammar's
    own rule for such strings lets raw control characters through, which is not valid JSON."""
    if not isinstance(schema, dict):
        return schema
    out = {
        key: (
            _bounded_strings_as_patterns(value)
            if key in _ONE
            else [_bounded_strings_as_patterns(v) for v in value]
            if key in _LIST and isinstance(value, list)
            else {k: _bounded_strings_as_patterns(v) for k, v in value.items()}
            if key in _MAP and isinstance(value, dict)
            else value
        )
        for key, value in schema.items()
    }
    kind = out.get("type")
    is_string = kind == "string" or isinstance(kind, list) and "string" in kind
    if is_string and ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = rf'^[^"\\\u0000-\u001f]{{{low},{high}}}$'
    return out


class XGrammarGrammar(BaseGrammarObject):
    """One request's xgrammar matcher."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_vocab_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self._compiled)


@register_grammar_backend("xgrammar")
class XGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]):
        super().__init__(tokenizer, vocab_size, stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        # The base class caches compiled grammars; xgrammar's own cache would hold them twice.
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    @classmethod
    def check(cls, spec: GrammarSpec) -> None:
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.value)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        try:
            _PARSERS[spec.kind](spec.value)
        except RuntimeError as e:
            raise ValueError(f"invalid {spec.kind}: {_reason(e)}") from None
        if spec.kind == "json_schema":
            _check_enforced(schema)

    def compile(self, spec: GrammarSpec) -> XGrammarGrammar:
        self.check(spec)
        compilers: dict[str, Callable[[str], xgr.CompiledGrammar]] = {
            "json_schema": lambda value: self._compiler.compile_json_schema(
                json.dumps(_bounded_strings_as_patterns(json.loads(value))), any_whitespace=False
            ),
            "regex": self._compiler.compile_regex,
            "ebnf": self._compiler.compile_grammar,
        }
        try:
            return XGrammarGrammar(compilers[spec.kind](spec.value))
        except RuntimeError as e:
            raise ValueError(f"invalid {spec.kind}: {_reason(e)}") from None
