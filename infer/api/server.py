"""The HTTP app: routes from ``lightning``, ``openai``, ``state`` and ``responses``, the shared
``/v1/chat/completions`` dispatcher, health and metrics, admission (body limit, password), CORS,
error handling, and the session store's lifetime (opened at startup; every session written at
shutdown, which uvicorn reaches on SIGINT/SIGTERM).

Routes parse, validate and authenticate, submit rows to the engine and turn its events into
JSON or SSE; they never touch tensors, and the event loop never runs model code.
"""
from __future__ import annotations

import json
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from infer.api import lightning, openai, responses, state, tokenize
from infer.api.context import ServerContext
from infer.api.errors import OPENAI_STYLE_KEY, ApiError, install_error_handlers, is_openai_chat_body
from infer.api.guard import PUBLIC_PATHS, TRANSLATE_PATH, Guard
from infer.api.schemas import (BatchChatRequest, BatchChunk, BatchCompletion, ChatCompletion, ChatCompletionChunk,
                               ChatCompletionRequest, Health, LightningError, OpenAIError)
from infer.api.streaming import sse_doc
from infer.sessions import SessionMetrics

DESCRIPTION = """RWKV-7 batch inference: rwkv_lightning-compatible routes and an OpenAI-compatible API.

When the server has a password, send `Authorization: Bearer <password>` (or, on POST routes, a
body field `password`). `/health`, `/docs` and `/openapi.json` are public. Streams are
server-sent events ending with `data: [DONE]`. See docs/API.md."""

# Models referenced from hand-written parts of the OpenAPI document (the dispatcher's body,
# SSE chunk schemas) that no route declares directly.
EXTRA_SCHEMAS: tuple[type[BaseModel], ...] = (BatchChatRequest, BatchChunk, ChatCompletionChunk)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _validated(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_input=False, include_context=False)) from None


def create_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if ctx.sessions is None:
            yield
            return
        await ctx.sessions.store.start()
        try:
            yield
        finally:
            await ctx.sessions.store.close()

    app = FastAPI(title="RWKV-7 inference server", version="1.0", description=DESCRIPTION,
                  separate_input_output_schemas=False, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    # First: the most used path (both dialects) is matched without trying every other route (61 -> 6 us a
    # request on a 2-core CPU; Starlette tries routes in order).
    @app.post("/v1/chat/completions", response_model=None, tags=["rwkv_lightning", "OpenAI"],
              summary="rwkv_lightning batch (body with contents) or OpenAI chat (body with messages)",
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                  "anyOf": [_ref(BatchChatRequest), _ref(ChatCompletionRequest)]}}}}},
              responses={200: {"content": {
                  "application/json": {"schema": {"anyOf": [_ref(BatchCompletion), _ref(ChatCompletion)]}},
                  **sse_doc(BatchChunk, ChatCompletionChunk)}},
                  **{status: {"content": {"application/json": {"schema": {"anyOf": [
                      _ref(LightningError), _ref(OpenAIError)]}}}} for status in lightning.ERRORS}})
    async def chat_completions(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            raise ApiError(400, "invalid JSON body", param="body") from None
        if is_openai_chat_body(body):
            request.scope[OPENAI_STYLE_KEY] = True
            return await openai.chat_completions(ctx, _validated(ChatCompletionRequest, body), request)
        if isinstance(body, dict) and "contents" not in body:
            raise ApiError(422, "contents (rwkv_lightning batch) or messages (OpenAI chat) is required",
                           param="contents")
        return await lightning.batch_chat(ctx, _validated(BatchChatRequest, body), request)

    app.include_router(lightning.router)
    app.include_router(openai.router)
    app.include_router(state.router)
    app.include_router(responses.router)
    app.include_router(tokenize.router)
    if ctx.sessions is not None:
        ctx.engine.metrics.registry.register(SessionMetrics(ctx.sessions.store))

    @app.get("/health", response_model=Health, responses={503: {"model": Health}}, tags=["server"],
             summary="200 when the engine is running, 503 otherwise")
    async def health() -> JSONResponse:
        ready = ctx.engine.is_running
        body = Health(status="ok" if ready else "unavailable", model=ctx.model_name,
                      running_rows=ctx.engine.running_rows, queued_requests=ctx.engine.queued_requests,
                      free_slots=ctx.engine.free_slots)
        return JSONResponse(body.model_dump(), status_code=200 if ready else 503)

    @app.get("/metrics", response_class=Response, tags=["server"], summary="Prometheus metrics of the engine",
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(generate_latest(ctx.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    public = PUBLIC_PATHS | ({TRANSLATE_PATH} if ctx.translate_no_auth else set())
    app.add_middleware(Guard, password=ctx.password, max_body_bytes=ctx.limits.max_body_bytes,
                       public_paths=frozenset(public))
    if ctx.cors_origins:  # added last = outermost, so preflights never meet the password check
        app.add_middleware(CORSMiddleware, allow_origins=list(ctx.cors_origins),
                           allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes, separate_input_output_schemas=False)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in EXTRA_SCHEMAS:
                definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for name, sub in definition.pop("$defs", {}).items():
                    components.setdefault(name, sub)
                components.setdefault(model.__name__, definition)
            if ctx.password:
                schema["components"]["securitySchemes"] = {"password": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"password": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
