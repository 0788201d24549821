"""The API key check on the real app (tiny model): one Authorization header, the Bearer scheme in any
case, a WWW-Authenticate challenge on 401, and /health (GET or HEAD) open to all."""

from __future__ import annotations

import pytest
from inprocess_tiny import error_of, run_with_server

KEY = "sk-test"


def get_models(headers: list[tuple[str, str]]):
    async def test(server):
        return await server.client.get("/v1/models", headers=headers)

    return run_with_server(test, api_key=KEY)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(scheme):
    assert get_models([("Authorization", f"{scheme} {KEY}")]).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("Authorization", "Bearer wrong")],
        [("Authorization", KEY)],
        [("Authorization", f"Basic {KEY}")],
        [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")],
        [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")],
        [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")],
    ],
)
def test_a_missing_wrong_or_repeated_key_gets_401_with_a_bearer_challenge(headers):
    r = get_models(headers)
    assert error_of(r, 401)["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_health_answers_get_and_head_without_a_key():
    async def test(server):
        return [await server.serve(server.client.request(method, "/health")) for method in ("GET", "HEAD")]

    assert [r.status_code for r in run_with_server(test, api_key=KEY)] == [200, 200]
