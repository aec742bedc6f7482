"""Session-state routes on live servers (tiny random model, CPU fp32): conversations continued through
the stored state give exactly the tokens of feeding the whole token sequence at once; tiers and
counts, restarts, another model's and corrupt states, tenants, concurrent and cancelled turns,
branches, limits, and the prefix cache over HTTP."""
from __future__ import annotations

import concurrent.futures
import sqlite3

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from infer.api.chat_template import TURN_STOPS, render_chat
from infer.api.context import ServerContext, ServerLimits
from infer.api.schemas import BatchCompletion, ChatMessage, MultiStateCompletion, StateStatus
from infer.api.server import create_app
from infer.checkpoint import DictSource
from infer.engine import Engine
from infer.fingerprint import fingerprint
from infer.engine import visible_byte_count
from infer.model import RWKV7
from infer.random_model import make_config, random_state_dict
from infer.runner import ModelRunner
from infer.tokenizer import load_world_tokenizer
from test_api_support import LiveServer, parse_sse, reference, wait_until

GREEDY = {"temperature": 0, "alpha_presence": 0, "alpha_frequency": 0, "alpha_decay": 1.0, "stop_tokens": []}
FIRST = "User: Tell me about the sea.\n\nAssistant:"
SECOND = "User: And the mountains?\n\nAssistant:"
THIRD = "User: Thanks. One more thing.\n\nAssistant:"


def random_model(seed: int) -> tuple[RWKV7, str]:
    sd = random_state_dict(make_config(2, 128, 65536), seed=seed, dtype=torch.float32)
    return RWKV7.from_state_dict(dict(sd), device="cpu"), fingerprint(DictSource(sd))


@pytest.fixture(scope="module")
def model_a() -> tuple[RWKV7, str]:
    return random_model(21)


@pytest.fixture(scope="module")
def model(model_a) -> RWKV7:
    return model_a[0]


@pytest.fixture(scope="module")
def server(model):
    """For requests that store nothing."""
    with LiveServer(model) as live:
        yield live


class Conversation:
    """The token sequence a session's state has seen, and what the engine makes of more of it."""

    def __init__(self, model: RWKV7, server: LiveServer):
        self.model, self.tokenizer = model, server.tokenizer
        self.tokens: list[int] = []

    def expect(self, text: str, n: int, stop: tuple[str, ...] = (), **sampling) -> str:
        """Visible text of ``text`` fed after everything so far (a new paragraph on a continuation);
        the reply's tokens join the sequence."""
        prompt = self.tokens + self.tokenizer.encode(("\n\n" if self.tokens else "") + text)
        tokens, visible, reason = reference(self.model, prompt, n, stop=stop, **({"temperature": 0} | sampling))
        if reason == "length":  # the state has seen every sampled token
            self.tokens = prompt + tokens
            return visible
        # After a stop string the state ends at the visible text: the reply's tokens that it covers,
        # then the rest of it re-encoded (the stop string may start inside a token); never the stop.
        raw = self.tokenizer.decode_bytes(tokens)
        data, kept = raw[:visible_byte_count(raw, len(visible))], []  # invalid bytes stay as generated
        for token in tokens[:-1]:
            piece = self.tokenizer.decode_bytes([token])
            if not data.startswith(self.tokenizer.decode_bytes(kept) + piece):
                break
            kept.append(token)
        self.tokens = prompt + kept + self.tokenizer.encode_bytes(data[len(self.tokenizer.decode_bytes(kept)):])
        return visible


def turn(client: httpx.Client, session: str | None, text: str, n: int = 6, status: int = 200, **extra) -> dict:
    r = client.post("/state/chat/completions", json={"contents": [text], "session_id": session, "max_tokens": n,
                                                     **GREEDY, **extra})
    assert r.status_code == status, r.text
    return r.json()


def content(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def test_state_turns_equal_feeding_the_tokens_at_once(model):
    with LiveServer(model) as server, server.client() as c:
        talk = Conversation(model, server)
        first = turn(c, "sea", FIRST)
        BatchCompletion.model_validate(first)
        assert content(first) == talk.expect(FIRST, 6) and first["choices"][0]["finish_reason"] == "length"
        # A stop string mid-reply: the stored state must end before it (a token of the reply decides it).
        tokens, _, _ = reference(model, talk.tokens + server.tokenizer.encode("\n\n" + SECOND), 12, temperature=0)
        stop = server.tokenizer.decode(tokens[5:7])
        second = turn(c, "sea", SECOND, 12, stop_tokens=[stop])
        assert content(second) == talk.expect(SECOND, 12, stop=(stop,))
        assert second["choices"][0]["finish_reason"] == "stop" and stop not in content(second)
        assert content(turn(c, "sea", THIRD)) == talk.expect(THIRD, 6)
        assert second["usage"]["prompt_tokens"] == len(server.tokenizer.encode("\n\n" + SECOND))
        stateless = turn(c, None, SECOND)  # no session_id: nothing stored, nothing read
        assert content(stateless) == Conversation(model, server).expect(SECOND, 6)
        assert c.post("/state/status").json()["total_sessions"] == 1


def test_streamed_turn_is_stored_before_done(model):
    with LiveServer(model) as server, server.client() as c:
        talk = Conversation(model, server)
        body = {"contents": [FIRST], "session_id": "s", "max_tokens": 5, "stream": True, "chunk_size": 2, **GREEDY}
        events = parse_sse(c.post("/state/chat/completions", json=body).text)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert text == talk.expect(FIRST, 5)
        assert content(turn(c, "s", SECOND)) == talk.expect(SECOND, 6)


def test_openai_session_id_sends_only_new_messages(model):
    openai = pytest.importorskip("openai")
    with LiveServer(model) as server:
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        talk = Conversation(model, server)

        def ask(question: str) -> tuple[str, int]:
            out = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                              temperature=0, max_tokens=5, presence_penalty=0, frequency_penalty=0,
                                              extra_body={"session_id": "chat-1"})
            return out.choices[0].message.content, out.usage.prompt_tokens
        for question in ("What is RWKV?", "Why is its state small?", "Thanks!"):
            text = render_chat([ChatMessage(role="user", content=question)])
            reply, prompt_tokens = ask(question)
            assert reply == talk.expect(text, 5, stop=TURN_STOPS)
            assert prompt_tokens == len(server.tokenizer.encode(("\n\n" if question != "What is RWKV?" else "")
                                                                + text))
        with httpx.Client(base_url=server.url) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 2,
                                                     "session_id": "chat-1"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_tiers_and_counts(model):
    with LiveServer(model, store_options={"l1": 1, "l2": 1}) as server, server.client() as c:
        talks = {sid: Conversation(model, server) for sid in "abc"}
        for sid, talk in talks.items():
            assert content(turn(c, sid, FIRST, 4)) == talk.expect(FIRST, 4)
        status = StateStatus.model_validate(c.post("/state/status", json={}).json())
        assert (status.total_sessions, status.l1_cache_count, status.l2_cache_count, status.database_count) == \
               (3, 1, 1, 1)
        assert [(s.session_id, s.cache_level) for s in status.sessions] == \
               [("c", "L1 (VRAM)"), ("b", "L2 (RAM)"), ("a", "Database (Disk)")]
        page = c.post("/state/status", json={"offset": 1, "limit": 1}).json()
        assert page["total_sessions"] == 3 and [s["session_id"] for s in page["sessions"]] == ["b"]
        assert content(turn(c, "a", SECOND, 4)) == talks["a"].expect(SECOND, 4)  # from disk
        levels = {s["session_id"]: s["cache_level"] for s in c.post("/state/status").json()["sessions"]}
        assert levels == {"a": "L1 (VRAM)", "c": "L2 (RAM)", "b": "Database (Disk)"}
        metrics = c.get("/metrics").text
        for tier in ("l1", "l2", "disk"):
            assert f'rwkv_sessions{{tier="{tier}"}} 1.0' in metrics
        assert 'rwkv_session_events_total{event="hits_disk"} 1.0' in metrics


def test_restart_keeps_sessions_and_another_model_is_refused(tmp_path, model_a):
    model, fingerprint_a = model_a
    other, fingerprint_b = random_model(22)
    assert fingerprint_a != fingerprint_b and fingerprint_a.startswith("L2-C128-V65536:")
    db = tmp_path / "sessions.db"
    with LiveServer(model, state_db=db, fingerprint=fingerprint_a) as server, server.client() as c:
        talk = Conversation(model, server)
        assert content(turn(c, "s", FIRST)) == talk.expect(FIRST, 6)
    with LiveServer(model, state_db=db, fingerprint=fingerprint_a) as server, server.client() as c:
        assert content(turn(c, "s", SECOND)) == talk.expect(SECOND, 6)
    with LiveServer(other, state_db=db, fingerprint=fingerprint_b) as server, server.client() as c:
        refused = turn(c, "s", THIRD, status=409)
        assert refused["param"] == "session_id" and fingerprint_a in refused["error"]
        assert c.post("/state/status").json()["total_sessions"] == 1  # still valid for the first model
        assert c.get("/health").status_code == 200
        assert c.post("/state/delete", json={"session_id": "s"}).json()["deleted"] == 1
        assert content(turn(c, "s", THIRD)) == Conversation(other, server).expect(THIRD, 6)


def test_corrupt_state_is_reported_and_dropped(tmp_path, model):
    db = tmp_path / "sessions.db"
    with LiveServer(model, state_db=db) as server, server.client() as c:
        turn(c, "k", FIRST)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE sessions SET blob = ? WHERE session_id = 'k'", (b"not a state",))
    with LiveServer(model, state_db=db) as server, server.client() as c:
        gone = turn(c, "k", SECOND, status=410)
        assert "k" in gone["error"] and gone["param"] == "session_id"
        assert c.post("/state/status").json()["total_sessions"] == 0
        assert content(turn(c, "k", SECOND)) == Conversation(model, server).expect(SECOND, 6)  # a fresh start


def test_tenants_sharing_a_database_are_isolated(tmp_path, model):
    db = tmp_path / "sessions.db"
    alice, bob = {"Authorization": "Bearer alice-pw"}, {"Authorization": "Bearer bob-pw"}
    with LiveServer(model, state_db=db, password="alice-pw") as server, server.client(headers=alice) as c:
        talk = Conversation(model, server)
        assert content(turn(c, "shared", FIRST)) == talk.expect(FIRST, 6)
    with LiveServer(model, state_db=db, password="bob-pw") as server, server.client(headers=bob) as c:
        assert c.post("/state/status").json()["total_sessions"] == 0
        assert c.post("/state/delete", json={"session_id": "shared"}).status_code == 404
        assert content(turn(c, "shared", SECOND)) == Conversation(model, server).expect(SECOND, 6)
    with LiveServer(model, state_db=db, password="alice-pw") as server, server.client(headers=alice) as c:
        assert content(turn(c, "shared", SECOND)) == talk.expect(SECOND, 6)
        assert c.post("/state/status").json()["total_sessions"] == 1


def test_concurrent_turns_on_one_session_are_serialized(model):
    with LiveServer(model, start_engine=False) as server, server.client() as c:
        talk = Conversation(model, server)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(turn, c, "busy", FIRST)
            wait_until(lambda: server.engine.queued_requests == 1, lambda: "first turn never queued")
            second = pool.submit(turn, c, "busy", SECOND)
            wait_until(lambda: server.store.stats()["waiting_turns"] == 1, lambda: "second turn is not waiting")
            assert server.engine.queued_requests == 1  # it waits for the session, not in the engine
            server.engine.start()
            assert content(first.result()) == talk.expect(FIRST, 6)
            assert content(second.result()) == talk.expect(SECOND, 6)  # on top of the first turn


def test_busy_session_is_rejected_with_reject_policy(model):
    with LiveServer(model, start_engine=False, busy="reject") as server, server.client() as c:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(turn, c, "busy", FIRST)
            wait_until(lambda: server.engine.queued_requests == 1, lambda: "first turn never queued")
            busy = turn(c, "busy", SECOND, status=409)
            assert busy["param"] == "session_id" and "busy" in busy["error"]
            assert c.post("/state/delete", json={"session_id": "busy"}).status_code == 409
            server.engine.start()
            first.result()
        turn(c, "busy", SECOND)  # free again once the first turn is over


def test_cancelled_turn_leaves_the_session_unchanged(model):
    # a turn no machine finishes by length before the server sees the disconnect, however loaded
    with LiveServer(model, limits=ServerLimits(max_tokens=1_000_000)) as server, server.client() as c:
        talk = Conversation(model, server)
        assert content(turn(c, "c", FIRST)) == talk.expect(FIRST, 6)
        sock = server.open_request("/state/chat/completions", {"contents": [SECOND], "session_id": "c", "stream": True,
                                                               "max_tokens": 1_000_000, "chunk_size": 1, **GREEDY})
        received = b""
        while b"data: {" not in received:  # the turn is generating
            received += sock.recv(4096)
        sock.close()
        server.wait_idle()
        wait_until(lambda: server.store.stats()["locked_sessions"] == 0, lambda: "the session stayed locked")
        assert server.engine.metrics.finished_rows.labels("cancelled")._value.get() == 1
        assert content(turn(c, "c", THIRD)) == talk.expect(THIRD, 6)  # as if the cancelled turn never happened


def test_multi_state_branches_survive_restart(tmp_path, model):
    db = tmp_path / "sessions.db"

    def branch(c: httpx.Client, idx: int, text: str, status: int = 200, **extra) -> dict:
        r = c.post("/multi_state/chat/completions", json={"contents": [text], "session_id": "tree",
                                                          "dialogue_idx": idx, "max_tokens": 5, **GREEDY, **extra})
        assert r.status_code == status, r.text
        return r.json() if not extra.get("stream") else parse_sse(r.text)
    with LiveServer(model, state_db=db) as server, server.client() as c:
        root = Conversation(model, server)
        first = branch(c, 0, FIRST)
        MultiStateCompletion.model_validate(first)
        assert first["dialogue_idx"] == 1 and content(first) == root.expect(FIRST, 5)
        left, right = Conversation(model, server), Conversation(model, server)
        left.tokens = right.tokens = list(root.tokens)
        assert content(branch(c, 1, SECOND)) == left.expect(SECOND, 5)              # node 2
        events = branch(c, 1, THIRD, stream=True)                                    # node 3
        assert events[-1] == "[DONE]"
        assert events[-2] == {"object": "multi_state.dialogue_idx", "session_id": "tree:3", "dialogue_idx": 3}
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == \
               right.expect(THIRD, 5)
        assert branch(c, 7, SECOND, status=404)["param"] == "dialogue_idx"
    with LiveServer(model, state_db=db) as server, server.client() as c:
        continued = branch(c, 2, THIRD)
        assert continued["dialogue_idx"] == 4 and content(continued) == left.expect(THIRD, 5)
        deleted = c.post("/state/delete", json={"session_id": "tree", "delete_prefix": True}).json()
        assert deleted == {"status": "success", "message": "Session tree deleted successfully", "deleted": 4}
        branch(c, 2, THIRD, status=404)


@pytest.mark.parametrize("path, body, param", [
    ("/state/chat/completions", {"contents": ["a", "b"], "session_id": "s"}, "contents"),
    ("/state/chat/completions", {"contents": [], "session_id": "s"}, "contents"),
    ("/state/chat/completions", {"contents": ["a"], "session_id": "x" * 257}, "session_id"),
    ("/state/chat/completions", {"contents": ["a"], "session_id": "bad\nid"}, "session_id"),
    ("/multi_state/chat/completions", {"contents": ["a"], "session_id": "s"}, "dialogue_idx"),
    ("/multi_state/chat/completions", {"contents": ["a"], "dialogue_idx": 0}, "session_id"),
    ("/multi_state/chat/completions", {"contents": ["a"], "session_id": "s", "dialogue_idx": -1}, "dialogue_idx"),
    ("/state/status", {"limit": 0}, "limit"),
    ("/state/status", {"limit": 1001}, "limit"),
    ("/state/delete", {}, "session_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "session_id": "y" * 257},
     "session_id"),
])
def test_bad_state_requests_are_named_4xx(server, path, body, param):
    with server.client() as c:
        r = c.post(path, json=body)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert (error["param"] if isinstance(error, dict) else r.json()["param"]) == param


def test_state_routes_without_a_store_answer_503(model):
    ctx = ServerContext(Engine(ModelRunner(model, 1), load_world_tokenizer()), load_world_tokenizer(), "m")
    with TestClient(create_app(ctx)) as c:
        r = c.post("/state/status")
        assert r.status_code == 503 and r.json()["error"] == "session state is not enabled on this server"
        assert c.post("/v1/responses", json={"input": "hi", "store": True}).status_code == 503


def test_prefix_cache_hits_over_http_give_the_same_replies(model):
    system = "You are a meticulous assistant. Always answer in exactly one short sentence, no lists."
    with LiveServer(model, prefix_cache={"capacity": 16, "block": 64, "min_tokens": 4}) as server, \
            server.client() as c:
        def chat(messages: list[dict]) -> str:
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "temperature": 0,
                                                     "presence_penalty": 0, "frequency_penalty": 0})
            assert r.status_code == 200, r.text
            prompt = server.tokenizer.encode(render_chat([ChatMessage.model_validate(m) for m in messages]))
            assert r.json()["usage"]["prompt_tokens"] == len(prompt)
            _, text, _ = reference(model, prompt, 5, stop=TURN_STOPS, temperature=0)
            assert r.json()["choices"][0]["message"]["content"] == text
            return text

        def hits() -> float:
            line = next(l for l in c.get("/metrics").text.splitlines() if l.startswith("rwkv_prefix_cache_hits_total"))
            return float(line.split()[1])
        history = [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]
        reply = chat(history)                        # miss; snapshot where the next turn's prompt diverges
        assert hits() == 0
        chat(history + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one?"}])
        assert hits() == 1                           # the resent history was not prefilled again
        chat([{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}])
        assert hits() == 1                           # a system prompt seen before: snapshot it this time
        chat([{"role": "system", "content": system}, {"role": "user", "content": "Name a tree."}])
        assert hits() == 2                           # and the next conversation starts after it
