"""app.py as users run it: every option documented, the password from RWKV_PASSWORD or --password,
never logged, and test/test_curl.sh passing against the live process."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import app

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


@pytest.mark.parametrize("source", ["environment", "argument"])
def test_live_process_authenticates_and_never_logs_the_password(checkpoint, tmp_path, source):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RWKV_PASSWORD"}
    args = [sys.executable, str(ROOT / "app.py"), "--model-path", str(checkpoint), "--port", str(port),
            "--max-tokens", "32", "--log-level", "debug"]
    if source == "environment":
        env["RWKV_PASSWORD"] = PASSWORD
    else:
        args += ["--password", PASSWORD]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.2)
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
