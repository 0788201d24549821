"""The program state `s` and its execution. Each `s += expr` runs at once, in the caller's thread:
the state's text so far is the prompt of every request (a token-free text prompt), so a fork's
branches send prompts that share its text, and the radix cache serves that prefix to each branch
once one request has carried it (visible as `cached_tokens` in `get_meta_info`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from labkit.lang.backend import Backend, TokenLogprob
from labkit.lang.ir import Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, Text, as_expr


class ProgramState:
    """A program's text, chat messages and variables. `s += expr` appends text or runs `gen` /
    `select` / role markers; `s["name"]` reads a variable; `fork(n)` branches."""

    def __init__(self, backend: Backend, sampling_defaults: dict[str, Any]):
        self.backend = backend
        self.sampling_defaults = sampling_defaults
        self._text = ""
        self._messages: list[dict[str, str]] = []
        self._variables: dict[str, Any] = {}
        self._meta_info: dict[str, dict[str, Any]] = {}
        self._role: str | None = None
        self._role_start = 0  # where the open role's content starts in the text

    # ---- reading ---------------------------------------------------------------------------------
    def text(self) -> str:
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The closed role blocks, as chat messages (content stripped of leading whitespace, as SGLang's)."""
        return [dict(m) for m in self._messages]

    def get_var(self, name: str) -> Any:
        if name not in self._variables:
            raise KeyError(f"no variable {name!r} in this state (it has {sorted(self._variables)})")
        return self._variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self._variables[name] = value

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """What the backend said about the `gen` or `select` stored under `name`: for a gen, its
        request's meta info (prompt, completion and cached tokens, finish reason); for a select,
        SGLang's `normalized_prompt_logprobs` and `input_token_logprobs`, one per choice."""
        if name not in self._meta_info:
            raise KeyError(f"no gen or select named {name!r} ran in this state")
        return self._meta_info[name]

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._variables

    def __repr__(self) -> str:
        return f"ProgramState({self._text!r})"

    # ---- running ---------------------------------------------------------------------------------
    def __iadd__(self, other: object) -> ProgramState:
        self._execute(as_expr(other))
        return self

    def system(self, expr: object = None) -> AbstractContextManager[None] | None:
        """`s.system(expr)` appends a system message; `with s.system(): ...` wraps what the block appends."""
        return self._role_scope("system", expr)

    def user(self, expr: object = None) -> AbstractContextManager[None] | None:
        return self._role_scope("user", expr)

    def assistant(self, expr: object = None) -> AbstractContextManager[None] | None:
        return self._role_scope("assistant", expr)

    def _role_scope(self, role: str, expr: object) -> AbstractContextManager[None] | None:
        if expr is not None:
            self._execute(ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)]))
            return None
        return self._role_block(role)

    @contextmanager
    def _role_block(self, role: str) -> Iterator[None]:
        self._role_begin(role)
        yield
        self._role_end(role)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """`with s.copy() as c: ...`: a one-state fork whose new variables join back into `s` (as lists)."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` states that start as copies of this one (text, messages, variables) and go on on
        their own. With more than one, the text so far is sent to the backend first (as SGLang
        does), so that every branch's first request finds it in the radix cache, even when the
        branches run at once."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork needs a size >= 1, got {size!r}")
        if size > 1 and self._text:
            self.backend.cache_prefix(self._text)
        return ProgramStateGroup([self._copy() for _ in range(size)], self)

    def _copy(self) -> ProgramState:
        state = copy.copy(self)
        state._messages = copy.deepcopy(self._messages)
        state._variables = dict(self._variables)
        state._meta_info = dict(self._meta_info)
        return state

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._text += expr.text
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            out = self.backend.generate(self._text, {**self.sampling_defaults, **expr.params})
            self._store(expr.name, out["text"], out["meta_info"])
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        else:
            raise TypeError(f"cannot execute {type(expr).__name__}")

    def _store(self, name: str | None, value: str, meta_info: dict[str, Any]) -> None:
        self._text += value
        if name is not None:
            self._variables[name] = value
            self._meta_info[name] = meta_info

    def _select(self, expr: Select) -> None:
        scores = self.backend.score(self._text, expr.choices)
        normalized = [normalized_logprob(pairs) for pairs in scores]
        best = max(range(len(expr.choices)), key=normalized.__getitem__)  # the first of equal scores
        meta = {"normalized_prompt_logprobs": normalized, "input_token_logprobs": scores}
        self._store(expr.name, expr.choices[best], meta)

    def _role_begin(self, role: str) -> None:
        if self._role is not None:
            raise ValueError(f"a {role} message cannot begin inside the open {self._role} message")
        template = self.backend.chat_template()
        if not self._messages and role != "system" and template.default_system_prompt is not None:
            # The template's default system message, as the model would see it from a chat request.
            self._role_begin("system")
            self._text += template.default_system_prompt
            self._role_end("system")
        prefix, _ = template.prefix_and_suffix(role, first=not self._messages)
        self._text += prefix
        self._role, self._role_start = role, len(self._text)

    def _role_end(self, role: str) -> None:
        if self._role != role:
            raise ValueError(f"{role}_end without an open {role} message (open: {self._role})")
        content = self._text[self._role_start :].lstrip()
        self._text += self.backend.chat_template().role_prefix_and_suffix[role][1]
        self._messages.append({"role": role, "content": content})
        self._role = None


class ProgramStateGroup:
    """The states `fork` made: indexable and iterable; `+=` appends to each (a list: one item each;
    a function: `f(i)` to the i-th), all at once in threads, so that their requests share batches;
    `join` brings their results back to the state they were forked from."""

    def __init__(self, states: list[ProgramState], source: ProgramState):
        self.states = states
        self.source = source
        self._fork_text_len = len(source.text())

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += expr` assigns the fork back to its own place; nothing else may.
        if value is not self.states[i]:
            raise TypeError("a fork cannot be replaced; append to it with forks[i] += ...")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: object) -> ProgramStateGroup:
        items: list[object]
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            items = list(other)
        elif callable(other):  # SGLang's form: f(i) for the i-th fork
            items = [other(i) for i in range(len(self.states))]
        else:
            items = [other] * len(self.states)
        with ThreadPoolExecutor(len(self.states), thread_name_prefix="labkit-lang-fork") as pool:
            for done in [pool.submit(state.__iadd__, item) for state, item in zip(self.states, items)]:
                done.result()  # the first error, if any, propagates
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """SGLang's two modes. `gather_variable`: each variable the source state does not have
        becomes there the list of the forks' values, in fork order (forks that lack it are left
        out). `concate_and_append`: the text each fork added is appended to the source's, fork after fork."""
        if mode == "gather_variable":
            known = set(self.source._variables)
            for state in self.states:
                for name in state._variables.keys() - known:
                    self.source._variables.setdefault(name, []).append(state._variables[name])
        elif mode == "concate_and_append":
            self.source += "".join(s.text()[self._fork_text_len :] for s in self.states)
        else:
            raise ValueError(f"unknown join mode {mode!r}: gather_variable or concate_and_append")


def normalized_logprob(pairs: list[TokenLogprob]) -> float:
    """The mean logprob of a choice's tokens (SGLang's normalized prompt logprob); a token without
    one (the prompt's first, which nothing predicts) is left out."""
    values = [lp for lp, _ in pairs if lp is not None]
    return sum(values) / len(values) if values else float("-inf")
