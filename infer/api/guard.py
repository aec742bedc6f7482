"""Admission before routing (pure ASGI, so streams pass through untouched): the body size limit
(413) and the password (401), checked for every route before anything is parsed or queued.

The password may come as ``Authorization: Bearer <pw>`` on any route, or as the JSON body's
``password`` field on POST routes (rwkv_lightning clients send it there). Both are compared in
constant time; neither is ever logged. Bodies are always parsed as JSON whatever their
Content-Type says, as the peer server does (``curl -d`` sends a form content type).
"""
from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer.api.errors import OPENAI_STYLE_KEY, error_response, is_openai_chat_body

# Readable without the password: liveness for load balancers and the (static) API description.
PUBLIC_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
TRANSLATE_PATH = "/translate/v1/batch-translate"
SHARED_CHAT_PATH = "/v1/chat/completions"


def _digest(secret: str) -> bytes:
    # Hashing first makes the comparison independent of the lengths too.
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


class Guard:
    """ASGI middleware: buffer the body within the limit, check the password, replay the body to the app."""

    def __init__(self, app: ASGIApp, password: str | None, max_body_bytes: int, public_paths: frozenset[str]):
        self.app = app
        self._digest = _digest(password) if password else None
        self.max_body_bytes = max_body_bytes
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if not self._authorized(scope, body):
            await error_response(self._style(scope, body), 401, "Unauthorized: invalid or missing password",
                                 code="invalid_api_key")(scope, receive, send)
            return
        if scope["method"] == "POST":
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Scope, body: bytes) -> bool:
        if self._digest is None or scope["path"] in self.public_paths:
            return True
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(_digest(token.strip()), self._digest):
            return True
        parsed = _parse_json(body) if scope["method"] == "POST" else None
        given = parsed.get("password") if isinstance(parsed, dict) else None
        return isinstance(given, str) and hmac.compare_digest(_digest(given), self._digest)

    @staticmethod
    def _style(scope: Scope, body: bytes) -> Scope:
        """Scope to pick the error dialect from: the shared chat path answers in the body's dialect."""
        if scope["path"] == SHARED_CHAT_PATH and is_openai_chat_body(_parse_json(body)):
            return {**scope, OPENAI_STYLE_KEY: True}
        return scope

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(scope, 413, f"request body larger than {self.max_body_bytes} bytes",
                             code="request_too_large")(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app reads the buffered body first, then the real channel (for http.disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay
