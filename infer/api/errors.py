"""Error responses in the caller's dialect, and the handlers that guarantee every failure is JSON.

rwkv_lightning clients expect ``{"error": "<message>"}`` (extra keys are harmless); OpenAI
clients expect ``{"error": {"message", "type", "param", "code"}}``. The dialect follows the
route: OpenAI paths (and the vLLM-style tokenizer routes), plus ``/v1/chat/completions`` when
its body is an OpenAI chat request (the dispatcher marks the request).
"""
from __future__ import annotations

from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from infer.api.streaming import ClientDisconnected, client_gone

OPENAI_PATH_PREFIXES = ("/openai/", "/v1/completions", "/v1/models", "/v1/responses", "/tokenize", "/detokenize")
OPENAI_STYLE_KEY = "rwkv.openai_errors"  # scope key set by the /v1/chat/completions dispatcher

_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 409: "conflict_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A client-visible failure: HTTP status, message, and the offending field when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})


def is_openai_chat_body(body: Any) -> bool:
    """``/v1/chat/completions`` serves both dialects: ``contents`` means rwkv_lightning, else ``messages`` OpenAI."""
    return isinstance(body, dict) and "contents" not in body and "messages" in body


def wants_openai_errors(scope: Mapping[str, Any]) -> bool:
    return scope.get(OPENAI_STYLE_KEY, False) or scope.get("path", "").startswith(OPENAI_PATH_PREFIXES)


def error_payload(status: int, message: str, openai: bool, param: str | None = None,
                  code: str | None = None) -> dict[str, Any]:
    if openai:
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    payload: dict[str, Any] = {"error": message}
    if param is not None:
        payload["param"] = param
    return payload


def error_response(scope: Mapping[str, Any], status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_payload(status, message, wants_openai_errors(scope), param, code),
                        status_code=status, headers=dict(headers or {}))


def field_name(loc: tuple[Any, ...]) -> str:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role``."""
    name = ""
    for part in loc:
        if part == "body" and not name:
            continue
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name or "body"


def describe_validation(errors: list[dict[str, Any]]) -> tuple[int, str, str]:
    """(status, message, first field) for pydantic errors; never echoes the input (it may hold a password)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "invalid JSON body", "body"
    problems = [f"{field_name(tuple(e['loc']))}: {e['msg']}" for e in errors[:8]]
    return 422, "invalid request: " + "; ".join(problems), field_name(tuple(errors[0]["loc"]))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request.scope, exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message, param = describe_validation(list(exc.errors()))
        return error_response(request.scope, status, message, param)

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, __: ClientDisconnected) -> Response:
        return client_gone()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Our routes raise ApiError; a 400 HTTPException comes from FastAPI failing to read the body
        # (e.g. JSON nested too deeply to parse).
        param = "body" if exc.status_code == 400 else None
        return error_response(request.scope, exc.status_code, str(exc.detail), param, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, so the server logs the traceback.
        return error_response(request.scope, 500, "internal server error")
