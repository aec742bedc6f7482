"""Prefix state cache: prompts that share a beginning (system prompt, few-shot header, the history
of a chat whose client resends it) prefill it once; later rows start from the cached state and
prefill only the rest.

Keys are hashes of token prefixes at *candidate lengths*: every multiple of ``block`` tokens, plus
the boundaries a route knows later prompts are likely to share (the chat template's end of the
system block and start of the assistant cue). A row starts from the longest cached candidate
(at least one prompt token is always fed, so the row gets its logits), and asks the engine for a
state snapshot (``GenerationOptions.snapshot_at``, one position per engine request) at:

1. the longest candidate beyond the hit that an earlier prompt also had (seen twice: a shared
   prefix; a bounded set of recently seen keys remembers them), else
2. the longest route boundary beyond the hit (likely the next turn's prefix).

A hit replaces prefill of tokens by importing the state they produce; chunked prefill is exact,
so results are identical to a miss (bit for bit on CPU fp32). The cache lives in host RAM,
bounded by a count or bytes (LRU). It runs on the event loop; it never touches the model.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from infer.state import SlotState
from infer.tokenizer import WorldTokenizer
from state_pool import Capacity, parse_capacity

SEEN_KEYS = 1 << 16  # recently seen candidate keys remembered (16 bytes each)


@dataclass
class CachePart:
    """Rows of one request group that can share an engine request once their prefixes are looked up."""

    rows: list[int]                          # positions in the group
    prompts: list[list[int]]                 # tokens left to prefill
    initial_states: list[SlotState | None]   # the cached state where a row hit (else the group's)
    skipped: list[int]                       # prompt tokens the initial state already covers
    snapshot_at: int | None = None           # position (in the remaining prompts) to snapshot
    keys: list[bytes | None] | None = None   # per row: the key to store that snapshot under


def whole_group(prompts: Sequence[Sequence[int]], initial_states: Sequence[SlotState | None] | None) -> CachePart:
    """The group as it is (no cache)."""
    n = len(prompts)
    return CachePart(list(range(n)), [list(p) for p in prompts], list(initial_states or [None] * n), [0] * n)


def token_positions(tokenizer: WorldTokenizer, tokens: Sequence[int], text: str, offsets: Sequence[int]) -> list[int]:
    """For character offsets into ``text`` (whose tokens are ``tokens``): how many leading tokens end
    at or before each. Tokenization is greedy, so a later text that starts with ``text[:offset]``
    normally begins with those same tokens (the token crossing the offset may differ)."""
    positions, end, count = [], 0, 0
    for target in sorted(len(text[:c].encode("utf-8")) for c in offsets):
        while count < len(tokens) and end + len(piece := tokenizer.decode_bytes((tokens[count],))) <= target:
            end += len(piece)
            count += 1
        positions.append(count)
    return positions


def prefix_keys(prompt: Sequence[int], lengths: Sequence[int]) -> list[bytes]:
    """Hash of ``prompt[:n]`` for each of the increasing ``lengths`` (one pass over the prompt)."""
    data = array("I", prompt).tobytes()
    digest = hashlib.blake2b(digest_size=16)
    keys, done = [], 0
    for n in lengths:
        digest.update(data[done * 4:n * 4])
        done = n
        keys.append(digest.copy().digest())
    return keys


class PrefixCache:
    def __init__(self, capacity: int | str | Capacity, block: int = 256, min_tokens: int = 32,
                 registry: CollectorRegistry | None = None):
        if block < 1 or min_tokens < 1:
            raise ValueError("block and min_tokens must be at least 1")
        self.capacity = parse_capacity(capacity)
        self.block, self.min_tokens = block, min_tokens
        self._entries: OrderedDict[bytes, SlotState] = OrderedDict()  # least recent first
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._bytes = 0
        r = registry or CollectorRegistry()
        self.hits = Counter("rwkv_prefix_cache_hits", "Rows that started from a cached prompt prefix", registry=r)
        self.misses = Counter("rwkv_prefix_cache_misses", "Rows that found no cached prompt prefix", registry=r)
        self.hit_tokens = Counter("rwkv_prefix_cache_hit_tokens", "Prompt tokens not prefilled thanks to the cache",
                                  registry=r)
        self.entries = Gauge("rwkv_prefix_cache_entries", "Cached prefix states", registry=r)
        self.bytes = Gauge("rwkv_prefix_cache_bytes", "Bytes of cached prefix states", registry=r)

    def split(self, prompts: Sequence[Sequence[int]], boundaries: Sequence[int] = ()) -> list[CachePart]:
        """Look up every row (all start from an empty state) and group the rows by snapshot position."""
        parts: dict[int | None, CachePart] = {}
        plans: dict[tuple[int, ...], tuple] = {}  # a prompt repeated in the group (n choices) is one lookup
        for row, prompt in enumerate(prompts):
            tokens = tuple(prompt)
            if tokens not in plans:
                plans[tokens] = self._plan(prompt, boundaries)
            skip, state, snapshot = plans[tokens]
            if skip:
                self.hits.inc()
                self.hit_tokens.inc(skip)
            else:
                self.misses.inc()
            at, key = (snapshot[0] - skip, snapshot[1]) if snapshot else (None, None)
            part = parts.setdefault(at, CachePart([], [], [], [], at, []))
            part.rows.append(row)
            part.prompts.append(list(prompt[skip:]))
            part.initial_states.append(state)
            part.skipped.append(skip)
            part.keys.append(key)
        return sorted(parts.values(), key=lambda p: p.rows[0])

    def _plan(self, prompt: Sequence[int], boundaries: Sequence[int]) -> tuple[int, SlotState | None,
                                                                              tuple[int, bytes] | None]:
        hints = {b for b in boundaries if self.min_tokens <= b < len(prompt)}
        lengths = sorted(hints.union(range(self.block, len(prompt), self.block)))
        keys = prefix_keys(prompt, lengths)
        skip, state = 0, None
        for n, key in zip(reversed(lengths), reversed(keys)):
            if key in self._entries:
                skip, state = n, self._entries[key]
                self._entries.move_to_end(key)
                break
        beyond = [(n, key) for n, key in zip(lengths, keys) if n > skip and key not in self._entries]
        shared = [c for c in beyond if c[1] in self._seen]
        hinted = [c for c in beyond if c[0] in hints]
        snapshot = shared[-1] if shared else hinted[-1] if hinted else None
        for key in keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > SEEN_KEYS:
            self._seen.popitem(last=False)
        return skip, state, snapshot

    def store(self, key: bytes, state: SlotState) -> None:
        """Keep ``state`` (a host copy the caller gives away) as the state after the prefix ``key``."""
        size = state.nbytes()
        if self.capacity.exceeded(1, size):
            return  # larger than the whole cache
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes()
        self._entries[key] = state
        self._bytes += size
        while self.capacity.exceeded(len(self._entries), self._bytes):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes()
        self.entries.set(len(self._entries))
        self.bytes.set(self._bytes)
