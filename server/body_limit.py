"""BodySizeLimitMiddleware: a request body larger than --max-request-bytes is refused with a 413
before any of it is parsed, and the whole body is never held beyond that size. Plain ASGI, the
outermost layer, so that no handler (not even the API-key check) sees an oversized request."""

from __future__ import annotations

from typing import Any

from labkit.server.errors import APIError

Message = dict[str, Any]


class BodySizeLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        # Read the body here (chunked uploads declare no length), counting as it arrives.
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see that
                return await self.app(scope, _replay([message], receive), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(scope, receive, send)
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        error = APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")
        await error.response()(scope, receive, send)


def _replay(messages: list[Message], receive: Any) -> Any:
    """A receive that hands out `messages` first, then the connection's own (its disconnect)."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
