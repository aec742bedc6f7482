"""The session store: tiers, durability (including a SIGKILL), integrity, bounds, tenancy, locks."""
from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infer.random_model import make_config  # noqa: E402
from infer.state import SlotState  # noqa: E402
import state_pool  # noqa: E402
from state_pool import (Capacity, CorruptStateError, SessionBusyError, SessionStore,  # noqa: E402
                        StateMismatchError, StateStoreError, parse_capacity)

pytestmark = pytest.mark.anyio
CONFIG = make_config(n_layer=2, n_embd=128)  # 2 heads of 64
STATE_BYTES = 2 * 128 * 4 * 2 + 2 * 2 * 64 * 64 * 4  # fp32 shifts and wkv


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def random_state(seed: int, dtype: torch.dtype = torch.float32, wkv_dtype: torch.dtype = torch.float32) -> SlotState:
    gen = torch.Generator().manual_seed(seed)
    return SlotState(att_shift=torch.randn(2, 128, generator=gen).to(dtype),
                     wkv=torch.randn(2, 2, 64, 64, generator=gen).to(wkv_dtype),
                     ffn_shift=torch.randn(2, 128, generator=gen).to(dtype))


def open_store(path: Path, fingerprint: str = "model-A", config=CONFIG, **options) -> SessionStore:
    options.setdefault("flush_interval", 3600.0)  # tests that need the flusher set their own
    return SessionStore(path, fingerprint, config, **options)


def assert_same(got: SlotState | None, want: SlotState) -> None:
    assert got is not None
    for name in ("att_shift", "wkv", "ffn_shift"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def rows(path: Path) -> dict[tuple[str, str], float]:
    """(namespace, session_id) -> last_used, read by a connection of its own."""
    with sqlite3.connect(path) as db:
        return {(ns, sid): t for ns, sid, t in db.execute("SELECT namespace, session_id, last_used FROM sessions")}


def encode(state: SlotState) -> bytes:
    """A row's blob, written by hand: the format is safetensors with the three fields."""
    return safetensors.torch.save({name: getattr(state, name) for name in ("att_shift", "wkv", "ffn_shift")})


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_parse_capacity():
    assert parse_capacity("64") == parse_capacity(64) == Capacity(64)
    assert parse_capacity("8GB") == Capacity(8 * 10**9, in_bytes=True)
    assert parse_capacity(" 512 MiB ") == Capacity(512 * 2**20, in_bytes=True)
    assert parse_capacity("1.5GiB") == Capacity(3 * 2**29, in_bytes=True)
    assert parse_capacity("100b") == Capacity(100, in_bytes=True)
    for bad in ("", "abc", "-1", "1.5", "8 GBs", "8XB"):
        with pytest.raises(ValueError):
            parse_capacity(bad)


@pytest.mark.parametrize("dtype, wkv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float16, torch.float16)])
async def test_round_trip_is_bit_exact_in_memory_and_on_disk(tmp_path, dtype, wkv_dtype):
    state = random_state(1, dtype, wkv_dtype)
    async with open_store(tmp_path / "s.db") as store:
        await store.put("ns", "a", state)
        state.wkv.zero_()  # the store keeps its own copy
        got = await store.get("ns", "a")
        assert_same(got, random_state(1, dtype, wkv_dtype))
        got.att_shift.zero_()  # and hands out copies
        assert_same(await store.get("ns", "a"), random_state(1, dtype, wkv_dtype))
    async with open_store(tmp_path / "s.db") as store:
        assert_same(await store.get("ns", "a"), random_state(1, dtype, wkv_dtype))
        assert store.stats()["hits_disk"] == 1


async def tiers(store: SessionStore, ns: str = "ns") -> dict[str, str]:
    total, page = await store.list(ns, limit=1000)
    assert total == len(page) == len({info.session_id for info in page})  # each session once
    return {info.session_id: info.tier for info in page}


async def test_tiers_demote_lru_and_promote_on_get(tmp_path):
    async with open_store(tmp_path / "s.db", l1=2, l2="2") as store:
        for i in range(3):
            await store.put("ns", f"s{i}", random_state(i))
        assert await tiers(store) == {"s0": "l2", "s1": "l1", "s2": "l1"}
        for i in range(3, 5):
            await store.put("ns", f"s{i}", random_state(i))
        assert await tiers(store) == {"s0": "disk", "s1": "l2", "s2": "l2", "s3": "l1", "s4": "l1"}
        assert await store.counts() == {"l1": 2, "l2": 2, "disk": 1, "total": 5}

        await store.flush()  # now s0 lives only in its row: get reads what the row holds
        with sqlite3.connect(tmp_path / "s.db") as conn:
            conn.execute("UPDATE sessions SET blob = ? WHERE session_id = 's0'", (encode(random_state(99)),))
        assert_same(await store.get("ns", "s0"), random_state(99))
        assert await tiers(store) == {"s0": "l1", "s1": "disk", "s2": "l2", "s3": "l2", "s4": "l1"}
        assert_same(await store.get("ns", "s2"), random_state(2))
        assert_same(await store.get("ns", "s2"), random_state(2))
        assert await tiers(store) == {"s0": "l1", "s1": "disk", "s2": "l1", "s3": "l2", "s4": "l2"}
        assert await store.get("ns", "missing") is None
        assert await store.counts() == {"l1": 2, "l2": 2, "disk": 1, "total": 5}
        stats = store.stats()
        assert (stats["hits_disk"], stats["hits_l2"], stats["hits_l1"], stats["misses"]) == (1, 1, 1, 1)
        assert stats["bytes_l1"] == stats["bytes_l2"] == 2 * STATE_BYTES
        assert stats["bytes_disk"] == STATE_BYTES


async def test_byte_capacities(tmp_path):
    async with open_store(tmp_path / "s.db", l1=f"{STATE_BYTES}B", l2=f"{2 * STATE_BYTES + 1}B") as store:
        for i in range(4):
            await store.put("ns", f"s{i}", random_state(i))
        assert await store.counts() == {"l1": 1, "l2": 2, "disk": 1, "total": 4}


async def test_close_persists_everything_and_restart_restores_it(tmp_path):
    clock = Clock()
    async with open_store(tmp_path / "s.db", l1=2, l2=2, clock=clock) as store:
        for i in range(6):
            clock.now += 1
            await store.put(f"ns{i % 2}", f"s{i}", random_state(i))
        clock.now += 1
        await store.get("ns0", "s0")  # the most recent use survives the restart too
        before = [await store.list(ns) for ns in ("ns0", "ns1")]
    assert len(rows(tmp_path / "s.db")) == 6
    async with open_store(tmp_path / "s.db", l1=2, l2=2, clock=clock) as store:
        assert await store.counts() == {"l1": 0, "l2": 0, "disk": 6, "total": 6}
        after = [await store.list(ns) for ns in ("ns0", "ns1")]
        assert [[(i.session_id, i.last_used) for i in page] for _, page in after] == \
               [[(i.session_id, i.last_used) for i in page] for _, page in before]
        for i in range(6):
            assert_same(await store.get(f"ns{i % 2}", f"s{i}"), random_state(i))


async def test_flusher_writes_without_close(tmp_path):
    store = open_store(tmp_path / "s.db", flush_interval=0.05)
    await store.start()
    try:
        await store.put("ns", "a", random_state(1))
        for _ in range(200):  # the row appears once the flusher has run; no flush() or close()
            if ("ns", "a") in rows(tmp_path / "s.db"):
                break
            await asyncio.sleep(0.05)
        assert ("ns", "a") in rows(tmp_path / "s.db")
    finally:
        await store.close()


async def test_failed_write_pass_is_retried(tmp_path, monkeypatch):
    def disk_full(state: SlotState) -> bytes:
        raise OSError("disk full")

    async with open_store(tmp_path / "s.db") as store:
        await store.put("ns", "a", random_state(1))
        with monkeypatch.context() as patch:
            patch.setattr(state_pool, "_encode", disk_full)
            with pytest.raises(OSError):
                await store.flush()
        assert rows(tmp_path / "s.db") == {}
        await store.flush()
        assert set(rows(tmp_path / "s.db")) == {("ns", "a")}


KILLED_CHILD = """
import asyncio, os, signal, sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/test"]
from test_state_pool import open_store, random_state

async def main():
    store = open_store(sys.argv[1], flush_interval=0.05)
    await store.start()
    await store.put("ns", "kept", random_state(7))
    await asyncio.sleep(1.0)  # twenty flush intervals
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_session_survives_sigkill_after_flush_interval(tmp_path):
    db = tmp_path / "s.db"
    child = subprocess.run([sys.executable, "-c", KILLED_CHILD, str(db), str(ROOT)], timeout=120,
                           capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr

    async def reopen() -> None:
        async with open_store(db) as store:
            assert_same(await store.get("ns", "kept"), random_state(7))
    asyncio.run(reopen())


async def test_state_of_another_model_is_refused_and_kept(tmp_path):
    async with open_store(tmp_path / "s.db") as store:
        await store.put("ns", "a", random_state(1))
    async with open_store(tmp_path / "s.db", fingerprint="model-B") as store:
        with pytest.raises(StateMismatchError, match="model-A") as err:
            await store.get("ns", "a")
        assert "model-B" in str(err.value) and store.stats()["mismatched"] == 1
        assert (await store.counts())["total"] == 1  # still valid for model A
        await store.put("ns", "a", random_state(2))  # a new turn from scratch replaces it
        assert_same(await store.get("ns", "a"), random_state(2))


async def test_state_of_another_shape_is_refused(tmp_path):
    async with open_store(tmp_path / "s.db") as store:
        await store.put("ns", "a", random_state(1))
    async with open_store(tmp_path / "s.db", config=make_config(n_layer=3, n_embd=128)) as store:
        with pytest.raises(StateMismatchError, match="att_shift"):
            await store.get("ns", "a")
        with pytest.raises(ValueError, match="does not fit"):
            await store.put("ns", "b", random_state(1))


CORRUPTIONS = {
    "garbage": lambda blob: b"garbage",
    "huge header length": lambda blob: b"\xff" * 64,
    "truncated": lambda blob: blob[:1000],
    "missing tensor": lambda blob: safetensors.torch.save({"att_shift": torch.zeros(2, 128)}),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
async def test_corrupt_row_is_reported_once_and_dropped(tmp_path, corrupt):
    db = tmp_path / "s.db"
    async with open_store(db) as store:
        await store.put("ns", "bad", random_state(1))
        await store.put("ns", "good", random_state(2))
    with sqlite3.connect(db) as conn:
        (blob,), = conn.execute("SELECT blob FROM sessions WHERE session_id = 'bad'")
        conn.execute("UPDATE sessions SET blob = ? WHERE session_id = 'bad'", (corrupt(blob),))
    async with open_store(db) as store:
        with pytest.raises(CorruptStateError, match="bad"):
            await store.get("ns", "bad")
        assert await store.get("ns", "bad") is None
        assert store.stats()["corrupt"] == 1
        assert await tiers(store) == {"good": "disk"}
        assert_same(await store.get("ns", "good"), random_state(2))
        await store.put("ns", "bad", random_state(3))
        assert_same(await store.get("ns", "bad"), random_state(3))
    async with open_store(db) as store:
        assert_same(await store.get("ns", "bad"), random_state(3))


async def test_namespaces_are_isolated(tmp_path):
    async with open_store(tmp_path / "s.db") as store:
        await store.put("alice", "s", random_state(1))
        assert await store.get("bob", "s") is None
        assert await store.list("bob") == (0, [])
        assert await store.delete("bob", "s", prefix=True) == 0
        assert (await store.counts("bob"))["total"] == 0
        await store.put("bob", "s", random_state(2))
        assert_same(await store.get("alice", "s"), random_state(1))
        assert_same(await store.get("bob", "s"), random_state(2))
        assert await store.delete("bob", "s") == 1
        assert_same(await store.get("alice", "s"), random_state(1))
        assert (await store.counts("alice"))["total"] == (await store.counts())["total"] == 1


async def test_delete_with_prefix_removes_branches_durably(tmp_path):
    names = ["c", "c:1", "c:2", "c:10", "cx", "c2:1"]
    async with open_store(tmp_path / "s.db", l1=1, l2=1) as store:
        for i, sid in enumerate(names):
            await store.put("ns", sid, random_state(i))
        await store.put("other", "c:1", random_state(9))
        await store.flush()
        assert await store.delete("ns", "c:2") == 1
        assert await store.delete("ns", "c:2") == 0
        assert await store.delete("ns", "c", prefix=True) == 3
        assert set(await tiers(store)) == {"cx", "c2:1"}
        assert set(rows(tmp_path / "s.db")) == {("ns", "cx"), ("ns", "c2:1"), ("other", "c:1")}
    async with open_store(tmp_path / "s.db") as store:
        assert set(await tiers(store)) == {"cx", "c2:1"}


async def test_list_pages_most_recent_first(tmp_path):
    clock = Clock()
    async with open_store(tmp_path / "s.db", clock=clock) as store:
        for i in range(7):
            clock.now += 1
            await store.put("ns", f"s{i}", random_state(i))
        total, page = await store.list("ns", offset=0, limit=3)
        assert total == 7 and [i.session_id for i in page] == ["s6", "s5", "s4"]
        assert page[0].last_used == clock.now and page[0].size_bytes == STATE_BYTES
        assert [i.session_id for i in (await store.list("ns", offset=6, limit=3))[1]] == ["s0"]
        assert await store.list("ns", offset=10, limit=3) == (7, [])
        with pytest.raises(ValueError):
            await store.list("ns", offset=-1)


async def test_max_sessions_evicts_least_recently_used(tmp_path):
    async with open_store(tmp_path / "s.db", l1=1, l2=1, max_sessions=3) as store:
        for i in range(3):
            await store.put("ns", f"s{i}", random_state(i))
        await store.get("ns", "s0")
        await store.put("ns", "s3", random_state(3))
        assert set(await tiers(store)) == {"s0", "s2", "s3"}
        assert store.stats()["evictions"] == 1
    assert set(rows(tmp_path / "s.db")) == {("ns", "s0"), ("ns", "s2"), ("ns", "s3")}
    async with open_store(tmp_path / "s.db", max_sessions=2) as store:  # a tighter bound on restart
        assert set(await tiers(store)) == {"s0", "s3"}


async def test_max_bytes_evicts_least_recently_used(tmp_path):
    async with open_store(tmp_path / "s.db", max_bytes="210KB") as store:  # three states fit
        for i in range(5):
            await store.put("ns", f"s{i}", random_state(i))
        assert set(await tiers(store)) == {"s2", "s3", "s4"}
    assert len(rows(tmp_path / "s.db")) == 3


async def test_ttl_expires_sessions_from_every_tier(tmp_path):
    clock, db = Clock(), tmp_path / "s.db"
    async with open_store(db, ttl=60, clock=clock, l1=1, l2=1) as store:
        await store.put("ns", "old", random_state(1))
        await store.flush()
        clock.now += 30
        await store.put("ns", "new", random_state(2))
        clock.now += 40
        assert set(await tiers(store)) == {"new"}
        assert await store.get("ns", "old") is None
        assert store.stats()["expired"] == 1
        await store.flush()
        assert set(rows(db)) == {("ns", "new")}
    clock.now += 100
    async with open_store(db, ttl=60, clock=clock) as store:
        assert await store.counts() == {"l1": 0, "l2": 0, "disk": 0, "total": 0}
    assert rows(db) == {}


async def test_deleted_space_is_reclaimed(tmp_path):
    db = tmp_path / "s.db"
    async with open_store(db) as store:
        for i in range(20):
            await store.put("ns", f"s{i}", random_state(i))
        await store.flush()
        with sqlite3.connect(db) as conn:
            full = conn.execute("PRAGMA page_count").fetchone()[0]
        for i in range(20):
            await store.delete("ns", f"s{i}")
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
        assert conn.execute("PRAGMA page_count").fetchone()[0] < full / 10


async def test_many_coroutines_at_once(tmp_path):
    async with open_store(tmp_path / "s.db", l1=3, l2=3, flush_interval=0.01) as store:
        await store.put("ns", "shared", random_state(0))

        async def client(i: int) -> None:
            for turn in range(4):
                await store.put("ns", f"s{i}", random_state(100 * i + turn))
                assert_same(await store.get("ns", f"s{i}"), random_state(100 * i + turn))
                assert_same(await store.get("ns", "shared"), random_state(0))
        await asyncio.gather(*(client(i) for i in range(20)), store.flush(), store.flush())
        assert (await store.counts())["total"] == 21
        for i in range(20):
            assert_same(await store.get("ns", f"s{i}"), random_state(100 * i + 3))
    async with open_store(tmp_path / "s.db") as store:
        for i in range(20):
            assert_same(await store.get("ns", f"s{i}"), random_state(100 * i + 3))


async def test_session_lock_serializes_read_modify_write(tmp_path):
    async with open_store(tmp_path / "s.db") as store:
        await store.put("ns", "n", SlotState(torch.zeros(2, 128), torch.zeros(2, 2, 64, 64), torch.zeros(2, 128)))

        async def turn() -> None:
            async with store.lock("ns", "n"):
                state = await store.get("ns", "n")
                state.wkv += 1
                await asyncio.sleep(0)  # without the lock, the other turns read the same state here
                await store.put("ns", "n", state)
        await asyncio.gather(*(turn() for _ in range(10)))
        assert torch.all((await store.get("ns", "n")).wkv == 10)
        assert store.stats()["locked_sessions"] == 0


async def test_try_lock_reports_busy_and_locks_do_not_leak(tmp_path):
    async with open_store(tmp_path / "s.db") as store:
        async with store.lock("ns", "n"):
            with pytest.raises(SessionBusyError):
                async with store.try_lock("ns", "n"):
                    pass
            async with store.try_lock("ns", "other"), store.try_lock("other-ns", "n"):
                assert store.stats()["locked_sessions"] == 3
            waiter = asyncio.create_task(store.lock("ns", "n").__aenter__())
            await asyncio.sleep(0)
            waiter.cancel()  # a request that gives up while waiting
            with pytest.raises(asyncio.CancelledError):
                await waiter
        assert store.stats()["locked_sessions"] == 0
        async with store.try_lock("ns", "n"):
            pass
        assert store.stats()["locked_sessions"] == 0


@pytest.mark.parametrize("sid", ["x" * 257, "a\x00b", "line\nbreak", "del\x7f", "\x85", "\ud800", 42])
async def test_invalid_session_ids_are_rejected(tmp_path, sid):
    async with open_store(tmp_path / "s.db") as store:
        for call in (lambda: store.get("ns", sid), lambda: store.put("ns", sid, random_state(1)),
                     lambda: store.delete("ns", sid)):
            with pytest.raises(ValueError):
                await call()
        with pytest.raises(ValueError):
            store.lock("ns", sid)
        await store.put("ns", "x" * 256, random_state(1))  # the longest allowed id
        await store.put("ns", "", random_state(1))  # "" is a valid (shared) key upstream
        assert (await store.counts())["total"] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_tiers(tmp_path):
    async with open_store(tmp_path / "s.db", device="cuda", l1=1, l2=1) as store:
        for i in range(3):
            await store.put("ns", f"s{i}", random_state(i, torch.bfloat16))
        assert await tiers(store) == {"s0": "disk", "s1": "l2", "s2": "l1"}
        await store.flush()
        for i in (0, 1, 2, 0):
            got = await store.get("ns", f"s{i}")
            assert got.wkv.device.type == "cuda"
            got = SlotState(got.att_shift.cpu(), got.wkv.cpu(), got.ffn_shift.cpu())
            assert_same(got, random_state(i, torch.bfloat16))


async def test_meta_lives_and_dies_with_the_state(tmp_path):
    db = tmp_path / "s.db"
    async with open_store(db, l1=1, l2=1) as store:
        await store.put("ns", "r", random_state(1), meta='{"id": "r"}')
        assert await store.get_meta("ns", "r") == '{"id": "r"}'  # unwritten: from RAM
        await store.flush()
        assert await store.get_meta("ns", "r") == '{"id": "r"}'  # written: from the row
        for i in range(3):  # push it to disk
            await store.put("ns", f"x{i}", random_state(i))
        await store.flush()
        assert await store.get_meta("ns", "r") == '{"id": "r"}'
        assert await store.get_meta("ns", "x0") is None and await store.get_meta("other", "r") is None
    async with open_store(db) as store:
        assert await store.get_meta("ns", "r") == '{"id": "r"}'
        await store.put("ns", "r", random_state(2))  # a put without meta clears it
        assert await store.get_meta("ns", "r") is None
        await store.delete("ns", "x0")
        assert await store.get_meta("ns", "x0") is None


async def test_node_numbers_are_durable_and_never_reused(tmp_path):
    db = tmp_path / "s.db"
    async with open_store(db) as store:
        assert [await store.next_index("ns", "t") for _ in range(3)] == [1, 2, 3]
        assert await store.next_index("other", "t") == 1
        assert await store.next_index("ns", "t:1") == 1  # another tree
        await store.put("ns", "u:7", random_state(1))   # unwritten nodes count
        await store.put("ns", "u:x", random_state(1))   # not a node number
        assert await store.next_index("ns", "u") == 8
        assert await store.next_index("ns", "t") == 4
        await store.put("ns", "t:4", random_state(4))
        await store.delete("ns", "t:4")                  # its number is not handed out again
    async with open_store(db) as store:                  # nor after a restart
        assert await store.next_index("ns", "t") == 5
        await store.put("ns", "t:40", random_state(4))   # nor below an existing node
        await store.flush()
        assert await store.next_index("ns", "t") == 41
        await store.delete("ns", "t", prefix=True)       # the whole tree: numbering starts again
        assert await store.next_index("ns", "t") == 1


async def test_counters_are_bounded(tmp_path):
    clock = Clock()
    async with open_store(tmp_path / "s.db", ttl=60, max_counters=3, clock=clock) as store:
        for name in ("a", "b", "c"):
            clock.now += 1
            await store.next_index("ns", name)
        await store.put("ns", "a:1", random_state(1))
        clock.now += 1
        await store.next_index("ns", "d")                # four counters: the oldest goes
        assert await store.next_index("ns", "a") == 2     # but never below its nodes
        with sqlite3.connect(tmp_path / "s.db") as conn:
            assert {n for n, in conn.execute("SELECT name FROM counters")} == {"a", "c", "d"}
        await store.next_index("ns", "c")
        clock.now += 100
        await store.next_index("ns", "e")                # the others idled past the TTL
        with sqlite3.connect(tmp_path / "s.db") as conn:
            assert {n for n, in conn.execute("SELECT name FROM counters")} == {"e"}


async def test_database_without_meta_column_is_upgraded(tmp_path):
    db = tmp_path / "s.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE sessions (namespace TEXT NOT NULL, session_id TEXT NOT NULL, fingerprint TEXT"
                     " NOT NULL, format INTEGER NOT NULL, size INTEGER NOT NULL, last_used REAL NOT NULL,"
                     " blob BLOB NOT NULL, PRIMARY KEY (namespace, session_id))")
        conn.execute("INSERT INTO sessions VALUES ('ns', 'old', 'model-A', 1, ?, 1.0, ?)",
                     (STATE_BYTES, encode(random_state(1))))
    async with open_store(db) as store:
        assert_same(await store.get("ns", "old"), random_state(1))
        assert await store.get_meta("ns", "old") is None
        await store.put("ns", "new", random_state(2), meta="m")
    async with open_store(db) as store:
        assert await store.get_meta("ns", "new") == "m"


async def test_one_store_per_database(tmp_path):
    async with open_store(tmp_path / "s.db"):
        with pytest.raises(StateStoreError, match="another server process"):
            await open_store(tmp_path / "s.db").start()
    async with open_store(tmp_path / "s.db"):  # free again once closed
        pass
