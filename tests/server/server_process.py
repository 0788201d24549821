"""The server tests' side of a real `python -m labkit.server` subprocess (started and stopped with
labkit.server.process): the served model's name and the wait for an idle server."""

from __future__ import annotations

import time

from labkit.model_loader.embedded import EMBEDDED_MODEL_NAME as MODEL  # noqa: F401 (the tests import it)
from labkit.server.process import ServerProcess


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict:
    """/get_server_info once nothing is in flight; fails if the pool does not come back."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.info()
        pool = info["pool"]
        if (
            info["in_flight"] == 0
            and info["running"] == 0
            and info["waiting"] == 0
            and pool["request_owned"] == 0
            and pool["protected"] == 0
            and info["req_slots"]["free"] == info["req_slots"]["total"]
        ):
            assert pool["free"] + pool["evictable"] == pool["total"]
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not return to idle: {info}")
        time.sleep(0.2)
