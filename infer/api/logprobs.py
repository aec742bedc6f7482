"""Token log-probabilities in OpenAI's two wire formats, and which sampled tokens a client has seen.

Token strings: a token's bytes decoded as UTF-8. A token that is only part of a character
(the vocabulary has byte-level tokens) cannot be a JSON string, so it is written as
``"bytes:"`` followed by ``\\xHH`` per byte, e.g. ``"bytes:\\xe4\\xb8"``; chat entries also carry
the raw ``bytes``. Token 0 (end of document) is ``"<|endoftext|>"``.

Logprob values are the engine's: the model's distribution after penalties and logit bias, at
temperature 1, before top-k/top-p (see ``infer/sampler.py``); prompt positions are the raw
model distribution.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Generic, Sequence, TypeVar

from infer.engine import TokenLogprob
from infer.tokenizer import IncrementalDecoder, WorldTokenizer

EOD_TEXT = "<|endoftext|>"
T = TypeVar("T")


class TokenNames:
    """Token id -> its string for logprobs (cached; the vocabulary is fixed)."""

    def __init__(self, tokenizer: WorldTokenizer):
        self._tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def raw(self, token_id: int) -> bytes:
        return self._tokenizer.decode_bytes([token_id])

    def __call__(self, token_id: int) -> str:
        name = self._names.get(token_id)
        if name is None:
            raw = self.raw(token_id)
            if token_id == 0:
                name = EOD_TEXT
            else:
                try:
                    name = raw.decode("utf-8")
                except UnicodeDecodeError:
                    name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._names[token_id] = name
        return name


def char_offsets(tokenizer: WorldTokenizer, tokens: Sequence[int]) -> tuple[list[int], int]:
    """Where each token's text starts in the decoded string (a partial character counts from where
    the character will appear), and the decoded length."""
    decoder = IncrementalDecoder(tokenizer)
    starts, chars = [], 0
    for token in tokens:
        starts.append(chars)
        chars += len(decoder.push(token))
    return starts, chars + len(decoder.flush())


class VisibleTokens(Generic[T]):
    """Releases per-token items (logprobs) in step with the text the client is shown.

    The engine holds back text that may become a stop string and drops it when the stop
    matches; the tokens that carried that text must not show up in logprobs either. A token is
    released once the visible text reaches its first character, so a token that straddles the
    cut is kept and the result is the same for streamed and whole responses.
    """

    def __init__(self, tokenizer: WorldTokenizer):
        self._decoder = IncrementalDecoder(tokenizer)
        self._decoded = 0    # characters the sampled tokens decode to so far
        self._released = 0   # characters the engine has released
        self._pending: deque[tuple[int, T]] = deque()

    def push(self, token_id: int, item: T, released_text: str) -> list[tuple[int, T]]:
        """A sampled token (with what the engine released at that step): the (start, item) now visible."""
        self._pending.append((self._decoded, item))
        self._decoded += len(self._decoder.push(token_id))
        return self.release(released_text)

    def release(self, text: str) -> list[tuple[int, T]]:
        """More visible text (e.g. the tail released when the row finishes)."""
        self._released += len(text)
        out = []
        while self._pending and self._pending[0][0] < self._released:
            out.append(self._pending.popleft())
        return out


def chat_entry(names: TokenNames, lp: TokenLogprob) -> dict[str, Any]:
    """One ``choices[].logprobs.content[]`` item."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": names(token_id), "logprob": logprob, "bytes": list(names.raw(token_id))}
    return {**item(lp.token_id, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}


class LegacyLogprobs:
    """Accumulates the ``/v1/completions`` logprobs object (parallel lists)."""

    def __init__(self, names: TokenNames):
        self._names = names
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, offset: int, lp: TokenLogprob | None) -> None:
        """``lp`` None: nothing predicts this token (the first prompt token) or its value is unknown."""
        self.tokens.append(self._names(token_id))
        self.text_offset.append(offset)
        if lp is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(lp.logprob)
        top = {self._names(t): v for t, v in lp.top}
        top.setdefault(self._names(lp.token_id), lp.logprob)  # OpenAI always lists the chosen token
        self.top_logprobs.append(top)

    def take(self) -> dict[str, Any]:
        """The accumulated lists as the wire object, and start over (one streamed chunk's worth)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
