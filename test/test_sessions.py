"""The session service without HTTP: namespaces from credentials, turns that store only when they end
normally, the busy policies, tree branches, and the Responses' follow-ups."""
from __future__ import annotations

import asyncio

import pytest

from infer.engine import RowFinished
from infer.sessions import PUBLIC_NAMESPACE, SessionNotFoundError, SessionService, credential_namespace
from infer.state import SlotState
from state_pool import SessionBusyError, SessionStore
from test_state_pool import CONFIG, assert_same, random_state

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def store(tmp_path):
    async with SessionStore(tmp_path / "s.db", "model-A", CONFIG, flush_interval=3600) as store:
        yield store


def finished(reason: str, state: SlotState | None) -> RowFinished:
    return RowFinished(0, reason, prompt_tokens=3, completion_tokens=2, state=state)


def test_credential_namespace():
    a, b = credential_namespace("secret-a"), credential_namespace("secret-b")
    assert a == credential_namespace("secret-a") and a != b
    assert "secret" not in a and a.startswith("key-")
    assert credential_namespace(None) == PUBLIC_NAMESPACE


async def test_namespaces_do_not_see_each_other(store):
    service = SessionService(store)
    alice, bob = credential_namespace("alice-pw"), credential_namespace("bob-pw")
    turn = await service.continue_session(alice, "chat")
    await turn.finish(finished("stop", random_state(1)))
    turn = await service.continue_session(bob, "chat")
    assert turn.state is None  # same id, other tenant: a new session
    await turn.release()
    assert (await store.list(bob))[0] == 0 and await service.delete(bob, "chat") == 0
    assert (await service.follow(alice, "chat", "next")).state is not None
    with pytest.raises(SessionNotFoundError):
        await service.follow(bob, "chat", "next")
    assert await service.delete(alice, "chat") == 1


@pytest.mark.parametrize("reason", ["cancelled", "error"])
async def test_only_normal_ends_are_stored(store, reason):
    service = SessionService(store)
    turn = await service.continue_session("ns", "s")
    await turn.finish(finished("length", random_state(1)))
    assert turn.saved_as == "s"
    turn = await service.continue_session("ns", "s")
    assert_same(turn.state, random_state(1))
    await turn.finish(finished(reason, random_state(2) if reason == "cancelled" else None))
    assert turn.saved_as is None
    assert_same(await store.get("ns", "s"), random_state(1))
    assert store.stats()["locked_sessions"] == 0


async def test_wait_policy_serializes_turns(store):
    service = SessionService(store, busy="wait")
    first = await service.continue_session("ns", "s")
    second = asyncio.create_task(service.continue_session("ns", "s"))
    while store.stats()["waiting_turns"] == 0:
        await asyncio.sleep(0)
    assert not second.done()
    await first.finish(finished("stop", random_state(5)))
    turn = await second
    assert_same(turn.state, random_state(5))  # it started from the first turn's result
    await turn.release()
    assert await service.delete("ns", "s") == 1


async def test_waiting_requests_are_bounded(store):
    service = SessionService(store, busy="wait", max_waiting=2)
    first = await service.continue_session("ns", "s")
    waiting = [asyncio.create_task(service.continue_session("ns", "s")) for _ in range(2)]
    while store.waiting("ns", "s") < 2:
        await asyncio.sleep(0)
    with pytest.raises(SessionBusyError, match="2 requests waiting"):
        await service.continue_session("ns", "s")
    await first.release()
    for task in waiting:
        await (await task).release()
    assert store.stats()["locked_sessions"] == 0


async def test_reject_policy_answers_busy(store):
    service = SessionService(store, busy="reject")
    turn = await service.continue_session("ns", "s")
    with pytest.raises(SessionBusyError):
        await service.continue_session("ns", "s")
    with pytest.raises(SessionBusyError):
        await service.delete("ns", "s")
    assert (await service.continue_session("ns", "other")).state is None
    await turn.release()
    await turn.release()  # idempotent
    await (await service.continue_session("ns", "s")).release()


async def test_branches_get_new_nodes(store):
    service = SessionService(store)
    root = await service.branch("ns", "tree", 0)
    assert root.state is None
    await root.finish(finished("stop", random_state(1)))
    assert (root.node, root.saved_as) == (1, "tree:1")
    for expected in (2, 3):  # two branches of node 1
        turn = await service.branch("ns", "tree", 1)
        assert_same(turn.state, random_state(1))
        await turn.finish(finished("length", random_state(expected)))
        assert turn.node == expected
    failed = await service.branch("ns", "tree", 3)
    await failed.finish(finished("error", None))
    assert failed.node is None
    with pytest.raises(SessionNotFoundError):
        await service.branch("ns", "tree", 9)
    assert store.stats()["locked_sessions"] == 0
    assert await service.delete("ns", "tree", prefix=True) == 3


async def test_follow_stores_the_response_with_its_object(store):
    service = SessionService(store)
    turn = await service.follow("ns", None, "resp_1")
    assert turn.state is None
    await turn.finish(finished("stop", random_state(1)), meta='{"id": "resp_1"}')
    turn = await service.follow("ns", "resp_1", "resp_2")
    assert_same(turn.state, random_state(1))
    await turn.finish(finished("stop", random_state(2)), meta='{"id": "resp_2"}')
    assert await store.get_meta("ns", "resp_1") == '{"id": "resp_1"}'  # responses are never modified
    assert_same(await store.get("ns", "resp_1"), random_state(1))


async def test_failed_open_releases_the_lock(store):
    service = SessionService(store)
    with pytest.raises(ValueError):
        await service.continue_session("ns", "bad\x00id")
    turn = await service.continue_session("ns", "s")

    async def fail() -> None:
        async with turn.until_started():
            raise RuntimeError("tokenizing failed")
    with pytest.raises(RuntimeError):
        await fail()
    assert store.stats()["locked_sessions"] == 0
