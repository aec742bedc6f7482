"""HTTP routes: parse and validate, submit to the engine, turn events into JSON or SSE.

Routes never touch tensors; the engine thread does all model work.
"""
from __future__ import annotations

import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from infer.api.bridge import EventStream
from infer.engine import Engine, GenerationOptions, QueueFullError, RowFinished, RowText
from infer.sampler import SamplingParams
from infer.tokenizer import WorldTokenizer


@dataclass
class ServerLimits:
    max_tokens: int = 8192          # per row
    max_prompt_tokens: int = 131072  # per row
    max_rows: int = 256             # prompts per request


@dataclass
class ServerContext:
    engine: Engine
    tokenizer: WorldTokenizer
    model_name: str
    password: str | None
    limits: ServerLimits


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: object):
        self.status, self.message, self.extra = status, message, extra


class BatchChatRequest(BaseModel):
    """rwkv_lightning "V1" raw-prompt batch: one row per entry of ``contents``."""

    model: str = "rwkv7"
    contents: list[str] = Field(min_length=1)
    max_tokens: int = Field(8192, ge=1)
    stop_tokens: list[str] = ["\nUser:"]
    temperature: float = Field(1.0, ge=0.0, le=1000.0)
    top_k: int = Field(50, ge=0)
    top_p: float = Field(0.6, ge=0.0, le=1.0)
    alpha_presence: float = Field(2.0, ge=-10.0, le=10.0)
    alpha_frequency: float = Field(0.2, ge=-10.0, le=10.0)
    alpha_decay: float = Field(0.996, ge=0.0, le=1.0)
    stream: bool = False
    chunk_size: int = Field(4, ge=1, le=4096)
    seed: int | None = None
    password: str | None = None


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: object) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="RWKV-7 inference server", version="0.1")
    app.state.ctx = ctx

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": exc.message, **exc.extra}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"error": "invalid request: " + "; ".join(problems)}, status_code=422)

    def check_password(request: Request, body_password: str | None = None) -> None:
        if ctx.password is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else (body_password or "")
        if not hmac.compare_digest(given.encode(), ctx.password.encode()):
            raise ApiError(401, "Unauthorized: invalid or missing password")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": ctx.model_name, "running_rows": ctx.engine.running_rows,
                "queued_requests": ctx.engine.queued_requests, "free_slots": ctx.engine.free_slots}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": ctx.model_name, "object": "model", "owned_by": "rwkv7-server"}]}

    @app.post("/v1/chat/completions")
    async def batch_chat(body: BatchChatRequest, request: Request) -> Response:
        check_password(request, body.password)
        limits = ctx.limits
        if len(body.contents) > limits.max_rows:
            raise ApiError(400, f"contents: at most {limits.max_rows} prompts per request")
        if body.max_tokens > limits.max_tokens:
            raise ApiError(400, f"max_tokens: at most {limits.max_tokens}")
        prompts = [ctx.tokenizer.encode(text) for text in body.contents]
        for i, p in enumerate(prompts):
            if not p:
                raise ApiError(400, f"contents[{i}]: empty prompt")
            if len(p) > limits.max_prompt_tokens:
                raise ApiError(400, f"contents[{i}]: {len(p)} tokens, at most {limits.max_prompt_tokens}")
        options = GenerationOptions(
            max_tokens=body.max_tokens, stop=body.stop_tokens,
            sampling=SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                    alpha_presence=body.alpha_presence, alpha_frequency=body.alpha_frequency,
                                    alpha_decay=body.alpha_decay, seed=body.seed))
        stream = EventStream(ctx.engine, prompts, options)
        try:
            stream.submit()
        except QueueFullError as e:
            raise ApiError(429, str(e))
        if body.stream:
            return StreamingResponse(_batch_sse(stream, body.chunk_size), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        texts = [[] for _ in prompts]
        reasons = ["stop"] * len(prompts)
        usage = {"prompt_tokens": sum(len(p) for p in prompts), "completion_tokens": 0}
        async for event in stream:
            texts[event.index].append(event.text)
            if isinstance(event, RowFinished):
                reasons[event.index] = event.finish_reason
                usage["completion_tokens"] += event.completion_tokens
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return JSONResponse({
            "id": f"rwkv7-batch-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": ctx.model_name,
            "choices": [{"index": i, "message": {"role": "assistant", "content": "".join(t)},
                         "finish_reason": reasons[i]} for i, t in enumerate(texts)],
            "usage": usage,
        })

    return app


async def _batch_sse(stream: EventStream, chunk_size: int) -> AsyncIterator[str]:
    """V1 stream framing: per-row deltas flushed every ``chunk_size`` tokens, a final chunk per row
    with its finish_reason (old clients ignore it), then ``[DONE]``."""
    buffers: dict[int, list[str]] = {}
    counts: dict[int, int] = {}
    async for event in stream:
        buffers.setdefault(event.index, []).append(event.text)
        if isinstance(event, RowText):
            counts[event.index] = counts.get(event.index, 0) + 1
            if counts[event.index] < chunk_size:
                continue
        text = "".join(buffers.pop(event.index))
        counts[event.index] = 0
        choices = []
        if text:
            choices.append({"index": event.index, "delta": {"content": text}})
        if choices:
            yield sse({"object": "chat.completion.chunk", "choices": choices})
        if isinstance(event, RowFinished):
            yield sse({"object": "chat.completion.chunk",
                       "choices": [{"index": event.index, "delta": {}, "finish_reason": event.finish_reason}]})
    yield "data: [DONE]\n\n"
