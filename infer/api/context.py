"""What every route needs from the server: the engine, the tokenizer, the configuration and the
limits, plus the few steps all routes share (tokenize within limits, resolve max_tokens, submit)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from infer.api.bridge import EventStream, RowGroup
from infer.api.errors import ApiError
from infer.engine import Engine, QueueFullError, RowFinished
from infer.prefix_cache import PrefixCache, token_positions
from infer.sessions import SessionService, credential_namespace
from infer.tokenizer import WorldTokenizer

# Tokenizing is pure Python: beyond this many characters it runs in a worker thread so the
# event loop keeps serving other streams.
INLINE_TOKENIZE_CHARS = 32_768
RETRY_AFTER_SECONDS = 1


@dataclass
class ServerLimits:
    max_tokens: int = 8192            # per row
    max_prompt_tokens: int = 131072   # per row
    max_rows: int = 256               # rows (prompts x choices) per request
    max_body_bytes: int = 16 * 2**20  # request body (413 beyond)


@dataclass
class ServerContext:
    engine: Engine
    tokenizer: WorldTokenizer
    model_name: str
    password: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    translate_no_auth: bool = False         # Immersive Translate cannot always send a key
    cors_origins: Sequence[str] = ()        # empty: no CORS headers at all
    sessions: SessionService | None = None  # None: the stateful routes answer 503
    prefix_cache: PrefixCache | None = None
    stream_interval: int = 1                # tokens a row per wake-up of a reader (EventStream's interval)
    created: int = field(default_factory=lambda: int(time.time()))
    namespace: str = field(init=False)      # of every session this server's credential creates

    def __post_init__(self) -> None:
        self.namespace = credential_namespace(self.password)

    def max_tokens(self, requested: int | None, default: int, name: str = "max_tokens") -> int:
        """The request's value within the server limit; an omitted value becomes ``default`` capped."""
        if requested is None:
            return min(default, self.limits.max_tokens)
        if requested > self.limits.max_tokens:
            raise ApiError(400, f"{name}: {requested} is above this server's limit of {self.limits.max_tokens}",
                           param=name)
        return requested

    def check_rows(self, rows: int, name: str) -> None:
        if rows > self.limits.max_rows:
            raise ApiError(400, f"{name}: {rows} rows in one request, this server allows {self.limits.max_rows}",
                           param=name)

    def check_prompt(self, tokens: Sequence[int], name: str) -> None:
        if not tokens:
            raise ApiError(400, f"{name}: the prompt is empty", param=name)
        if len(tokens) > self.limits.max_prompt_tokens:
            raise ApiError(400, f"{name}: {len(tokens)} prompt tokens, this server allows "
                                f"{self.limits.max_prompt_tokens}", param=name)

    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        if sum(len(t) for t in texts) > INLINE_TOKENIZE_CHARS:
            return await run_in_threadpool(lambda: [self.tokenizer.encode(t) for t in texts])
        return [self.tokenizer.encode(t) for t in texts]

    async def encode(self, texts: Sequence[str], name: str, indexed: bool = True) -> list[list[int]]:
        """Tokenize prompts and check them; ``name`` is the request field (a list of texts when
        ``indexed``, so errors name ``field[i]``)."""
        self.check_rows(len(texts), name)
        prompts = await self.tokenize(texts)
        for i, tokens in enumerate(prompts):
            self.check_prompt(tokens, f"{name}[{i}]" if indexed else name)
        return prompts

    async def encode_with_boundaries(self, text: str, offsets: Sequence[int], name: str) -> tuple[list[int], list[int]]:
        """One prompt's tokens (checked like ``encode``) and the token positions of character ``offsets``
        (prefix-cache hints; computed only when there is a cache)."""
        (tokens,) = await self.encode([text], name, indexed=False)
        if self.prefix_cache is None or not offsets:
            return tokens, []
        if len(text) > INLINE_TOKENIZE_CHARS:
            return tokens, await run_in_threadpool(token_positions, self.tokenizer, tokens, text, offsets)
        return tokens, token_positions(self.tokenizer, tokens, text, offsets)

    def start(self, groups: Sequence[RowGroup], on_finish: Callable[[RowFinished], Awaitable[None]] | None = None,
              on_close: Callable[[], Awaitable[None]] | None = None) -> EventStream:
        """Submit the rows to the engine (through the prefix cache); a full queue is a 429 the client
        may retry. See EventStream for the hooks."""
        stream = EventStream(self.engine, groups, self.prefix_cache, on_finish, on_close, self.stream_interval)
        try:
            stream.submit()
        except QueueFullError as e:
            raise ApiError(429, f"server busy: {e}; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        return stream


async def get_ctx(request: Request) -> ServerContext:
    """FastAPI dependency: the context ``create_app`` stored on the app (async: a plain function
    dependency would cost every request a round trip through the thread pool)."""
    return request.app.state.ctx
