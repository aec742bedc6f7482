"""Session-state routes (spec §2.9–2.12): ``/state/chat/completions``, ``/multi_state/chat/completions``,
``/state/status``, ``/state/delete``; and the mapping of session errors to HTTP that every
stateful route (OpenAI ``session_id``, the Responses API) shares.

Request and response shapes are the peer's, with its bugs fixed (spec §6, §10): a session is
serialized by its lock (or 409), a cancelled or failed turn stores nothing, the stored state
ends at the visible reply, status pages count each session once, and every client sees only its
own namespace (infer/sessions.py).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Awaitable, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from infer.api.bridge import EventStream, RowGroup
from infer.api.chat_template import TURN_SEPARATOR
from infer.api.context import ServerContext, get_ctx
from infer.api.errors import ApiError
from infer.api.lightning import STREAM_DOC, options, respond, sampling
from infer.api.schemas import (BatchChunk, BatchCompletion, LightningError, LightningRequest, MultiStateCompletion,
                               MultiStateIndexEvent, MultiStateRequest, StateChatRequest, StateDeleteRequest,
                               StateDeleteResult, StateSessionInfo, StateStatus, StateStatusRequest)
from infer.api.streaming import sse_doc
from infer.engine import GenerationOptions
from infer.sessions import SessionNotFoundError, SessionService, Turn
from state_pool import CorruptStateError, SessionBusyError, StateMismatchError, Tier

ERRORS = {status: {"model": LightningError} for status in (400, 401, 404, 409, 410, 413, 422, 429, 503)}
T = TypeVar("T")
CACHE_LEVELS = {Tier.L1: "L1 (VRAM)", Tier.L2: "L2 (RAM)", Tier.DISK: "Database (Disk)"}

router = APIRouter(tags=["sessions"])


def sessions(ctx: ServerContext) -> SessionService:
    if ctx.sessions is None:
        raise ApiError(503, "session state is not enabled on this server", code="sessions_disabled")
    return ctx.sessions


async def session_call(call: Awaitable[T], param: str) -> T:
    """Await a SessionService call; its failures become HTTP errors naming the field ``param``."""
    try:
        return await call
    except SessionBusyError as e:
        raise ApiError(409, f"{e}; retry when its turn has finished", param=param, code="session_busy") from None
    except StateMismatchError as e:
        raise ApiError(409, f"{e}; delete it or use another id", param=param, code="state_model_mismatch") from None
    except CorruptStateError as e:
        raise ApiError(410, f"{e}; it has been removed, the next request starts it afresh", param=param,
                       code="state_corrupt") from None
    except SessionNotFoundError as e:
        raise ApiError(404, str(e), param=param, code="not_found") from None
    except ValueError as e:  # an id the store cannot key (the schemas catch most)
        raise ApiError(400, f"{param}: {e}", param=param) from None


def start_turn(ctx: ServerContext, turn: Turn, prompt: list[int], generation: GenerationOptions) -> EventStream:
    """Run ``prompt`` on top of the turn's state; the turn stores the final state and lets go of its
    lock before the client sees the end, and lets go in any case when the response is over."""
    keep = dataclasses.replace(generation, keep_state=True)
    return ctx.start([RowGroup([prompt], keep, [turn.state])], on_finish=turn.finish, on_close=turn.release)


def continuation(text: str, turn: Turn) -> str:
    """The peer's rule: a turn on a stored state starts a new paragraph."""
    return text if turn.state is None or text.startswith(TURN_SEPARATOR) else TURN_SEPARATOR + text


async def _stateful(ctx: ServerContext, request: Request, body: LightningRequest, turn: Turn,
                    **respond_options: object) -> Response:
    async with turn.until_started():
        prompts = await ctx.encode([continuation(body.contents[0], turn)], "contents")
        stream = start_turn(ctx, turn, prompts[0], options(ctx, body, sampling(body)))
    return await respond(request, stream, body, "chat.completion", **respond_options)


@router.post("/state/chat/completions", response_model=None, responses={
    200: {"model": BatchCompletion, "content": STREAM_DOC}, **ERRORS},
    summary="One raw prompt continued from the session's stored state, which the turn then replaces")
async def state_chat(body: StateChatRequest, request: Request, ctx: ServerContext = Depends(get_ctx)) -> Response:
    if body.session_id is None:  # stateless, like the peer
        stream = ctx.start([RowGroup(await ctx.encode(body.contents, "contents"), options(ctx, body, sampling(body)))])
        return await respond(request, stream, body, "chat.completion", id_prefix="rwkv7-state")
    turn = await session_call(sessions(ctx).continue_session(ctx.namespace, body.session_id), "session_id")
    return await _stateful(ctx, request, body, turn, id_prefix="rwkv7-state")


@router.post("/multi_state/chat/completions", response_model=None, responses={
    200: {"model": MultiStateCompletion, "content": sse_doc(BatchChunk, MultiStateIndexEvent)}, **ERRORS},
    summary="Continue node dialogue_idx of a conversation tree; the result becomes a new node")
async def multi_state_chat(body: MultiStateRequest, request: Request,
                           ctx: ServerContext = Depends(get_ctx)) -> Response:
    turn = await session_call(sessions(ctx).branch(ctx.namespace, body.session_id, body.dialogue_idx), "dialogue_idx")

    def trailer() -> list[dict]:
        if turn.node is None:
            return []
        return [MultiStateIndexEvent(object="multi_state.dialogue_idx", session_id=turn.saved_as,
                                     dialogue_idx=turn.node).model_dump()]
    return await _stateful(ctx, request, body, turn, id_prefix="rwkv7-multi-state", trailer=trailer,
                           fields=lambda: {"dialogue_idx": turn.node})


@router.post("/state/status", response_model=StateStatus, responses=ERRORS,
             summary="This client's sessions (each once, in its hottest tier), a page at a time")
async def state_status(body: StateStatusRequest | None = None, ctx: ServerContext = Depends(get_ctx)) -> StateStatus:
    body = body or StateStatusRequest()
    store = sessions(ctx).store
    counts = await store.counts(ctx.namespace)
    total, page = await store.list(ctx.namespace, body.offset, body.limit)
    return StateStatus(
        total_sessions=total, l1_cache_count=counts["l1"], l2_cache_count=counts["l2"],
        database_count=counts["disk"], offset=body.offset, limit=body.limit,
        sessions=[StateSessionInfo(session_id=info.session_id, cache_level=CACHE_LEVELS[info.tier],
                                   last_updated=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(info.last_used)),
                                   timestamp=info.last_used, size_bytes=info.size_bytes) for info in page])


@router.post("/state/delete", response_model=StateDeleteResult,
             responses={**ERRORS, 404: {"model": StateDeleteResult, "description": "nothing to delete"}},
             summary="Delete a session (with delete_prefix also its multi_state nodes)")
async def state_delete(body: StateDeleteRequest, ctx: ServerContext = Depends(get_ctx)) -> JSONResponse:
    service = sessions(ctx)
    deleted = await session_call(service.delete(ctx.namespace, body.session_id, body.delete_prefix), "session_id")
    if deleted or body.delete_prefix:
        result = StateDeleteResult(status="success", message=f"Session {body.session_id} deleted successfully",
                                   deleted=deleted)
        return JSONResponse(result.model_dump())
    result = StateDeleteResult(status="not_found", message=f"Session {body.session_id} not found", deleted=0)
    return JSONResponse(result.model_dump(), status_code=404)
