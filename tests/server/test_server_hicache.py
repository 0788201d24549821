"""The server with the hierarchical cache: a system prompt evicted from a small device pool comes back
from the host tier (usage.prompt_tokens_details.cached_tokens), /get_server_info reports the host pool,
the server returns to idle with every slot of both tiers owned, and /flush_cache empties both."""

from __future__ import annotations

import pytest
from server_process import MODEL, wait_idle

from labkit.server.process import start_server

TOPICS = ["cooking", "astronomy", "gardening", "chess"]


def ask(server, topic: str, question: str) -> tuple[str, int]:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": f"You are an expert on {topic}. " * 24},
            {"role": "user", "content": question},
        ],
        "max_tokens": 6,
        "temperature": 0,
    }
    out = server.post("/v1/chat/completions", json=body).json()
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_server_loads_evicted_prefixes_back_from_the_host_tier():
    server = start_server("--max-total-tokens", "512", "--enable-hierarchical-cache", "--log-level", "warning")
    try:
        first = [ask(server, t, "One fact.") for t in TOPICS]
        again = [ask(server, t, "Another fact.") for t in TOPICS]
        assert first[0][1] == 0  # nothing cached before the first request
        # Four ~150-token system prompts do not all fit in 512 device slots; the host tier keeps them.
        assert all(cached >= 128 for _, cached in again)
        info = wait_idle(server)
        host = info["host_pool"]
        assert host["host_only"] > 0
        assert host["free"] + host["host_only"] + host["backed_up"] == host["total"]
        assert server.post("/flush_cache").status_code == 200
        host = server.info()["host_pool"]
        assert host["free"] == host["total"]
    finally:
        server.stop()
