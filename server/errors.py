"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status.
Every failure the server answers goes through here, so no client ever sees a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# The error type of a status; any other is "invalid_request_error".
_TYPES = {401: "authentication_error", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        type: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.code = code or self.type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def server_unavailable(reason: object) -> APIError:
    """The 503 of a server whose scheduler or detokenizer process has died."""
    return APIError(503, f"the server stopped serving: {reason}", code="server_unavailable")


def _describe(errors: list[dict]) -> tuple[str, str | None, str]:
    """A one-line message from pydantic's error list, the offending parameter, and the error code."""
    parts, param, code = [], None, "invalid_value"
    for e in errors[:3]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        where = ".".join(loc)
        kind = e.get("type", "")
        if kind == "json_invalid" or not loc and kind in ("model_attributes_type", "dict_type"):
            parts.append("the request body is not a valid JSON object")
            code = "invalid_json"
        elif kind == "extra_forbidden":
            parts.append(f"unsupported parameter: {where}")
        elif kind == "missing":
            parts.append(f"missing required parameter: {where}")
        else:
            parts.append(f"{where}: {e.get('msg', 'invalid value')}" if where else e.get("msg", "invalid value"))
    return "; ".join(dict.fromkeys(parts)), param, code


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe(list(exc.errors()))
        return APIError(400, message, code=code, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
