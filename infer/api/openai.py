"""OpenAI-compatible routes: chat completions (messages), legacy completions, models.

Sampling: ``temperature`` 0 is greedy; ``top_k`` is an extension. ``presence_penalty`` and
``frequency_penalty`` map to the RWKV penalties ``alpha_presence`` / ``alpha_frequency`` with
``alpha_decay`` 1.0 (no decay): a token's penalty is ``presence + frequency * (uses - 1)``, so
the frequency part starts at the second use. Without them, chat uses the peer server's
defaults (top_p 0.6, top_k 20, alpha_presence 1.0, alpha_frequency 0.1, alpha_decay 0.996)
and completions use OpenAI's (top_p 1, no penalties). ``alpha_*`` fields override either.
With ``seed``, choice ``j`` samples with ``seed + j`` so the ``n`` choices differ yet repeat.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, NamedTuple, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from infer.api.bridge import EventStream, RowGroup
from infer.api.chat_template import TURN_STOPS, ThinkSplitter, render_chat_parts
from infer.api.context import ServerContext, get_ctx
from infer.api.errors import ApiError
from infer.api.logprobs import LegacyLogprobs, TokenNames, VisibleTokens, char_offsets, chat_entry
from infer.api.schemas import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Completion,
                               CompletionRequest, ModelList, OpenAIError, OpenAIRequest, PromptInput, Usage)
from infer.api.state import continuation, session_call, sessions, start_turn
from infer.api.streaming import (DONE, EventSourceResponse, SseObjects, encode_json, json_string, sse, sse_doc,
                                 unless_disconnected)
from infer.engine import Event, GenerationOptions, PromptLogprobs, RowFinished, RowText, TokenLogprob
from infer.sampler import SamplingParams



class SamplingDefaults(NamedTuple):
    temperature: float
    top_p: float
    top_k: int
    alpha_presence: float
    alpha_frequency: float
    alpha_decay: float


CHAT_MAX_TOKENS = 4096
CHAT_DEFAULTS = SamplingDefaults(1.0, 0.6, 20, 1.0, 0.1, 0.996)      # the peer server's /openai route
COMPLETION_DEFAULTS = SamplingDefaults(1.0, 1.0, 0, 0.0, 0.0, 1.0)   # OpenAI's

ERRORS = {status: {"model": OpenAIError} for status in (400, 401, 413, 422, 429)}

router = APIRouter(tags=["OpenAI"])


def sampling_params(body: OpenAIRequest, defaults: SamplingDefaults, top_logprobs: int) -> SamplingParams:
    temperature, top_p, top_k, presence, frequency, decay = defaults
    if body.presence_penalty is not None or body.frequency_penalty is not None:
        presence, frequency, decay = body.presence_penalty or 0.0, body.frequency_penalty or 0.0, 1.0

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value
    return SamplingParams(
        temperature=pick(body.temperature, temperature), top_p=pick(body.top_p, top_p), top_k=pick(body.top_k, top_k),
        alpha_presence=pick(body.alpha_presence, presence), alpha_frequency=pick(body.alpha_frequency, frequency),
        alpha_decay=pick(body.alpha_decay, decay), seed=body.seed,
        logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
        logprobs=top_logprobs)


def row_groups(body: OpenAIRequest, prompts: Sequence[Sequence[int]], options: GenerationOptions,
               boundaries: Sequence[int] = ()) -> list[RowGroup]:
    """Rows ``i * n + j`` = prompt i, choice j. Seeded choices get their own seed, hence their own request.
    ``boundaries`` (prefix-cache hints) hold for every prompt."""
    n = body.n
    if body.seed is None or n == 1:
        return [RowGroup([p for p in prompts for _ in range(n)], options, boundaries=boundaries)]
    return [RowGroup([p], dataclasses.replace(options, sampling=dataclasses.replace(options.sampling,
                                                                                     seed=(body.seed + j) % 2**64)),
                     boundaries=boundaries)
            for p in prompts for j in range(n)]


def user_stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def include_usage(body: OpenAIRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS, summary="The served model")
@router.get("/openai/v1/models", response_model=ModelList, responses=ERRORS, summary="The served model")
async def list_models(ctx: ServerContext = Depends(get_ctx)) -> ModelList:
    return ModelList(data=[{"id": ctx.model_name, "created": ctx.created, "owned_by": "rwkv7-server"}])


# ---------------------------------------------------------------------------- chat
@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: "ChatDelta") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.logprobs += other.logprobs

    def choice_json(self, index: int) -> str | None:
        """This delta as a streamed choice, JSON text (None when it shows nothing): what encode_json gives for
        {"index", "delta": {"reasoning_content", "content": the non-empty ones}, "logprobs": {"content": [...]} or
        null, "finish_reason": null}. Written out: with many streams a chunk a row a step is most of the event loop's
        work, and json's encoder costs ~2.7 us a call against ~0.2."""
        fields = [f'"{name}":{json_string(text)}' for name, text in (("reasoning_content", self.reasoning),
                                                                     ("content", self.content)) if text]
        if not fields and not self.logprobs:
            return None
        logprobs = encode_json({"content": self.logprobs}) if self.logprobs else "null"
        return f'{{"index":{index},"delta":{{{",".join(fields)}}},"logprobs":{logprobs},"finish_reason":null}}'


class ChatRow:
    """Turns one row's events into visible deltas; the same code serves streamed and whole responses."""

    def __init__(self, ctx: ServerContext, names: TokenNames, think: bool, logprobs: bool):
        self._names = names
        self._splitter = ThinkSplitter() if think else None
        self._visible: VisibleTokens[TokenLogprob] | None = VisibleTokens(ctx.tokenizer) if logprobs else None

    def on_event(self, event: RowText | RowFinished) -> ChatDelta:
        final = isinstance(event, RowFinished)
        visible: list[tuple[int, TokenLogprob]] = []
        if self._visible is not None:
            if final:
                visible = self._visible.release(event.text)
            elif event.logprob is not None:
                visible = self._visible.push(event.token_id, event.logprob, event.text)
        entries = [chat_entry(self._names, lp) for _, lp in visible]
        if self._splitter is None:
            return ChatDelta("", event.text, entries)
        delta = ChatDelta(*self._splitter.push(event.text), entries)
        if final:
            delta.add(ChatDelta(*self._splitter.flush()))
        return delta


@router.post("/openai/v1/chat/completions", response_model=None, responses={
    200: {"model": ChatCompletion, "content": sse_doc(ChatCompletionChunk)}, **ERRORS},
    summary="OpenAI chat completion (also served at /v1/chat/completions for bodies with messages)")
async def openai_chat(body: ChatCompletionRequest, request: Request, ctx: ServerContext = Depends(get_ctx)) -> Response:
    return await chat_completions(ctx, body, request)


async def chat_completions(ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> Response:
    rendered = render_chat_parts(body.messages, body.system, body.contents[0] if body.contents else None,
                                 body.enable_think)
    if not rendered.text:
        raise ApiError(400, "messages: no message has text content", param="messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
    ctx.check_rows(body.n, "n")
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    options = GenerationOptions(
        max_tokens=ctx.max_tokens(body.max_completion_tokens or body.max_tokens, CHAT_MAX_TOKENS, name),
        stop=[*TURN_STOPS, *user_stops(body.stop), *(body.stop_tokens or [])],
        sampling=sampling_params(body, CHAT_DEFAULTS, body.top_logprobs or 0),
        logprobs=bool(body.logprobs))
    if body.session_id is None:
        prompt, boundaries = await ctx.encode_with_boundaries(rendered.text, rendered.boundaries, "messages")
        stream = ctx.start(row_groups(body, [prompt], options, boundaries))
    else:  # the stored state holds the conversation so far: render only the new messages after it
        if body.n != 1:
            raise ApiError(400, "n: a session turn has exactly one choice", param="n")
        turn = await session_call(sessions(ctx).continue_session(ctx.namespace, body.session_id), "session_id")
        async with turn.until_started():
            (prompt,) = await ctx.encode([continuation(rendered.text, turn)], "messages", indexed=False)
            stream = start_turn(ctx, turn, prompt, options)
    names = TokenNames(ctx.tokenizer)
    rows = [ChatRow(ctx, names, body.enable_think, bool(body.logprobs)) for _ in range(stream.rows)]
    head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": body.model or ctx.model_name}
    if body.stream:
        return EventSourceResponse(_chat_sse(stream, rows, head, include_usage(body), len(prompt)),
                                   on_close=stream.close)
    deltas, finished = await unless_disconnected(request, _collect_chat(stream, rows), on_close=stream.close)
    result = ChatCompletion(
        id=head["id"], created=head["created"], model=head["model"],
        choices=[{"index": i, "finish_reason": f.finish_reason,
                  "message": {"content": d.content, "reasoning_content": d.reasoning if body.enable_think else None},
                  "logprobs": {"content": d.logprobs} if body.logprobs else None}
                 for i, (d, f) in enumerate(zip(deltas, finished))],
        usage=Usage.of(len(prompt), sum(f.completion_tokens for f in finished)))
    return JSONResponse(result.model_dump(exclude_none=True))


async def _collect_chat(stream: EventStream, rows: list[ChatRow]) -> tuple[list[ChatDelta], list[RowFinished]]:
    totals = [ChatDelta() for _ in rows]

    def on_event(event: Event) -> None:
        if isinstance(event, (RowText, RowFinished)):
            totals[event.index].add(rows[event.index].on_event(event))
    return totals, await stream.collect(on_event)


async def _chat_sse(stream: EventStream, rows: list[ChatRow], head: dict, with_usage: bool,
                    prompt_tokens: int) -> AsyncIterator[str]:
    """Role chunk per choice, content chunks, a finish chunk per choice, optional usage chunk, [DONE]."""
    extra = {"usage": None} if with_usage else {}
    for i in range(len(rows)):
        yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}], **extra})
    chunk = SseObjects(head, "choices", extra)
    completion_tokens = 0
    async for events in stream.batches():
        merged: dict[int, ChatDelta] = {}
        finished = []
        for event in events:
            if isinstance(event, (RowText, RowFinished)):
                merged.setdefault(event.index, ChatDelta()).add(rows[event.index].on_event(event))
            if isinstance(event, RowFinished):
                finished.append(event)
                completion_tokens += event.completion_tokens
        choices = [c for i, d in merged.items() if (c := d.choice_json(i))]
        if choices:
            yield chunk.encoded_array(choices)
        for event in finished:
            yield chunk([{"index": event.index, "delta": {}, "logprobs": None, "finish_reason": event.finish_reason}])
    if with_usage:
        yield sse({**head, "choices": [], "usage": Usage.of(prompt_tokens, completion_tokens).model_dump()})
    yield DONE


# ---------------------------------------------------------------------------- legacy completions
COMPLETION_EVENTS = (RowText, RowFinished, PromptLogprobs)


class CompletionRow:
    """One choice of ``/v1/completions``: echo, text, and the legacy logprobs lists."""

    def __init__(self, ctx: ServerContext, names: TokenNames, prompt: Sequence[int], prompt_text: str,
                 echo: bool, logprobs: bool):
        self._tokenizer = ctx.tokenizer
        self._prompt = prompt
        self._echo = prompt_text if echo else ""       # sent with the row's first output
        self._base = len(prompt_text) if echo else 0   # text_offset of the completion's first character
        self.legacy = LegacyLogprobs(names) if logprobs else None
        self._visible: VisibleTokens[tuple[int, TokenLogprob]] | None = \
            VisibleTokens(ctx.tokenizer) if logprobs else None
        self._chars = 0  # completion characters shown so far

    def on_event(self, event: RowText | RowFinished | PromptLogprobs) -> str:
        """The text this event adds; logprob entries accumulate in ``self.legacy``."""
        text, self._echo = self._echo, ""
        if isinstance(event, PromptLogprobs):
            starts, _ = char_offsets(self._tokenizer, self._prompt)
            for token, start, entry in zip(self._prompt, starts, event.entries):
                self.legacy.add(token, start, entry)
            return text
        if self._visible is not None:
            if isinstance(event, RowText):
                visible = self._visible.push(event.token_id, (event.token_id, event.logprob), event.text)
            else:
                visible = self._visible.release(event.text)
            for start, (token, lp) in visible:
                self.legacy.add(token, self._base + start, lp)
        self._chars += len(event.text)
        if isinstance(event, RowFinished) and self.legacy is not None and isinstance(event.matched_stop, int):
            # The stop token that ended the row is listed too: one entry per sampled token, as
            # lm-evaluation-harness slices them.
            self.legacy.add(event.matched_stop, self._base + self._chars, event.logprob)
        return text + event.text


async def completion_prompts(ctx: ServerContext, prompt: PromptInput) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (a string, strings, token ids, or lists of token ids)."""
    indexed = not (isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)))
    batch = list(prompt) if indexed else [prompt]
    if not batch:
        raise ApiError(400, "prompt: empty", param="prompt")
    if isinstance(batch[0], str):
        return await ctx.encode(batch, "prompt", indexed), batch
    ctx.check_rows(len(batch), "prompt")
    for i, tokens in enumerate(batch):
        ctx.check_prompt(tokens, f"prompt[{i}]" if indexed else "prompt")
    return batch, [ctx.tokenizer.decode(p) for p in batch]


@router.post("/v1/completions", response_model=None, responses={
    200: {"model": Completion, "content": sse_doc(Completion)}, **ERRORS},
    summary="OpenAI legacy text completion (echo + logprobs scores prompts, e.g. for lm-eval)")
async def completions(body: CompletionRequest, request: Request, ctx: ServerContext = Depends(get_ctx)) -> Response:
    prompts, texts = await completion_prompts(ctx, body.prompt)
    ctx.check_rows(len(prompts) * body.n, "n")
    echo = bool(body.echo)
    scored = body.logprobs is not None
    options = GenerationOptions(
        max_tokens=ctx.max_tokens(body.max_tokens, 16), stop=user_stops(body.stop),
        sampling=sampling_params(body, COMPLETION_DEFAULTS, body.logprobs or 0),
        logprobs=scored, prompt_logprobs=body.logprobs if scored and echo else None)
    stream = ctx.start(row_groups(body, prompts, options))
    names = TokenNames(ctx.tokenizer)
    rows = [CompletionRow(ctx, names, prompts[i // body.n], texts[i // body.n], echo, scored)
            for i in range(stream.rows)]
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": body.model or ctx.model_name}
    prompt_tokens = sum(len(p) for p in prompts)
    if body.stream:
        return EventSourceResponse(_completion_sse(stream, rows, head, include_usage(body), prompt_tokens),
                                   on_close=stream.close)
    texts_out, finished = await unless_disconnected(request, _collect_completion(stream, rows),
                                                    on_close=stream.close)
    result = Completion(
        id=head["id"], created=head["created"], model=head["model"],
        choices=[{"index": i, "text": t, "finish_reason": f.finish_reason,
                  "logprobs": row.legacy.take() if row.legacy is not None else None}
                 for i, (t, f, row) in enumerate(zip(texts_out, finished, rows))],
        usage=Usage.of(prompt_tokens, sum(f.completion_tokens for f in finished)))
    return JSONResponse(result.model_dump(exclude_none=True))


async def _collect_completion(stream: EventStream, rows: list[CompletionRow]) -> tuple[list[str], list[RowFinished]]:
    texts = [""] * len(rows)

    def on_event(event: Event) -> None:
        if isinstance(event, COMPLETION_EVENTS):
            texts[event.index] += rows[event.index].on_event(event)
    return texts, await stream.collect(on_event)


def completion_choice_json(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> str:
    """A streamed /v1/completions choice, JSON text: what encode_json gives for {"index", "text", "logprobs",
    "finish_reason"} (written out, as ChatDelta.choice_json says why)."""
    lp = "null" if logprobs is None else encode_json(logprobs)
    reason = "null" if finish_reason is None else json_string(finish_reason)
    return f'{{"index":{index},"text":{json_string(text)},"logprobs":{lp},"finish_reason":{reason}}}'


async def _completion_sse(stream: EventStream, rows: list[CompletionRow], head: dict, with_usage: bool,
                          prompt_tokens: int) -> AsyncIterator[str]:
    """One chunk per engine step with every row that has news; a row's last choice carries its finish_reason."""
    extra = {"usage": None} if with_usage else {}
    chunk = SseObjects(head, "choices", extra)
    completion_tokens = 0
    async for events in stream.batches():
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        for event in events:
            if isinstance(event, COMPLETION_EVENTS):
                texts[event.index] = texts.get(event.index, "") + rows[event.index].on_event(event)
            if isinstance(event, RowFinished):
                reasons[event.index] = event.finish_reason
                completion_tokens += event.completion_tokens
        choices = []
        for i, text in texts.items():
            legacy = rows[i].legacy.take() if rows[i].legacy is not None else None
            if text or reasons.get(i) or (legacy and legacy["tokens"]):
                choices.append(completion_choice_json(i, text, legacy, reasons.get(i)))
        if choices:
            yield chunk.encoded_array(choices)
    if with_usage:
        yield sse({**head, "choices": [], "usage": Usage.of(prompt_tokens, completion_tokens).model_dump()})
    yield DONE
