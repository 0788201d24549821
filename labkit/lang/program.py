"""`@function` programs and how they run: `run` (one state), `run_batch` (many, in threads, whose
requests the backend batches), and the default backend."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from labkit.lang.backend import Backend, EngineBackend
from labkit.lang.interpreter import ProgramState
from labkit.lang.runtime import Runtime

_default_backend: Backend | None = None


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when `run` names none: a `Backend` (`RuntimeEndpoint(url)`,
    `EngineBackend(engine)`), a `Runtime` (its endpoint) or a labkit `Engine`, wrapped in an
    `EngineBackend`."""
    global _default_backend
    _default_backend = as_backend(backend)


def as_backend(backend: Any) -> Backend:
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, Runtime):
        return backend.endpoint
    from labkit.engine import Engine  # here: the Engine brings in torch, which an HTTP client never needs

    if isinstance(backend, Engine):
        return EngineBackend(backend)
    raise TypeError(f"a backend is a labkit.lang Backend or Runtime, or a labkit Engine, not {type(backend).__name__}")


class SglFunction:
    """A program: a function whose first parameter is the state, called with the program's
    arguments by `run` / `run_batch` (SGLang's name for the class)."""

    def __init__(self, func: Callable[..., Any]):
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"{func.__name__}: a program's first parameter is its state (def prog(s, ...))")
        self.func = func
        self.arg_names = params[1:]

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        backend: Any = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program with these arguments; the sampling parameters are every `gen`'s defaults
        (SGLang's). Returns the final state; an error in the program or the backend propagates."""
        defaults = _sampling_defaults(locals())
        return self._run_one(_backend(backend), defaults, args, kwargs)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        max_new_tokens: int = 128,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        backend: Any = None,
        num_threads: int | str = "auto",
    ) -> list[ProgramState]:
        """Run the program once per keyword set, `num_threads` at a time (`"auto"`: all at once, up to
        64), so the backend batches their requests. Returns the states in the order of
        `batch_kwargs`; an error propagates (the first failed run's, in batch order)."""
        if not isinstance(batch_kwargs, list) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise TypeError("run_batch takes a list of keyword-argument dicts, one per run")
        if num_threads == "auto":
            num_threads = min(max(len(batch_kwargs), 1), 64)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or an int >= 1, got {num_threads!r}")
        defaults = _sampling_defaults(locals())
        runner = _backend(backend)
        with ThreadPoolExecutor(num_threads, thread_name_prefix="labkit-lang") as pool:
            futures = [pool.submit(self._run_one, runner, defaults, (), kw) for kw in batch_kwargs]
            return [f.result() for f in futures]

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _run_one(
        self, backend: Backend, defaults: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ProgramState:
        state = ProgramState(backend, defaults)
        try:
            bound = inspect.signature(self.func).bind(state, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.func.__name__}({', '.join(self.arg_names)}): {e}") from None
        self.func(*bound.args, **bound.kwargs)
        return state


def function(func: Callable[..., Any]) -> SglFunction:
    """Decorator: `@function def prog(s, question): s += ...`."""
    return SglFunction(func)


_SAMPLING = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
)


def _sampling_defaults(given: dict[str, Any]) -> dict[str, Any]:
    """The run's sampling parameters, without the unset lists (None is not a value labkit takes)."""
    return {name: given[name] for name in _SAMPLING if given[name] is not None}


def _backend(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise RuntimeError("no backend: call labkit.lang.set_default_backend(...) or pass backend= to run")
    return _default_backend
