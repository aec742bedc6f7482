"""app.py as users run it: every option documented, the password from RWKV_PASSWORD or --password,
never logged, and test/test_curl.sh passing against the live process."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import app
from infer.model import RWKV7
from infer.tokenizer import load_world_tokenizer
from test_api_support import reference, wait_until

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "cli-pw-Zx81"


def test_help_documents_every_option():
    env = {**os.environ, "RWKV_PASSWORD": PASSWORD}
    out = subprocess.run([sys.executable, str(ROOT / "app.py"), "--help"], capture_output=True, text=True, env=env,
                         check=True).stdout
    for action in app.build_parser()._actions:
        for flag in action.option_strings:
            assert flag in out
        assert action.help, f"{action.option_strings} has no help text"
    assert PASSWORD not in out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from infer.random_model import make_config, random_state_dict, save_checkpoint
    import torch
    path = tmp_path_factory.mktemp("cli") / "tiny.pth"
    save_checkpoint(random_state_dict(make_config(2, 128, 65536), seed=21, dtype=torch.float32), path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(options: list[str], log_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """app.py on a free loopback port with ``options``; returns once /health answers 200."""
    port = free_port()
    args = [sys.executable, str(ROOT / "app.py"), "--port", str(port), *options]
    with open(log_path, "a") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.2)


@pytest.mark.parametrize("source", ["environment", "argument"])
def test_live_process_authenticates_and_never_logs_the_password(checkpoint, tmp_path, source):
    env = {k: v for k, v in os.environ.items() if k != "RWKV_PASSWORD"}
    options = ["--model-path", str(checkpoint), "--max-tokens", "32", "--log-level", "debug",
               "--state-db", str(tmp_path / "sessions.db")]
    if source == "environment":
        env["RWKV_PASSWORD"] = PASSWORD
        options += ["--decode-ahead", "on",  # the curl script's endpoints with decode steps queued ahead
                    "--prefill-chunk-size", "5", "--prefill-step-tokens", "12",  # prompts fed over several steps
                    "--gil-switch-ms", "2"]
    else:
        options += ["--password", PASSWORD]
    log_path = tmp_path / "server.log"
    proc, base = start_server(options, log_path, env)
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            body = {"contents": ["hi"], "max_tokens": 3}
            assert c.post("/v1/chat/completions", json={**body, "password": "wrong-" + PASSWORD}).status_code == 401
            assert c.post("/v1/chat/completions", json=body).status_code == 401
            assert c.post("/v1/chat/completions", json={**body, "password": PASSWORD}).status_code == 200
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {PASSWORD}"}).status_code == 200
            assert c.post("/v1/chat/completions", content=b'{"contents": [1], "password": "%s"}' % PASSWORD.encode()
                          ).status_code == 422
        if source == "environment" and shutil.which("curl") and shutil.which("jq"):
            run = subprocess.run(["bash", str(ROOT / "test" / "test_curl.sh")], capture_output=True, text=True,
                                 env={**os.environ, "BASE": base, "PASSWORD": PASSWORD, "MAX_TOKENS": "8"})
            assert run.returncode == 0, run.stdout + run.stderr
            assert "checks passed" in run.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    text = log_path.read_text()
    assert "POST /v1/chat/completions" in text  # the access log was on
    assert PASSWORD not in text
    assert ("RWKV_PASSWORD" in text) == (source == "argument")  # the process-list warning
    assert ("steps queued ahead of the host" in text) == (source == "environment")  # off by default on CPU
    step, chunk = (12, 5) if source == "environment" else (app.CPU_PREFILL_STEP_TOKENS, 512)
    assert f"prefill  up to {step} prompt tokens a step; prompts over {chunk} tokens fed that many a step" in text
    gil_ms = "2" if source == "environment" else f"{app.DEFAULT_GIL_SWITCH_MS:g}"
    assert f"GIL      a thread waiting for it gets it within {gil_ms} ms" in text


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_gil_switch_interval_must_be_positive(value, capsys):
    with pytest.raises(SystemExit):
        app.main(["--gil-switch-ms", value])
    assert "--gil-switch-ms must be positive" in capsys.readouterr().err


def test_sessions_survive_a_hard_kill_and_a_graceful_stop_writes_them(checkpoint, tmp_path):
    db, log_path = tmp_path / "sessions.db", tmp_path / "server.log"
    greedy = {"temperature": 0, "alpha_presence": 0, "alpha_frequency": 0, "alpha_decay": 1.0, "stop_tokens": []}
    model, tokenizer = RWKV7.load(str(checkpoint), device="cpu"), load_world_tokenizer()

    def turn(base: str, text: str) -> str:
        r = httpx.post(f"{base}/state/chat/completions", timeout=60, json={
            "contents": [text], "session_id": "durable", "max_tokens": 6, **greedy})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    def stored_blob() -> bytes | None:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            row = conn.execute("SELECT blob FROM sessions WHERE session_id = 'durable'").fetchone()
        return row and row[0]
    prompt = tokenizer.encode("User: Remember the number 7.\n\nAssistant:")
    first_tokens, first_text, _ = reference(model, prompt, 6, temperature=0)
    proc, base = start_server(["--model-path", str(checkpoint), "--state-db", str(db), "--state-flush-interval",
                               "0.2"], log_path)
    try:
        assert turn(base, "User: Remember the number 7.\n\nAssistant:") == first_text
        wait_until(lambda: stored_blob() is not None, lambda: "the flusher never wrote the session")
        after_first = stored_blob()
    finally:
        proc.kill()  # SIGKILL: no shutdown code runs
        proc.wait(30)
    # Restarted: the session continues from the state written before the kill. The flusher is slow
    # now, so only the graceful stop can write the second turn.
    proc, base = start_server(["--model-path", str(checkpoint), "--state-db", str(db), "--state-flush-interval",
                               "3600"], log_path)
    try:
        continued = prompt + first_tokens + tokenizer.encode("\n\nUser: Which number?\n\nAssistant:")
        assert turn(base, "User: Which number?\n\nAssistant:") == reference(model, continued, 6, temperature=0)[1]
        assert stored_blob() == after_first
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its shutdown
    assert "Application shutdown complete" in log_path.read_text()
    assert stored_blob() != after_first
