"""Auth, limits, bad input, CORS, backpressure, health and client disconnects on live servers."""
from __future__ import annotations

import httpx
import pytest

from infer.api.context import ServerLimits
from test_api_support import LiveServer, parse_sse, reference, tiny_model, wait_until

PASSWORD = "s3cret-pw"
ROUTES = [  # (method, path, body, OpenAI error dialect)
    ("GET", "/v1/models", None, True),
    ("GET", "/openai/v1/models", None, True),
    ("GET", "/metrics", None, False),
    ("POST", "/v1/chat/completions", {"contents": ["hi"], "max_tokens": 2}, False),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, True),
    ("POST", "/openai/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
     True),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, True),
    ("POST", "/FIM/v1/batch-FIM", {"prefix": ["a"], "suffix": ["b"], "max_tokens": 2}, False),
    ("POST", "/big_batch/completions", {"contents": ["hi"], "max_tokens": 2}, False),
    ("POST", "/translate/v1/batch-translate", {"target_lang": "en", "text_list": ["hi"]}, False),
    ("POST", "/state/chat/completions", {"contents": ["hi"], "session_id": "s", "max_tokens": 2}, False),
    ("POST", "/multi_state/chat/completions", {"contents": ["hi"], "session_id": "t", "dialogue_idx": 0,
                                               "max_tokens": 2}, False),
    ("POST", "/state/status", {}, False),
    ("POST", "/state/delete", {"session_id": "none", "delete_prefix": True}, False),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}, True),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def locked(model):
    with LiveServer(model, password=PASSWORD, limits=ServerLimits(max_tokens=8)) as live:
        yield live


@pytest.fixture(scope="module")
def server(model):
    with LiveServer(model, slots=2, limits=ServerLimits(max_body_bytes=4096, max_rows=4, max_prompt_tokens=50)) as live:
        yield live


def call(client: httpx.Client, method: str, path: str, body: dict | None, **kwargs) -> httpx.Response:
    return client.request(method, path, json=body, **kwargs)


def assert_error(response: httpx.Response, status: int, openai_dialect: bool) -> dict | str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if openai_dialect:
        assert set(error) == {"message", "type", "param", "code"}
        return error
    assert isinstance(error, str)
    return error


@pytest.mark.parametrize("method, path, body, openai_dialect", ROUTES)
def test_every_route_requires_the_password(locked, method, path, body, openai_dialect):
    with locked.client() as c:
        assert_error(call(c, method, path, body), 401, openai_dialect)
        assert_error(call(c, method, path, body, headers={"Authorization": "Bearer wrong"}), 401, openai_dialect)
        ok = call(c, method, path, body, headers={"Authorization": f"Bearer {PASSWORD}"})
        assert ok.status_code == 200, ok.text
        if method == "POST":
            assert call(c, method, path, {**body, "password": PASSWORD}).status_code == 200
            assert_error(call(c, method, path, {**body, "password": PASSWORD + "x"}), 401, openai_dialect)


def test_public_paths_and_openai_sdk_key(locked):
    openai = pytest.importorskip("openai")
    with locked.client() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/openapi.json").status_code == 200 and c.get("/docs").status_code == 200
        assert c.get("/openapi.json").json()["components"]["securitySchemes"]["password"]["scheme"] == "bearer"
    sdk = openai.OpenAI(base_url=f"{locked.url}/v1", api_key=PASSWORD, max_retries=0)
    assert sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{locked.url}/v1", api_key="nope", max_retries=0).models.list()


def test_translate_can_be_exempted(model):
    with LiveServer(model, password=PASSWORD, translate_no_auth=True, limits=ServerLimits(max_tokens=8)) as live, \
            live.client() as c:
        translate = c.post("/translate/v1/batch-translate", json={"target_lang": "en", "text_list": ["hi"]})
        assert translate.status_code == 200
        assert c.post("/v1/chat/completions", json={"contents": ["hi"]}).status_code == 401


def test_body_size_limit(server):
    big = {"contents": ["x" * 5000]}
    with server.client() as c:
        assert_error(c.post("/v1/chat/completions", json=big), 413, False)
        assert_error(c.post("/v1/completions", json={"prompt": "x" * 5000}), 413, True)
        chunked = c.post("/big_batch/completions", content=(b"x" * 1000 for _ in range(6)))  # no Content-Length
        assert_error(chunked, 413, False)
        assert c.post("/v1/chat/completions", json={"contents": ["x"], "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path, raw, status, param", [
    ("/v1/chat/completions", b"{not json", 400, "body"),
    ("/big_batch/completions", b"{not json", 400, "body"),
    ("/v1/chat/completions", b'{"contents": "hello"}', 422, "contents"),
    ("/v1/chat/completions", b'{"contents": [1, 2]}', 422, "contents[0]"),
    ("/v1/chat/completions", b'{"max_tokens": 5}', 422, "contents"),
    ("/v1/chat/completions", b'{"contents": ["x"], "max_tokens": -1}', 422, "max_tokens"),
    ("/v1/chat/completions", b'{"contents": ["x"], "max_tokens": 1e300}', 422, "max_tokens"),
    ("/v1/chat/completions", b'{"contents": ["x"], "max_tokens": 100000}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"contents": ["x"], "temperature": NaN}', 422, "temperature"),
    ("/v1/chat/completions", b'{"contents": ["x"], "top_p": 1.5}', 422, "top_p"),
    ("/v1/chat/completions", b'{"contents": ["x"], "chunk_size": 0}', 422, "chunk_size"),
    ("/v1/chat/completions", b'{"contents": ["x"], "stop_tokens": "\\nUser:"}', 422, "stop_tokens"),
    ("/v1/chat/completions", b'{"contents": ["x"], "stop_tokens": [[1]]}', 422, "stop_tokens"),
    ("/v1/chat/completions", b'{"contents": ["\\ud800"]}', 422, "contents"),
    ("/v1/chat/completions", b'{"contents": ["a", "b", "c", "d", "e"]}', 400, "contents"),
    ("/v1/chat/completions", ("{\"contents\": [\"" + "word " * 60 + "\"]}").encode(), 400, "contents[0]"),
    ("/big_batch/completions", b"[" * 2000 + b"]" * 2000, 400, "body"),
    ("/FIM/v1/batch-FIM", b'{"prefix": ["a"]}', 422, "suffix"),
    ("/translate/v1/batch-translate", b'{"text_list": ["a"]}', 422, "target_lang"),
    ("/translate/v1/batch-translate", b'{"target_lang": "en", "text_list": ["a"], "password": 5}', 422, "password"),
])
def test_bad_input_is_a_named_4xx_and_the_server_keeps_serving(server, path, raw, status, param):
    with server.client() as c:
        r = c.post(path, content=raw, headers={"Content-Type": "text/plain"})
        assert r.status_code == status, r.text
        assert r.json().get("param", "").startswith(param), r.json()
        assert c.get("/health").status_code == 200


def test_a_bad_request_does_not_disturb_a_running_stream(server, model):
    body = {"contents": ["Tell me a story"], "max_tokens": 40, "temperature": 0, "stop_tokens": [],
            "alpha_presence": 0, "alpha_frequency": 0, "stream": True, "chunk_size": 1}
    _, expected, _ = reference(model, server.tokenizer.encode(body["contents"][0]), 40, temperature=0)
    with server.client() as c, server.client() as other, c.stream("POST", "/v1/chat/completions", json=body) as r:
        text = []
        for n, line in enumerate(r.iter_lines()):
            if n % 4 == 1:
                assert other.post("/v1/chat/completions", content=b"{oops").status_code == 400
                assert other.post("/v1/completions", json={"prompt": [99999]}).status_code == 422
            if line.startswith("data: {"):
                text += [ch["delta"].get("content") or "" for ch in parse_sse(line + "\n\n")[0]["choices"]]
    assert "".join(text) == expected


def test_cors_is_off_by_default(server):
    with server.client() as c:
        preflight = c.options("/v1/chat/completions", headers={
            "Origin": "https://site.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in preflight.headers
        assert "access-control-allow-origin" not in c.get("/v1/models", headers={"Origin": "https://x.example"}).headers


def test_cors_explicit_origins(model):
    with LiveServer(model, password=PASSWORD, cors_origins=["https://ok.example"]) as live, live.client() as c:
        preflight = c.options("/v1/chat/completions", headers={
            "Origin": "https://ok.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://ok.example"
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        denied = c.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in denied.headers
        r = c.get("/v1/models", headers={"Origin": "https://ok.example", "Authorization": f"Bearer {PASSWORD}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"


def test_queue_full_is_429_and_health_follows_the_engine(model):
    live = LiveServer(model, queue=1, start_engine=False)
    with live, live.client() as c:
        assert c.get("/health").status_code == 503 and c.get("/health").json()["status"] == "unavailable"
        with c.stream("POST", "/big_batch/completions", json={"contents": ["queued"], "max_tokens": 4}) as first:
            assert first.status_code == 200 and live.engine.queued_requests == 1  # accepted, engine not running
            busy = c.post("/v1/chat/completions", json={"contents": ["x"]})
            assert_error(busy, 429, False)
            assert busy.headers["retry-after"] == "1"
            busy = c.post("/v1/completions", json={"prompt": "x"})
            assert assert_error(busy, 429, True)["code"] == "queue_full"
        live.engine.start()
        assert c.get("/health").status_code == 200
        live.wait_idle()
        assert c.post("/v1/chat/completions", json={"contents": ["x"], "max_tokens": 2}).status_code == 200
        live.engine.shutdown()
        assert c.get("/health").status_code == 503


# Rows the disconnect tests leave running: long enough that no row can finish by length before the server sees the
# disconnect, however slow the machine (at 8,192 a loaded 2-core CI machine once let two rows finish first).
ENDLESS = 1_000_000
ENDLESS_LIMITS = ServerLimits(max_tokens=ENDLESS)


def cancelled_rows(server: LiveServer) -> float:
    return server.engine.metrics.registry.get_sample_value("rwkv_finished_rows_total", {"reason": "cancelled"}) or 0


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"contents": ["Go on forever", "and ever"], "max_tokens": ENDLESS, "stop_tokens": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": ENDLESS}),
    ("/v1/completions", {"prompt": "Go on", "max_tokens": ENDLESS}),
    ("/big_batch/completions", {"contents": ["Go on"], "max_tokens": ENDLESS, "stop_tokens": []}),
    ("/FIM/v1/batch-FIM", {"prefix": ["a"], "suffix": ["b"], "max_tokens": ENDLESS}),
])
def test_disconnect_mid_stream_cancels_the_rows(model, path, body):
    with LiveServer(model, slots=4, limits=ENDLESS_LIMITS) as live, live.client() as c:
        with c.stream("POST", path, json={**body, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 6:
                    break  # leaving the block closes the connection mid-stream
        live.wait_idle()
        assert cancelled_rows(live) == len(body.get("contents", [0]))
        assert live.engine.free_slots == 4


def test_disconnect_while_waiting_for_a_non_stream_answer(model):
    with LiveServer(model, slots=2, limits=ENDLESS_LIMITS) as live:
        sock = live.open_request("/v1/chat/completions", {"contents": ["Keep talking"], "max_tokens": ENDLESS,
                                                          "stop_tokens": []})
        wait_until(lambda: live.engine.running_rows == 1, lambda: "row never started")
        sock.close()
        live.wait_idle()
        assert cancelled_rows(live) == 1


def test_disconnect_while_queued_leaves_the_queue(model):
    with LiveServer(model, slots=1, limits=ENDLESS_LIMITS) as live:
        long = {"contents": ["Hold the slot"], "max_tokens": ENDLESS, "stop_tokens": []}
        running = live.open_request("/v1/chat/completions", long)
        wait_until(lambda: live.engine.running_rows == 1, lambda: "row never started")
        waiting = live.open_request("/v1/chat/completions", {**long, "stream": True})
        wait_until(lambda: live.engine.queued_requests == 1, lambda: "second request never queued")
        waiting.close()
        wait_until(lambda: live.engine.queued_requests == 0, lambda: "queued request not dropped")
        assert live.engine.running_rows == 1
        running.close()
        live.wait_idle()
