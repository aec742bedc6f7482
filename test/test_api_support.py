"""Shared helpers for the API tests (no tests here): a tiny model, a live uvicorn server on loopback
in a background thread (with a session store and a prefix cache), and an SSE parser."""
from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import torch
import uvicorn

from infer.api.context import ServerContext, ServerLimits
from infer.api.server import create_app
from infer.engine import Engine, GenerationOptions, Request, RowFinished, RowText
from infer.model import RWKV7
from infer.prefix_cache import PrefixCache
from infer.random_model import make_config, random_state_dict
from infer.runner import ModelRunner
from infer.sampler import SamplingParams
from infer.sessions import KEY_CHARS, SessionService
from infer.tokenizer import load_world_tokenizer
from state_pool import SessionStore

MODEL_NAME = "tiny-test-model"


def tiny_model() -> RWKV7:
    sd = random_state_dict(make_config(2, 128, 65536), seed=21, dtype=torch.float32)
    return RWKV7.from_state_dict(sd, device="cpu")


# Small blocks so that the tests' short prompts go through the prefix cache too.
TEST_PREFIX_CACHE = {"capacity": 64, "block": 16, "min_tokens": 4}


class LiveServer:
    """uvicorn serving ``create_app`` on 127.0.0.1 (free port) with its own engine, a session store
    (``state_db``, else a temporary file; ``store_options`` for SessionStore) and a prefix cache
    (``prefix_cache``: PrefixCache options, None for none)."""

    def __init__(self, model: RWKV7, *, slots: int = 8, queue: int = 256, start_engine: bool = True,
                 limits: ServerLimits | None = None, state_db: Path | None = None, fingerprint: str = MODEL_NAME,
                 store_options: dict[str, Any] | None = None, busy: str = "wait",
                 prefix_cache: dict[str, Any] | None = TEST_PREFIX_CACHE, **ctx_options: Any):
        self.tokenizer = load_world_tokenizer()
        self.engine = Engine(ModelRunner(model, slots), self.tokenizer, prefill_chunk_size=64,
                             max_queued_requests=queue)
        self._tmp = tempfile.TemporaryDirectory() if state_db is None else None
        self.state_db = Path(self._tmp.name) / "sessions.db" if state_db is None else state_db
        self.store = SessionStore(self.state_db, fingerprint, model.config,
                                  **{"max_key_len": KEY_CHARS, **(store_options or {})})
        cache = PrefixCache(**prefix_cache, registry=self.engine.metrics.registry) if prefix_cache else None
        self.ctx = ServerContext(self.engine, self.tokenizer, MODEL_NAME, limits=limits or ServerLimits(),
                                 sessions=SessionService(self.store, busy), prefix_cache=cache, **ctx_options)
        self.app = create_app(self.ctx)
        self._start_engine = start_engine
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        if self._start_engine:
            self.engine.start()
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self.engine.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)

    def wait_idle(self) -> None:
        """Until no row holds a slot and nothing is queued (cancellation frees slots within an engine step)."""
        wait_until(lambda: not self.engine.running_rows and not self.engine.queued_requests,
                   lambda: f"engine busy: {self.engine.running_rows} rows, {self.engine.queued_requests} queued")

    def open_request(self, path: str, body: dict) -> socket.socket:
        """Send a POST on a raw connection and leave it open; closing the socket is a client disconnect."""
        payload = json.dumps(body).encode()
        host, port = self.url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        return sock


def wait_until(condition: Callable[[], bool], describe: Callable[[], str], timeout: float = 60.0) -> None:
    """Poll for a state the server reaches asynchronously; the deadline only guards against hangs."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(describe())
        time.sleep(0.01)


def parse_sse(text: str) -> list[Any]:
    """Events of an SSE body: JSON payloads, and the string "[DONE]". Every event must be ``data: …``."""
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ") and "\n" not in block, f"bad SSE event {block!r}"
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def reference(model: RWKV7, prompt: list[int], n: int, stop: tuple[str, ...] = (),
              **sampling: Any) -> tuple[list[int], str, str]:
    """(tokens, visible text, finish reason) straight from an engine, without HTTP."""
    engine = Engine(ModelRunner(model, 2), load_world_tokenizer(), prefill_chunk_size=64)
    events: list[Any] = []
    engine.submit(Request([prompt], GenerationOptions(max_tokens=n, stop=stop, sampling=SamplingParams(**sampling)),
                          events.append))
    while not any(isinstance(e, RowFinished) for e in events):
        engine.run_once()
    text = "".join(e.text for e in events if isinstance(e, (RowText, RowFinished)))
    return [e.token_id for e in events if isinstance(e, RowText)], text, events[-1].finish_reason
