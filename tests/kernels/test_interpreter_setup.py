"""Without CUDA the kernels run in Triton's interpreter, whatever imported labkit.kernels first."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the compiled kernels")


def test_kernels_are_interpreted_in_this_session():
    from labkit.kernels.kv_cache import _store_kv_kernel

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert type(_store_kv_kernel).__name__ == "InterpretedFunction"


def test_importing_labkit_kernels_turns_the_interpreter_on_by_itself(monkeypatch):
    """As when another test module imports the kernels before tests/kernels/conftest.py has run:
    the package's own import sets TRITON_INTERPRET before its kernel modules define anything."""
    import labkit.kernels

    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(labkit.kernels)
    assert os.environ.get("TRITON_INTERPRET") == "1"
