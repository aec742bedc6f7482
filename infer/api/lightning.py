"""rwkv_lightning-compatible routes: raw-prompt batch, FIM, big batch, translate (spec §2.3–2.8).

Wire formats follow the peer server; the fixes of spec §10 apply: real ``finish_reason``s
(``stop``/``length``/``error``) in responses and as a final per-row chunk in streams, ``usage``,
``temperature: 0`` = greedy, client stop tokens honoured on FIM, 4xx for bad input.
"""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from infer.api.bridge import EventStream, RowGroup
from infer.api.context import ServerContext, get_ctx
from infer.api.errors import ApiError
from infer.api.schemas import (BatchChatRequest, BatchChunk, BatchCompletion, BigBatchRequest, FimRequest,
                               LightningError, LightningRequest, LightningSampling, TranslateRequest,
                               TranslateResponse, Usage)
from infer.api.streaming import DONE, EventSourceResponse, SseObjects, json_string, sse, sse_doc, unless_disconnected
from infer.api.translate import (Placeholders, detect_language, keep_spacing, stop_strings,
                                 translate_prompt)
from infer.engine import Event, GenerationOptions, RowFinished, RowText
from infer.sampler import SamplingParams

DEFAULT_MAX_TOKENS = 8192
TRANSLATE_MAX_TOKENS = 2048
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "✿prefix✿", "✿suffix✿", "✿middle✿"

ERRORS = {status: {"model": LightningError} for status in (400, 401, 413, 422, 429)}
STREAM_DOC = sse_doc(BatchChunk)

router = APIRouter(tags=["rwkv_lightning"])


def split_stops(stops: Sequence[str | int]) -> tuple[list[str], list[int]]:
    """Strings are stop strings, integers stop token ids."""
    return [s for s in stops if isinstance(s, str)], [s for s in stops if isinstance(s, int)]


def sampling(body: LightningSampling) -> SamplingParams:
    return SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                          alpha_presence=body.alpha_presence, alpha_frequency=body.alpha_frequency,
                          alpha_decay=body.alpha_decay, seed=body.seed)


def options(ctx: ServerContext, body: LightningRequest | BigBatchRequest, params: SamplingParams) -> GenerationOptions:
    stop, stop_ids = split_stops(body.stop_tokens)
    return GenerationOptions(max_tokens=ctx.max_tokens(body.max_tokens, DEFAULT_MAX_TOKENS), stop=stop,
                             stop_token_ids=stop_ids, sampling=params)


async def collect(stream: EventStream) -> tuple[list[str], list[RowFinished]]:
    """Whole texts and finish events of every row."""
    texts: list[list[str]] = [[] for _ in range(stream.rows)]

    def on_event(event: Event) -> None:
        if isinstance(event, (RowText, RowFinished)):
            texts[event.index].append(event.text)
    finished = await stream.collect(on_event)
    return ["".join(t) for t in texts], finished


async def batch_sse(stream: EventStream, chunk_size: int, head: dict,
                    trailer: Callable[[], list[dict]] | None = None) -> AsyncIterator[str]:
    """Per-row deltas flushed every ``chunk_size`` tokens (rows of one step share an event), a final
    chunk per row with its finish_reason (old clients ignore it), the ``trailer`` events, then ``[DONE]``."""
    buffers = [""] * stream.rows
    counts = [0] * stream.rows
    chunk = SseObjects(head, "choices")
    async for events in stream.batches():
        flushed: dict[int, str] = {}
        finished = []
        for event in events:
            if not isinstance(event, (RowText, RowFinished)):
                continue
            i = event.index
            buffers[i] += event.text
            if isinstance(event, RowFinished):
                finished.append(event)
            else:
                counts[i] += 1
            if buffers[i] and (isinstance(event, RowFinished) or counts[i] >= chunk_size):
                flushed[i] = flushed.get(i, "") + buffers[i]
                buffers[i], counts[i] = "", 0
        if flushed:
            yield chunk.encoded_array(batch_delta_json(i, t) for i, t in flushed.items())
        for event in finished:
            yield chunk.encoded_array([batch_finish_json(event.index, event.finish_reason)])
    for extra in trailer() if trailer is not None else ():
        yield sse(extra)
    yield DONE


def batch_delta_json(index: int, text: str) -> str:
    """A batch stream's row delta, JSON text: what encode_json gives for {"index", "delta": {"content"}} (written out:
    a big batch's chunk holds a delta per row, and json's encoder costs ~2 us each)."""
    return f'{{"index":{index},"delta":{{"content":{json_string(text)}}}}}'


def batch_finish_json(index: int, finish_reason: str) -> str:
    """A batch stream's final chunk for a row, JSON text: encode_json's {"index", "delta": {}, "finish_reason"}."""
    return f'{{"index":{index},"delta":{{}},"finish_reason":{json_string(finish_reason)}}}'


def chunk_head(id_prefix: str, model: str) -> dict:
    """Fields every chunk of one lightning stream repeats."""
    return {"id": f"{id_prefix}-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}


async def respond(request: Request, stream: EventStream, body: LightningRequest, obj: str,
                  id_prefix: str = "rwkv7-batch", trailer: Callable[[], list[dict]] | None = None,
                  fields: Callable[[], dict] | None = None) -> Response:
    """The batch response: SSE when asked, else one JSON object with every row. Once the rows are
    done, ``trailer()`` gives events to send before ``[DONE]``, ``fields()`` top-level JSON fields."""
    head = chunk_head(id_prefix, body.model)
    if body.stream:
        return EventSourceResponse(batch_sse(stream, body.chunk_size, head, trailer), on_close=stream.close)
    texts, finished = await unless_disconnected(request, collect(stream), on_close=stream.close)
    result = BatchCompletion(
        id=head["id"], object=obj, created=head["created"], model=body.model,
        choices=[{"index": i, "message": {"content": t}, "finish_reason": f.finish_reason}
                 for i, (t, f) in enumerate(zip(texts, finished))],
        usage=Usage.of(sum(f.prompt_tokens for f in finished), sum(f.completion_tokens for f in finished)))
    return JSONResponse({**result.model_dump(), **(fields() if fields is not None else {})})


async def batch_chat(ctx: ServerContext, body: BatchChatRequest, request: Request) -> Response:
    """``/v1/chat/completions`` with ``contents`` (the dispatcher in server.py routes here)."""
    prompts = await ctx.encode(body.contents, "contents")
    stream = ctx.start([RowGroup(prompts, options(ctx, body, sampling(body)))])
    return await respond(request, stream, body, "chat.completion")


@router.post("/FIM/v1/batch-FIM", response_model=None, responses={
    200: {"model": BatchCompletion, "content": STREAM_DOC}, **ERRORS},
    summary="Fill in the middle, one row per prefix/suffix pair")
async def batch_fim(body: FimRequest, request: Request, ctx: ServerContext = Depends(get_ctx)) -> Response:
    if len(body.prefix) != len(body.suffix):
        raise ApiError(400, f"prefix and suffix must have the same length ({len(body.prefix)} != "
                            f"{len(body.suffix)})", param="suffix")
    texts = [f"{FIM_PREFIX}{FIM_SUFFIX}{s}{FIM_MIDDLE}{p}" for p, s in zip(body.prefix, body.suffix)]
    prompts = await ctx.encode(texts, "prefix")
    stream = ctx.start([RowGroup(prompts, options(ctx, body, sampling(body)))])
    return await respond(request, stream, body, "FIM.completion")


@router.post("/big_batch/completions", response_model=None, responses={
    200: {"content": STREAM_DOC, "description": "always an SSE stream"}, **ERRORS},
    summary="Raw-prompt batch with temperature-only sampling (always streamed)")
async def big_batch(body: BigBatchRequest, ctx: ServerContext = Depends(get_ctx)) -> Response:
    prompts = await ctx.encode(body.contents, "contents")
    params = SamplingParams(temperature=body.temperature, seed=body.seed)
    stream = ctx.start([RowGroup(prompts, options(ctx, body, params))])
    return EventSourceResponse(batch_sse(stream, body.chunk_size, chunk_head("rwkv7-big-batch", body.model)),
                               on_close=stream.close)


@router.post("/translate/v1/batch-translate", response_model=TranslateResponse, responses=ERRORS,
             summary="Immersive Translate custom API: translate each text (greedy)")
async def batch_translate(body: TranslateRequest, request: Request,
                          ctx: ServerContext = Depends(get_ctx)) -> TranslateResponse:
    ctx.check_rows(len(body.text_list), "text_list")
    marks = Placeholders(body.placeholders or ())
    sources = [detect_language(t) if body.source_lang == "auto" else body.source_lang for t in body.text_list]
    todo = [i for i, t in enumerate(body.text_list) if t.strip()]
    out = list(body.text_list)  # blank texts come back as they are
    done = await _translate(ctx, request, [body.text_list[i] for i in todo], [sources[i] for i in todo],
                            body.target_lang)
    retry: list[tuple[int, list[tuple[str, bool]]]] = []
    for i, text in zip(todo, done):
        out[i] = text
        if not marks.intact(body.text_list[i], text):
            retry.append((i, marks.split(body.text_list[i])))
    pieces = [(i, piece) for i, parts in retry for piece, is_mark in parts if not is_mark and piece.strip()]
    if retry and len(pieces) <= ctx.limits.max_rows:
        # The model lost or invented a marker: translate the text between markers piece by piece.
        again = iter(await _translate(ctx, request, [p for _, p in pieces], [sources[i] for i, _ in pieces],
                                      body.target_lang))
        for i, parts in retry:
            out[i] = "".join(piece if is_mark or not piece.strip() else keep_spacing(piece, next(again))
                             for piece, is_mark in parts)
    return TranslateResponse(translations=[{"detected_source_lang": s, "text": t} for s, t in zip(sources, out)])


async def _translate(ctx: ServerContext, request: Request, texts: list[str], sources: list[str],
                     target: str) -> list[str]:
    if not texts:
        return []
    prompts = await ctx.encode([translate_prompt(t, s, target) for t, s in zip(texts, sources)], "text_list",
                               indexed=False)
    by_source: dict[str, list[int]] = {}  # one engine request per source language (its stop strings)
    for i, source in enumerate(sources):
        by_source.setdefault(source, []).append(i)
    max_tokens = ctx.max_tokens(None, TRANSLATE_MAX_TOKENS)
    groups = [RowGroup([prompts[i] for i in rows], GenerationOptions(
        max_tokens=max_tokens, stop=stop_strings(source, target), sampling=SamplingParams(temperature=0)))
        for source, rows in by_source.items()]
    stream = ctx.start(groups)
    results, finished = await unless_disconnected(request, collect(stream), on_close=stream.close)
    if any(f.finish_reason == "error" for f in finished):
        raise ApiError(500, "translation failed")
    translated = [""] * len(texts)
    for i, text in zip((i for rows in by_source.values() for i in rows), results):
        translated[i] = text.strip()
    return translated
