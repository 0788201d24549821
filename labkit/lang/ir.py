"""The expressions a program appends to its state (`s += ...`), as SGLang's frontend names them:
text, `gen`, `select` and the role markers. They are plain data: the interpreter executes them.
`+` joins expressions (and strings) into an `ExprList`, so `"Answer: " + gen("a")` is one expression."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")


class Expr:
    """Something a program can append to its state."""

    def __add__(self, other: object) -> ExprList:
        return ExprList([self, as_expr(other)])

    def __radd__(self, other: object) -> ExprList:
        return ExprList([as_expr(other), self])


@dataclass(frozen=True)
class Text(Expr):
    """Literal text, appended as is."""

    text: str


@dataclass(frozen=True)
class ExprList(Expr):
    """Expressions executed in order."""

    items: list[Expr]


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text from the state's text so far; the result is appended and stored under `name`.
    `params` holds only the sampling parameters the call set (labkit's names), over the run's defaults."""

    name: str | None
    params: dict[str, Any]


@dataclass(frozen=True)
class Select(Expr):
    """Append the choice with the highest normalized prompt logprob (the mean logprob of its tokens
    after the state's text) and store it under `name`."""

    name: str | None
    choices: list[str]


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


def as_expr(value: object) -> Expr:
    """A string as Text; an expression as itself; anything else is a TypeError."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program can append text or labkit.lang expressions, not {type(value).__name__}")


def _check_name(name: object) -> str | None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"a variable name must be a string, got {type(name).__name__}")
    return name


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    choices: list[str] | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
) -> Expr:
    """SGLang's `gen`: a generation whose unset parameters come from `run(...)`. With `choices` it
    is a `select`. `json_schema` may be a JSON string (SGLang's form) or a dict."""
    if choices is not None:
        return select(name, choices)
    if regex is not None and json_schema is not None:
        raise ValueError("gen takes at most one of regex and json_schema")
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    given = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": min_tokens,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "frequency_penalty": frequency_penalty,
        "presence_penalty": presence_penalty,
        "ignore_eos": ignore_eos,
        "seed": seed,
        "regex": regex,
        "json_schema": json_schema,
    }
    return Gen(_check_name(name), {k: v for k, v in given.items() if v is not None})


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0) -> Select:
    """SGLang's `select`: pick one of `choices` by normalized prompt logprob (greedy: SGLang's
    `temperature` is accepted only as 0)."""
    if temperature != 0:
        raise ValueError("select is greedy: temperature must be 0")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs choices: a non-empty list of non-empty strings")
    return Select(_check_name(name), list(choices))


def _role(role: str, expr: object) -> ExprList:
    body = [] if expr is None else [as_expr(expr)]
    return ExprList([RoleBegin(role), *body, RoleEnd(role)])


def system(expr: object = None) -> ExprList:
    """A system message whose content is `expr` (text or expressions), in the model's chat template."""
    return _role("system", expr)


def user(expr: object = None) -> ExprList:
    """A user message whose content is `expr`, in the model's chat template."""
    return _role("user", expr)


def assistant(expr: object = None) -> ExprList:
    """An assistant message whose content is `expr` (e.g. a `gen`), in the model's chat template."""
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
