"""Sessions: a conversation's recurrent state kept between requests (spec §2.9–2.12, §6.2).

A turn starts from a stored state, runs the new prompt on top of it in the engine
(``GenerationOptions.keep_state``), and stores the state the engine hands back, which ends
exactly where the visible reply ends (no stop string, no stop token). Only a turn that ended
normally (``stop`` or ``length``) is stored: a cancelled or failed turn leaves every stored state
as it was. Three kinds of turns:

- ``continue_session``: the state under ``session_id`` is read and replaced (``/state``, OpenAI
  ``session_id``). One lock per session serializes such turns, or rejects the second one
  (``busy="reject"``: SessionBusyError, HTTP 409), so two turns never interleave in one state.
  At most ``max_waiting`` requests queue for one session; more are rejected too.
- ``branch``: a conversation tree (``/multi_state``): the node ``"<tree>:<n>"`` is read, the
  result goes to a new node whose number ``SessionStore.next_index`` hands out durably (never
  twice while the node or the tree's counter exists, also across restarts). Turns of one tree
  share the tree's lock.
- ``follow``: the Responses API: the state of the previous response is read, the result (with
  the response object as metadata) goes under the new response's id. Nothing is overwritten, so
  no lock is needed.

Tenancy: every key lives in the namespace of the credential that created it. With a password,
the namespace is derived from it by a slow salted hash (the database never holds anything that
makes guessing the password cheap); one password is one namespace, so a new password starts an
empty one (the old sessions age out through the store's bounds). Without a password all clients
share the namespace ``"public"``.
"""
from __future__ import annotations

import hashlib
from contextlib import asynccontextmanager
from typing import AsyncIterator, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from infer.engine import RowFinished
from infer.state import SlotState
from state_pool import SessionBusyError, SessionLock, SessionStore, StateStoreError, Tier

PUBLIC_NAMESPACE = "public"
MAX_ID_CHARS = 256                # session ids, tree names, response ids
KEY_CHARS = MAX_ID_CHARS + 20     # store keys: an id plus ":<node number>"
KEPT_REASONS = ("stop", "length")
BUSY_POLICIES = ("wait", "reject")
_NAMESPACE_SALT = b"rwkv7-server/session-namespace/v1"
_NAMESPACE_ROUNDS = 100_000


class SessionNotFoundError(StateStoreError):
    """A state the request names (a tree node, a previous response) does not exist."""


def credential_namespace(password: str | None) -> str:
    """The namespace of the sessions created with ``password`` (see the module docstring)."""
    if password is None:
        return PUBLIC_NAMESPACE
    key = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8", "surrogatepass"), _NAMESPACE_SALT,
                              _NAMESPACE_ROUNDS)
    return "key-" + key.hex()[:32]


def node_key(tree: str, index: int) -> str:
    return f"{tree}:{index}"


class Turn:
    """One generation on top of a stored state. Holds its lock (if any) until ``finish``/``release``."""

    def __init__(self, store: SessionStore, namespace: str, lock: SessionLock | None,
                 target: str | None = None, tree: str | None = None):
        self._store, self._namespace, self._lock = store, namespace, lock
        self._target, self._tree = target, tree
        self.state: SlotState | None = None  # where the turn starts; None: an empty context
        self.saved_as: str | None = None      # the key the new state went to, once stored
        self.node: int | None = None          # branch: the new node's number

    async def finish(self, event: RowFinished, meta: str | None = None) -> None:
        """Store the turn's final state if it ended normally, then release the lock."""
        try:
            if event.finish_reason in KEPT_REASONS and event.state is not None:
                key = self._target
                if self._tree is not None:
                    self.node = await self._store.next_index(self._namespace, self._tree)
                    key = node_key(self._tree, self.node)
                await self._store.put(self._namespace, key, event.state, meta)
                self.saved_as = key
        finally:
            await self.release()

    async def release(self) -> None:
        """Give the lock back (idempotent; what was stored stays)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            await lock.__aexit__(None, None, None)

    @asynccontextmanager
    async def until_started(self) -> AsyncIterator[None]:
        """Release the turn if the block raises: the request failed before its stream took it over."""
        try:
            yield
        except BaseException:
            await self.release()
            raise

    async def _open(self, key: str | None, required: bool) -> Turn:
        """Take the lock, then load ``key``'s state (None: an empty context)."""
        if self._lock is not None:
            await self._lock.__aenter__()
        async with self.until_started():
            self.state = None if key is None else await self._store.get(self._namespace, key)
            if self.state is None and required:
                raise SessionNotFoundError(f"no stored state {key!r}")
        return self


class SessionService:
    def __init__(self, store: SessionStore, busy: str = "wait", max_waiting: int = 16):
        if busy not in BUSY_POLICIES:
            raise ValueError(f"busy must be one of {BUSY_POLICIES}")
        self.store, self.busy, self.max_waiting = store, busy, max_waiting

    def lock(self, namespace: str, session_id: str) -> SessionLock:
        """The session's lock under the busy policy (entering it may raise SessionBusyError)."""
        if self.busy == "reject":
            return self.store.try_lock(namespace, session_id)
        if self.store.waiting(namespace, session_id) >= self.max_waiting:
            raise SessionBusyError(f"session {session_id!r} already has {self.max_waiting} requests waiting")
        return self.store.lock(namespace, session_id)

    async def continue_session(self, namespace: str, session_id: str) -> Turn:
        """Lock the session and load its state (None for a new session)."""
        turn = Turn(self.store, namespace, self.lock(namespace, session_id), target=session_id)
        return await turn._open(session_id, required=False)

    async def branch(self, namespace: str, tree: str, index: int) -> Turn:
        """Lock the tree and load node ``index`` (node 0 may be missing: an empty root)."""
        turn = Turn(self.store, namespace, self.lock(namespace, tree), tree=tree)
        return await turn._open(node_key(tree, index), required=index != 0)

    async def follow(self, namespace: str, previous: str | None, target: str) -> Turn:
        """Load the state stored under ``previous`` (None: start empty); the result goes to ``target``."""
        return await Turn(self.store, namespace, None, target=target)._open(previous, required=previous is not None)

    async def delete(self, namespace: str, session_id: str, prefix: bool = False) -> int:
        """Delete once no turn runs on the session (or SessionBusyError with ``busy="reject"``)."""
        async with self.lock(namespace, session_id):
            return await self.store.delete(namespace, session_id, prefix=prefix)


class SessionMetrics(Collector):
    """The store's counts, bytes and counters for ``/metrics`` (read when scraped)."""

    EVENTS = ("hits_l1", "hits_l2", "hits_disk", "misses", "demotions", "evictions", "expired", "corrupt",
              "mismatched")

    def __init__(self, store: SessionStore):
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._store.stats()
        sessions = GaugeMetricFamily("rwkv_sessions", "Stored sessions by hottest tier", labels=["tier"])
        size = GaugeMetricFamily("rwkv_session_bytes", "Bytes of stored sessions by hottest tier", labels=["tier"])
        for tier in Tier:
            sessions.add_metric([str(tier)], stats[f"sessions_{tier}"])
            size.add_metric([str(tier)], stats[f"bytes_{tier}"])
        events = CounterMetricFamily("rwkv_session_events", "Session store events since start", labels=["event"])
        for name in self.EVENTS:
            events.add_metric([name], stats[name])
        yield from (sessions, size, events,
                    GaugeMetricFamily("rwkv_locked_sessions", "Sessions with a turn running or waiting",
                                      value=stats["locked_sessions"]),
                    GaugeMetricFamily("rwkv_waiting_turns", "Requests waiting for their session's turn",
                                      value=stats["waiting_turns"]))
