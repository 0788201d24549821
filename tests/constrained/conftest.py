"""The tiny random-weight Llama borrowing the embedded tokenizer (tests/conftest.py's
tiny_engine_kwargs) as an Engine, for the structured-output tests."""

from __future__ import annotations

import pytest

from labkit import Engine


@pytest.fixture(scope="module")
def engine(tiny_engine_kwargs):
    return Engine(**tiny_engine_kwargs)
