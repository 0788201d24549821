"""What the structured-output tests share: the idle check and the output checks."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from labkit import Engine


def assert_idle(engine: Engine) -> None:
    """No request holds a KV slot or a request slot."""
    usage = engine.pool_usage()
    assert usage.request_owned == 0 and usage.protected == 0
    assert usage.free + usage.evictable == usage.total
    assert engine.req_to_token_pool.available_size() == engine.req_to_token_pool.size
    assert not engine.scheduler.has_work()


def assert_stopped(out: dict[str, Any]) -> None:
    """Finished because the grammar was complete (its stop token), not cut off."""
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["message"] is None, (reason, out["text"])


def assert_valid_json(out: dict[str, Any], schema: dict | bool) -> None:
    assert_stopped(out)
    jsonschema.validate(json.loads(out["text"]), schema)


def assert_full_match(out: dict[str, Any], regex: str) -> None:
    assert_stopped(out)
    assert re.fullmatch(regex, out["text"]), (regex, out["text"])
