"""Session states in three tiers: L1 on the model's device, L2 in host RAM, L3 in SQLite.

A session is one conversation's recurrent state (``infer.state.SlotState``) under a key
``(namespace, session_id)``. The namespace is an opaque string the caller derives from the
credential that created the session (e.g. a hash of it); every operation sees only its own
namespace. Keys longer than ``max_key_len`` or holding control characters raise ValueError.

Use::

    store = SessionStore(path, fingerprint, model.config, device="cuda", l1="16", l2="8GB",
                         max_sessions=None, max_bytes="50GB", ttl=None, flush_interval=1.0)
    await store.start()                       # or: async with SessionStore(...) as store:
    async with store.lock(ns, sid):           # store.try_lock(ns, sid) raises SessionBusyError;
                                              # store.waiting(ns, sid): tasks queued for the lock
        state = await store.get(ns, sid)      # SlotState | None, a copy on the L1 device
        ...                                   # import it into a slot, run the turn, export
        await store.put(ns, sid, new_state)   # stores a copy; ValueError if shapes don't fit
    await store.put(ns, sid, state, meta='{"any": "json"}')  # a caller's note kept with the state
    await store.get_meta(ns, sid)             # that note, or None
    await store.next_index(ns, "tree")        # 1, 2, ...: durable, never below a "tree:<n>" key
    await store.delete(ns, sid, prefix=True)  # also every "<sid>:*" branch; returns the count
    total, page = await store.list(ns, offset=0, limit=50)  # [SessionInfo], most recent first
    await store.counts(ns)                    # {"l1", "l2", "disk", "total"}; ns=None: all
    store.stats()                             # hits_{l1,l2,disk}, misses, demotions, evictions,
                                              # expired, corrupt, mismatched, bytes_{l1,l2,disk},
                                              # sessions_{l1,l2,disk}, locked_sessions,
                                              # waiting_turns (lock waiters)
    await store.flush()                       # write now (the flusher does it every interval)
    await store.close()                       # writes every session

Locks are entries of a table that exist only while a task holds or awaits them, so sessions
that are gone cost no memory. Errors derive from ``StateStoreError``.

Tiers. A session lives in exactly one memory tier, or in none ("disk"). ``put`` and ``get``
make it the most recent entry of L1; L1's least recent entry moves to L2, L2's to disk only.
Capacities are session counts or byte sizes (``parse_capacity``: "64", "8GB", "512MiB"). On a
CPU-only server L1 and L2 are both host memory; with CUDA, L2 is pinned. ``list``, ``counts``
and ``stats`` report each session once, in its hottest tier.

Durability. SQLite is the write-behind backing store of every session: a background task
writes the sessions changed since its last pass every ``flush_interval`` seconds (sooner when a
dirty session leaves RAM), so a hard kill loses at most that interval; ``close`` writes all.
WAL with ``synchronous=NORMAL`` survives a killed process, not a power cut. A session demoted
to disk before its row is written keeps its state in RAM until it is. Tensor copies and
(de)serialization run in worker threads, SQL in aiosqlite's thread: the event loop only does
bookkeeping. One server process owns a database file (its index of rows lives in memory): ``start``
takes an exclusive lock on ``<path>.lock`` (released by ``close``, or by the OS when the process
dies) and raises StateStoreError while another store holds it.

Metadata and counters. ``put`` may attach a text (``meta``, e.g. JSON) that lives and dies with
the state; a ``put`` without it clears it. It is held in RAM only until its row is written, so
``get_meta`` of a written session reads the row. ``next_index`` numbers the nodes of a tree of
sessions ``"<name>:<n>"``: it returns one more than the larger of the tree's counter and of its
existing node numbers, and commits the counter at once, so a number is never handed out twice
while its node or the counter exists. Counters go with ``delete(name, prefix=True)``, after
``ttl`` seconds without an allocation, and beyond ``max_counters`` (least recent first).

Integrity. A row holds the caller's model fingerprint (its weights; ``config`` gives the
shapes), a format version and a safetensors blob (dtypes and shapes in its header; no pickle).
``get`` of a row written for another fingerprint, format or shape raises ``StateMismatchError``
and keeps the row (it is valid for that model); ``put`` replaces it. A row that does not decode
is logged, dropped from the store and reported once by ``CorruptStateError``; the next ``get``
returns None (a fresh start).

Bounds. ``max_sessions`` and ``max_bytes`` (raw tensor bytes of all sessions) evict the least
recently used sessions from every tier (the newest one stays, whatever its size); ``ttl``
seconds after its last use a session is gone from every tier, and its row at the next pass.
Freed pages are returned to the file system by ``PRAGMA incremental_vacuum`` after each pass
that deleted rows (the database is created with ``auto_vacuum=INCREMENTAL``), so the file
shrinks without a blocking VACUUM.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import re
import time
from collections import OrderedDict
from contextlib import suppress
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Callable

import aiosqlite
import safetensors.torch
import torch

from infer.checkpoint import ModelConfig
from infer.state import SlotState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_COLUMNS = "namespace, session_id, fingerprint, format, size, last_used, meta, blob"
_FIELDS = ("att_shift", "wkv", "ffn_shift")
_NODE_NUMBER = re.compile(r"[0-9]{1,18}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?")
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_COUNTERS = ("hits_l1", "hits_l2", "hits_disk", "misses", "demotions", "evictions", "expired",
             "corrupt", "mismatched")

Key = tuple[str, str]


class Tier(StrEnum):
    L1 = "l1"
    L2 = "l2"
    DISK = "disk"


class StateStoreError(Exception):
    """Base of the errors a route maps to an HTTP status."""


class StateMismatchError(StateStoreError):
    """A stored state belongs to another model (fingerprint, format or shape)."""

    def __init__(self, session_id: str, expected: str, found: str):
        super().__init__(f"session {session_id!r} was stored for model {found!r}; "
                         f"this server runs {expected!r}")
        self.expected, self.found = expected, found


class CorruptStateError(StateStoreError):
    """A stored row could not be decoded; the session has been dropped."""


class SessionBusyError(StateStoreError):
    """``try_lock`` found the session in use by another request."""


@dataclass(frozen=True)
class Capacity:
    """A tier's bound: a number of sessions, or of bytes when ``in_bytes``."""

    limit: int
    in_bytes: bool = False

    def exceeded(self, count: int, nbytes: int) -> bool:
        return (nbytes if self.in_bytes else count) > self.limit


def parse_capacity(value: int | str | Capacity) -> Capacity:
    """Read a capacity: "64" or 64 is 64 sessions; "8GB", "512MiB", "100B" are bytes (SI or binary units)."""
    if isinstance(value, Capacity):
        return value
    match = _SIZE.fullmatch(str(value).strip().lower())
    if match is None or (match[2] is None and "." in match[1]):
        raise ValueError(f"capacity {value!r}: expected a count like '64' or a size like '8GB', '512MiB'")
    if match[2] is None:
        return Capacity(int(match[1]))
    return Capacity(int(float(match[1]) * _UNITS[match[2]]), in_bytes=True)


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    tier: Tier
    last_used: float  # Unix time
    size_bytes: int


@dataclass(eq=False)
class _Session:
    key: Key
    size: int
    last_used: float
    tier: Tier = Tier.DISK
    state: SlotState | None = None  # None only when the row holds the latest state
    version: int = 0                # bumped by put, so a flush of an older state keeps it dirty
    dirty: bool = False             # the row is older than `state` (or missing)
    meta: str | None = None         # the caller's note of the unwritten state (the row has it once written)


class SessionLock:
    """``async with`` guard over one session. The table holds an entry only while some task
    holds or awaits the lock, so sessions that are gone cost no memory."""

    def __init__(self, table: dict[Key, list], key: Key, wait: bool):
        self._table, self._key, self._wait = table, key, wait
        self._entry: list | None = None  # [asyncio.Lock, number of holders and waiters]

    async def __aenter__(self) -> None:
        entry = self._table.setdefault(self._key, [asyncio.Lock(), 0])
        if not self._wait and entry[1]:
            raise SessionBusyError(f"session {self._key[1]!r} is busy with another request")
        entry[1] += 1
        self._entry = entry
        try:
            await entry[0].acquire()  # returns at once when entry[1] was 0: try_lock never waits
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._entry[0].release()
        self._leave()

    def _leave(self) -> None:
        self._entry[1] -= 1
        if not self._entry[1]:
            del self._table[self._key]


def _copy_state(state: SlotState, device: torch.device, pin: bool = False) -> SlotState:
    """A copy of ``state`` on ``device`` (in pinned host memory if ``pin``), finished."""
    copy = SlotState(*(torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin).copy_(t)
                       for t in (getattr(state, f) for f in _FIELDS)))
    for t in (state.wkv, copy.wkv):
        if t.is_cuda:  # device copies are asynchronous; the engine may read this on another stream
            torch.cuda.current_stream(t.device).synchronize()
    return copy


async def _relocate(state: SlotState, device: torch.device, pin: bool = False) -> SlotState:
    """``state`` itself if it already lives there, else a copy made in a worker thread."""
    if all(t.device == device and t.is_pinned() == pin for t in (getattr(state, f) for f in _FIELDS)):
        return state
    return await asyncio.to_thread(_copy_state, state, device, pin)


def _encode(state: SlotState) -> bytes:
    return safetensors.torch.save({f: getattr(state, f).contiguous().cpu() for f in _FIELDS})


class SessionStore:
    """The session cache; see the module docstring for the contract."""

    def __init__(self, path: str | Path, fingerprint: str, config: ModelConfig, *,
                 device: torch.device | str = "cpu", l1: int | str | Capacity = 16,
                 l2: int | str | Capacity = 64, max_sessions: int | None = None,
                 max_bytes: int | str | None = None, ttl: float | None = None,
                 flush_interval: float = 1.0, max_key_len: int = 256, max_counters: int = 100_000,
                 clock: Callable[[], float] = time.time):
        self.path, self.fingerprint, self.flush_interval = Path(path), fingerprint, flush_interval
        self.max_counters = max_counters
        self.max_key_len, self.ttl, self.max_sessions, self._clock = max_key_len, ttl, max_sessions, clock
        self.max_bytes = None if max_bytes is None else parse_capacity(max_bytes).limit
        if max_sessions is not None and max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if max_counters < 1:
            raise ValueError("max_counters must be at least 1")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self._pin = device, device.type == "cuda"
        self._capacity = {Tier.L1: parse_capacity(l1), Tier.L2: parse_capacity(l2)}
        self._shapes = {"att_shift": (config.n_layer, config.n_embd),
                        "wkv": (config.n_layer, config.n_head, config.head_size, config.head_size),
                        "ffn_shift": (config.n_layer, config.n_embd)}
        self._sessions: OrderedDict[Key, _Session] = OrderedDict()  # all of them, least recent first
        self._tiers: dict[Tier, OrderedDict[Key, _Session]] = {t: OrderedDict() for t in Tier}
        self._bytes = dict.fromkeys(Tier, 0)
        self._pending: set[Key] = set()  # rows to write (dirty) or to touch (last_used)
        self._doomed: set[Key] = set()   # rows to delete
        self._locks: dict[Key, list] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._mem_lock = asyncio.Lock()  # serializes tier moves, whose copies await a thread
        self._io_lock = asyncio.Lock()   # orders row deletions after the writes they supersede
        self._wake = asyncio.Event()
        self._closing = False
        self._flusher: asyncio.Task | None = None
        self._db: aiosqlite.Connection | None = None
        self._owner = None  # the open lock file while started

    async def __aenter__(self) -> SessionStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Open (or create) the database, index its rows and start the flusher."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._owner = open(self.path.with_name(self.path.name + ".lock"), "w")
        try:
            fcntl.flock(self._owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._owner.close()
            raise StateStoreError(f"{self.path} is in use by another server process; give each server "
                                  "its own database") from None
        self._db = await aiosqlite.connect(self.path)
        # auto_vacuum must precede the first table; it is a no-op on an existing database.
        await self._db.executescript(
            "PRAGMA auto_vacuum=INCREMENTAL; PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
            "PRAGMA journal_size_limit=67108864;"
            "CREATE TABLE IF NOT EXISTS sessions (namespace TEXT NOT NULL, session_id TEXT NOT NULL,"
            " fingerprint TEXT NOT NULL, format INTEGER NOT NULL, size INTEGER NOT NULL,"
            " last_used REAL NOT NULL, meta TEXT, blob BLOB NOT NULL, PRIMARY KEY (namespace, session_id));"
            "CREATE TABLE IF NOT EXISTS counters (namespace TEXT NOT NULL, name TEXT NOT NULL,"
            " value INTEGER NOT NULL, last_used REAL NOT NULL, PRIMARY KEY (namespace, name));"
            "CREATE INDEX IF NOT EXISTS counters_by_use ON counters (last_used);")
        async with self._db.execute("SELECT name FROM pragma_table_info('sessions')") as cursor:
            if ("meta",) not in await cursor.fetchall():  # a database written before metadata existed
                await self._db.execute("ALTER TABLE sessions ADD COLUMN meta TEXT")
        # The blob is the last column, so this scan never reads the blobs' overflow pages.
        async with self._db.execute("SELECT namespace, session_id, size, last_used FROM sessions"
                                    " ORDER BY last_used") as cursor:
            async for ns, sid, size, last_used in cursor:
                self._add(_Session((ns, sid), size, last_used))
        self._expire()
        self._enforce_bounds()
        self._flusher = asyncio.create_task(self._flush_loop())

    async def close(self) -> None:
        """Write every session, shrink the WAL and close the database."""
        self._closing = True
        self._wake.set()
        await self._flusher
        await self.flush()
        await self._db.executescript("PRAGMA wal_checkpoint(TRUNCATE);")
        await self._db.close()
        self._owner.close()  # releases the lock

    # -- sessions --------------------------------------------------------------------------

    async def get(self, namespace: str, session_id: str) -> SlotState | None:
        """The session's state (a copy on the L1 device, the caller's to mutate), now the most
        recent in L1; None if there is none. Raises StateMismatchError, CorruptStateError."""
        key = self._key(namespace, session_id)
        self._expire()
        while True:
            session = self._sessions.get(key)
            if session is None:
                self._counters["misses"] += 1
                return None
            loaded = None if session.state is not None else await self._load(session)
            async with self._mem_lock:
                if session.state is None:
                    session.state = loaded
                if self._sessions.get(key) is not session or session.state is None:
                    continue  # deleted, evicted or rewritten while loading: look again
                self._counters[f"hits_{session.tier}"] += 1
                self._touch(session)
                await self._promote(session)
                state = session.state
            return await asyncio.to_thread(_copy_state, state, state.att_shift.device)

    async def put(self, namespace: str, session_id: str, state: SlotState, meta: str | None = None) -> None:
        """Store a copy of ``state`` (and ``meta``) as the session's newest state (most recent in L1)."""
        key = self._key(namespace, session_id)
        if error := self._shape_error(state):
            raise ValueError(f"state does not fit this model: {error}")
        async with self._mem_lock:
            stored = await asyncio.to_thread(_copy_state, state, self.device)
            session = self._sessions.get(key)
            if session is None:
                session = self._add(_Session(key, state.nbytes(), self._clock()))
            self._bytes[session.tier] += state.nbytes() - session.size
            session.size, session.state, session.dirty, session.meta = state.nbytes(), stored, True, meta
            session.version += 1
            self._touch(session)
            await self._promote(session)
        self._enforce_bounds()

    async def delete(self, namespace: str, session_id: str, prefix: bool = False) -> int:
        """Delete the session (and, with ``prefix``, every ``<session_id>:*`` key) from every
        tier and the database, durably; the number of sessions deleted."""
        key = self._key(namespace, session_id)
        branch = session_id + ":"
        keys = [k for k in self._sessions
                if k == key or (prefix and k[0] == namespace and k[1].startswith(branch))]
        if not keys and not prefix:
            return 0
        for k in keys:
            self._drop(k)
        async with self._io_lock:
            await self._delete_doomed()
            if prefix:
                await self._db.execute("DELETE FROM counters WHERE namespace = ? AND name = ?", key)
            await self._db.commit()
        return len(keys)

    async def get_meta(self, namespace: str, session_id: str) -> str | None:
        """The text stored with the session's state by ``put``; None without one or without the session."""
        key = self._key(namespace, session_id)
        self._expire()
        session = self._sessions.get(key)
        if session is None:
            return None
        if session.dirty:
            return session.meta
        async with self._db.execute("SELECT meta FROM sessions WHERE namespace = ? AND session_id = ?",
                                    key) as cursor:
            row = await cursor.fetchone()
        current = self._sessions.get(key)  # a put or delete may have overtaken the read
        if current is None or current.dirty:
            return current and current.meta
        return row[0] if row else None

    async def next_index(self, namespace: str, name: str) -> int:
        """A new node number for the tree ``name`` (keys ``"<name>:<n>"``), committed before it returns."""
        self._key(namespace, name + ":0")
        async with self._io_lock:
            # Unwritten nodes are in _pending (a flush, which would empty it, waits for _io_lock).
            nodes = [k[1] for k in self._pending if k[0] == namespace]
            async with self._db.execute("SELECT session_id FROM sessions WHERE namespace = ? AND session_id > ?"
                                        " AND session_id < ?", (namespace, name + ":", name + ";")) as cursor:
                nodes += [sid for sid, in await cursor.fetchall()]
            async with self._db.execute("SELECT value FROM counters WHERE namespace = ? AND name = ?",
                                        (namespace, name)) as cursor:
                row = await cursor.fetchone()
            numbers = [int(sid[len(name) + 1:]) for sid in nodes
                       if sid.startswith(name + ":") and _NODE_NUMBER.fullmatch(sid[len(name) + 1:])]
            value = max([row[0] if row else 0, *numbers]) + 1
            if row is None:  # the table grows: keep it within its bounds first
                await self._prune_counters()
            await self._db.execute("INSERT OR REPLACE INTO counters VALUES (?, ?, ?, ?)",
                                   (namespace, name, value, self._clock()))
            await self._db.commit()
        return value

    async def _prune_counters(self) -> None:
        """Drop counters idle past the TTL and the least recent beyond ``max_counters - 1`` (the caller
        holds _io_lock and commits). Safe: next_index never goes below a tree's existing nodes."""
        if self.ttl is not None:
            await self._db.execute("DELETE FROM counters WHERE last_used <= ?", (self._clock() - self.ttl,))
        async with self._db.execute("SELECT COUNT(*) FROM counters") as cursor:
            (count,) = await cursor.fetchone()
        if count >= self.max_counters:
            await self._db.execute("DELETE FROM counters WHERE rowid IN (SELECT rowid FROM counters"
                                   " ORDER BY last_used LIMIT ?)", (count - self.max_counters + 1,))

    async def list(self, namespace: str, offset: int = 0, limit: int = 100) -> tuple[int, list[SessionInfo]]:
        """(total, one page) of the namespace's sessions, most recently used first."""
        if offset < 0 or limit < 0:
            raise ValueError("offset and limit must not be negative")
        self._expire()
        mine = [s for s in reversed(self._sessions.values()) if s.key[0] == namespace]
        return len(mine), [SessionInfo(s.key[1], s.tier, s.last_used, s.size)
                           for s in mine[offset:offset + limit]]

    async def counts(self, namespace: str | None = None) -> dict[str, int]:
        """Sessions per hottest tier, and their total, for one namespace or all."""
        self._expire()
        out = {str(t): sum(namespace is None or k[0] == namespace for k in self._tiers[t]) for t in Tier}
        return {**out, "total": sum(out.values())}

    def stats(self) -> dict[str, int]:
        """Counters since start and current bytes per hottest tier, for metrics."""
        return {**self._counters, **{f"bytes_{t}": self._bytes[t] for t in Tier},
                **{f"sessions_{t}": len(self._tiers[t]) for t in Tier}, "locked_sessions": len(self._locks),
                "waiting_turns": sum(holders - 1 for _, holders in self._locks.values())}

    def lock(self, namespace: str, session_id: str) -> SessionLock:
        """An ``async with`` lock that serializes requests on one session."""
        return SessionLock(self._locks, self._key(namespace, session_id), wait=True)

    def waiting(self, namespace: str, session_id: str) -> int:
        """How many tasks wait for the session's lock (its holder not counted)."""
        entry = self._locks.get(self._key(namespace, session_id))
        return entry[1] - 1 if entry else 0

    def try_lock(self, namespace: str, session_id: str) -> SessionLock:
        """Like ``lock``, but entering raises SessionBusyError instead of waiting."""
        return SessionLock(self._locks, self._key(namespace, session_id), wait=False)

    # -- persistence -----------------------------------------------------------------------

    async def flush(self) -> None:
        """Write every changed session and delete the rows of dropped ones, now."""
        async with self._io_lock:
            self._expire()
            pending, self._pending = self._pending, set()
            try:
                await self._delete_doomed()
                sessions = [s for s in map(self._sessions.get, pending) if s is not None]
                writes = [(s, s.version, s.state, s.meta) for s in sessions if s.dirty]
                blobs = await asyncio.to_thread(lambda: [_encode(state) for _, _, state, _ in writes])
                await self._db.executemany(
                    f"INSERT OR REPLACE INTO sessions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(*s.key, self.fingerprint, FORMAT_VERSION, s.size, s.last_used, meta, blob)
                     for (s, _, _, meta), blob in zip(writes, blobs)])
                await self._db.executemany(
                    "UPDATE sessions SET last_used = ? WHERE namespace = ? AND session_id = ?",
                    [(s.last_used, *s.key) for s in sessions if not s.dirty])
                await self._db.commit()
            except BaseException:
                self._pending |= pending
                raise
            for session, version, _, _ in writes:
                if session.version == version:
                    session.dirty, session.meta = False, None
                    if session.tier is Tier.DISK:
                        session.state = None

    async def _flush_loop(self) -> None:
        while not self._closing:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # a full disk must not stop later passes
                log.exception("writing session states failed; retrying in %.1f s", self.flush_interval)

    async def _delete_doomed(self) -> None:
        """Delete the rows of dropped sessions (the caller holds _io_lock and commits)."""
        doomed, self._doomed = self._doomed, set()
        if not doomed:
            return
        try:
            await self._db.executemany("DELETE FROM sessions WHERE namespace = ? AND session_id = ?", doomed)
        except BaseException:
            self._doomed |= doomed
            raise
        # executescript steps the pragma to completion; execute() would free a single page.
        await self._db.executescript("PRAGMA incremental_vacuum;")

    async def _load(self, session: _Session) -> SlotState | None:
        """Read and decode the session's row; None if the session changed meanwhile."""
        async with self._db.execute("SELECT fingerprint, format, blob FROM sessions"
                                    " WHERE namespace = ? AND session_id = ?", session.key) as cursor:
            row = await cursor.fetchone()
        if session.state is not None or self._sessions.get(session.key) is not session:
            return None  # a put or delete overtook the read; get looks again
        sid = session.key[1]
        try:
            if row is None:
                raise CorruptStateError(f"session {sid!r}: its row is missing from the database")
            fingerprint, fmt, blob = row
            if (fingerprint, fmt) != (self.fingerprint, FORMAT_VERSION):
                raise StateMismatchError(sid, f"{self.fingerprint} (format {FORMAT_VERSION})",
                                         f"{fingerprint} (format {fmt})")
            return await asyncio.to_thread(self._decode, sid, blob)
        except StateMismatchError:
            self._counters["mismatched"] += 1
            raise
        except CorruptStateError as exc:
            log.error("dropping corrupt session %r of namespace %r: %s", sid, session.key[0], exc)
            self._counters["corrupt"] += 1
            self._drop(session.key)
            raise

    def _decode(self, session_id: str, blob: bytes) -> SlotState:
        try:
            tensors = safetensors.torch.load(blob)
            state = SlotState(**{f: tensors.pop(f) for f in _FIELDS})
        except Exception as exc:  # any failure to parse untrusted bytes is corruption
            raise CorruptStateError(f"session {session_id!r}: unreadable state ({exc})") from exc
        if error := self._shape_error(state):
            raise StateMismatchError(session_id, f"{self.fingerprint} with shapes {self._shapes}",
                                     f"{self.fingerprint} with {error}")
        return state

    # -- bookkeeping (synchronous: no other coroutine runs in between) ---------------------

    def _key(self, namespace: str, session_id: str) -> Key:
        for name, value in (("namespace", namespace), ("session id", session_id)):
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string")
            if len(value) > self.max_key_len:
                raise ValueError(f"{name} is longer than {self.max_key_len} characters")
            if _CONTROL.search(value):
                raise ValueError(f"{name} contains control characters")
            try:
                value.encode()
            except UnicodeEncodeError:  # a lone surrogate from JSON would fail every later write
                raise ValueError(f"{name} is not valid Unicode") from None
        return namespace, session_id

    def _shape_error(self, state: SlotState) -> str | None:
        for name, shape in self._shapes.items():
            t = getattr(state, name)
            if tuple(t.shape) != shape or not t.is_floating_point():
                return f"{name} is {tuple(t.shape)} {t.dtype}, expected {shape} floating point"
        return None

    def _add(self, session: _Session) -> _Session:
        self._sessions[session.key] = session
        self._tiers[session.tier][session.key] = session
        self._bytes[session.tier] += session.size
        return session

    def _drop(self, key: Key) -> None:
        session = self._sessions.pop(key)
        del self._tiers[session.tier][key]
        self._bytes[session.tier] -= session.size
        self._pending.discard(key)
        self._doomed.add(key)
        self._wake.set()

    def _touch(self, session: _Session) -> None:
        session.last_used = self._clock()
        self._sessions.move_to_end(session.key)
        self._tiers[session.tier].move_to_end(session.key)
        self._pending.add(session.key)

    def _set_tier(self, session: _Session, tier: Tier) -> None:
        del self._tiers[session.tier][session.key]
        self._bytes[session.tier] -= session.size
        session.tier = tier
        self._add(session)

    async def _promote(self, session: _Session) -> None:
        """Make ``session`` the most recent in L1, then demote what overflows L1 and L2 (the
        caller holds _mem_lock; copies between devices run in a thread)."""
        if session.tier is not Tier.L1:
            self._set_tier(session, Tier.L1)
        session.state = await _relocate(session.state, self.device)
        for upper, lower in ((Tier.L1, Tier.L2), (Tier.L2, Tier.DISK)):
            tier_of = self._tiers[upper]
            while tier_of and self._capacity[upper].exceeded(len(tier_of), self._bytes[upper]):
                victim = next(iter(tier_of.values()))
                self._set_tier(victim, lower)
                self._counters["demotions"] += 1
                if lower is Tier.L2:
                    victim.state = await _relocate(victim.state, torch.device("cpu"), self._pin)
                elif victim.dirty:
                    self._wake.set()  # its state stays in RAM until the flusher has written it
                else:
                    victim.state = None

    def _expire(self) -> None:
        if self.ttl is None:
            return
        deadline = self._clock() - self.ttl
        while self._sessions and next(iter(self._sessions.values())).last_used <= deadline:
            self._drop(next(iter(self._sessions)))
            self._counters["expired"] += 1

    def _enforce_bounds(self) -> None:
        while len(self._sessions) > 1 and (
                (self.max_sessions is not None and len(self._sessions) > self.max_sessions)
                or (self.max_bytes is not None and sum(self._bytes.values()) > self.max_bytes)):
            self._drop(next(iter(self._sessions)))
            self._counters["evictions"] += 1
