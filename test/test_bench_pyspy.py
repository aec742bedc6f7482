"""bench/pyspy.py's summary of py-spy's raw output (--threads: a line per stack, its thread first, then its count):
what bench_serving.py --profile and bench_host.py --profile report."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.pyspy import RATE_HZ, profile_summary  # noqa: E402

RAW = """\
thread (11): MainThread;run (uvicorn/main.py:10);send (uvicorn/protocols/http/httptools_impl.py:461) 30
thread (11): MainThread;run (uvicorn/main.py:10);_completion_sse (infer/api/openai.py:330) 10
thread (12): rwkv-engine;Engine.run_once (infer/engine.py:300);Engine._on_token (infer/engine.py:500) 15
thread (12): rwkv-engine;Engine.run_once (infer/engine.py:300) 5
thread (13): ThreadPoolExecutor-0_0;_worker (concurrent/futures/thread.py:80) 2
"""


def test_profile_summary_splits_threads_and_shares(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(RAW)
    out = profile_summary(raw)
    assert set(out) == {"event loop", "engine", "other"}
    loop, engine = out["event loop"], out["engine"]
    assert loop["samples"] == 40 and loop["busy_s"] == round(40 / RATE_HZ, 3)
    assert loop["self"] == [("send (httptools_impl.py)", 75.0), ("_completion_sse (openai.py)", 25.0)]
    assert ("run (main.py)", 100.0) in loop["inclusive"]
    assert engine["samples"] == 20
    assert engine["self"] == [("Engine._on_token (engine.py)", 75.0), ("Engine.run_once (engine.py)", 25.0)]
    assert dict(engine["inclusive"])["Engine.run_once (engine.py)"] == 100.0
    assert out["other"]["samples"] == 2
