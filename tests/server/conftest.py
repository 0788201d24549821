"""A real `python -m labkit.server` in a subprocess, started once per test module."""

from __future__ import annotations

import pytest

from labkit.server.process import start_server


@pytest.fixture(scope="module")
def server():
    """The embedded model with metrics on; shut down with SIGTERM and checked to exit cleanly. float32
    on any device: the tests compare with transformers' float32 logprobs and between batch shapes,
    exactly (bfloat16 on a GPU rounds differently per batch shape)."""
    s = start_server("--enable-metrics", "--log-level", "warning", "--dtype", "float32")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
