"""labkit: a modular LLM serving engine to learn, research and run serving.

`import labkit` stays cheap (no torch, no transformers): Engine, EngineConfig, EngineStep and
SamplingParams load on first use, so importing one component (labkit.mem_cache.radix_cache, say)
brings in only what that component needs."""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

    from labkit.config import EngineConfig
    from labkit.engine import Engine, EngineStep
    from labkit.sampling.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStep", "SamplingParams"]

_LAZY = {
    "Engine": "labkit.engine",
    "EngineConfig": "labkit.config",
    "EngineStep": "labkit.engine",
    "SamplingParams": "labkit.sampling.sampling_params",
}


if not TYPE_CHECKING:  # type checkers read the imports above instead, and flag any other name

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups find it without coming back here
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _TritonInterpretSwitch:
    """Without CUDA, labkit.kernels' Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1).
    Triton reads the switch once, on its first import (by labkit.kernels, or by torch.compile through
    torch._dynamo), and deciding needs torch.cuda, which `import labkit` must not pay for. So this
    import hook waits for the first `import triton`, sets the switch then if there is no CUDA, and
    steps aside: the same decision as torch.cuda.is_available() up front (on a GPU the switch stays
    off), made only when Triton is about to load. A process that imported Triton before labkit must
    set TRITON_INTERPRET=1 itself."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name == "triton" and self in sys.meta_path:
            sys.meta_path.remove(self)
            import torch  # importing torch does not import triton

            if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
                os.environ["TRITON_INTERPRET"] = "1"
        return None  # the regular finders import triton


if "TRITON_INTERPRET" not in os.environ and "triton" not in sys.modules:
    sys.meta_path.insert(0, _TritonInterpretSwitch())
