"""Model registry: HF `architectures` name -> labkit model class. Adding a model = one decorated class."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=type[nn.Module])
_MODELS: dict[str, type[nn.Module]] = {}


def register_model(architecture: str) -> Callable[[M], M]:
    """Class decorator: make `cls` the implementation of HF architecture `architecture`."""

    def wrap(cls: M) -> M:
        _MODELS[architecture] = cls
        return cls

    return wrap


def supported_architectures() -> list[str]:
    import labkit.models  # noqa: F401  (importing the package registers every model)

    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in a HF config's `architectures` list."""
    supported = supported_architectures()
    for arch in architectures or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"unsupported model architecture {architectures!r}; labkit supports: {', '.join(supported)}")
