"""Load test of the HTTP API: many concurrent streaming clients plus a storm of mid-stream disconnects.

Starts ``app.py`` (the built-in CPU demo model unless --model-path is given) on a free loopback
port, then for each round:

1. ``--clients`` streaming requests at once (alternating rwkv_lightning batch and OpenAI chat,
   ``--max-tokens`` each); a client succeeds when it sees every row's finish_reason and
   ``[DONE]``.
2. ``--storm`` streaming requests with long generations that disconnect early: some right after
   the response headers (many are still queued then), the others after a few events.
3. Waits until the server reports no running or queued rows, and records the server's resident
   memory (from /proc) and free slots.

Writes bench/results/load_<name>.json. Goals: zero errors, every slot free after each round,
resident memory flat between rounds.

Usage: python bench/load_test.py [--clients 1000] [--storm 500] [--rounds 2] [--name cpu]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    disconnected: int = 0
    errors: list[str] = field(default_factory=list)
    first_event_s: list[float] = field(default_factory=list)
    events: int = 0


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return round(kb / 1024, 1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the server process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_body(i: int, max_tokens: int) -> tuple[str, dict, int]:
    """(path, body, rows): even clients use the lightning batch (2 rows), odd ones OpenAI chat."""
    if i % 2 == 0:
        return "/v1/chat/completions", {
            "contents": [f"User: question {i}\n\nAssistant:", f"English: sentence {i}\n\nChinese:"],
            "max_tokens": max_tokens, "stream": True, "chunk_size": 2, "stop_tokens": []}, 2
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": f"Tell me about number {i}."}],
        "max_tokens": max_tokens, "stream": True}, 1


async def stream_client(client: httpx.AsyncClient, i: int, max_tokens: int, tally: Tally) -> None:
    path, body, rows = request_body(i, max_tokens)
    tally.started += 1
    start = time.monotonic()
    finished: set[int] = set()
    done = seen_first = False
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                tally.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if not seen_first:
                    tally.first_event_s.append(time.monotonic() - start)
                    seen_first = True
                if line == "data: [DONE]":
                    done = True
                    continue
                tally.events += 1
                for choice in json.loads(line[6:])["choices"]:
                    if choice.get("finish_reason"):
                        finished.add(choice["index"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        tally.errors.append(f"{type(e).__name__}: {e}")
        return
    if done and len(finished) == rows:
        tally.completed += 1
    else:
        tally.errors.append(f"incomplete stream: done={done} finished={sorted(finished)} of {rows} rows")


async def storm_client(client: httpx.AsyncClient, i: int, tally: Tally, rng: random.Random) -> None:
    """Start a long stream and leave early: right after the headers, or after 1-3 events."""
    path, body, _ = request_body(i, 512)
    leave_after = rng.choice([0, 1, 2, 3])
    tally.started += 1
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                tally.errors.append(f"HTTP {r.status_code}")
                return
            seen = 0
            if leave_after:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen >= leave_after:
                            break
        tally.disconnected += 1  # leaving the block closes the connection
    except httpx.HTTPError as e:
        tally.errors.append(f"{type(e).__name__}: {e}")


async def wait_idle(client: httpx.AsyncClient, slots: int, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = (await client.get("/health")).json()
        if health["running_rows"] == 0 and health["queued_requests"] == 0 and health["free_slots"] == slots:
            return health
        if time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.1)


def summarize(tally: Tally, seconds: float) -> dict:
    ttfe = sorted(tally.first_event_s)
    return {"clients": tally.started, "completed": tally.completed, "disconnected": tally.disconnected,
            "errors": len(tally.errors), "error_samples": tally.errors[:5], "events": tally.events,
            "seconds": round(seconds, 2),
            "first_event_s": {"p50": round(statistics.median(ttfe), 3),
                              "p99": round(ttfe[int(len(ttfe) * 0.99) - 1], 3),
                              "max": round(ttfe[-1], 3)} if ttfe else None}


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def run_rounds(base: str, pid: int, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600), limits=limits) as client:
        warm = Tally()
        await asyncio.gather(*(stream_client(client, i, 4, warm) for i in range(32)))
        await wait_idle(client, args.slots)
        report = {"rss_mb_start": rss_mb(pid), "warmup_errors": len(warm.errors), "rounds": []}
        rng = random.Random(1234)
        for n in range(args.rounds):
            streams, storm = Tally(), Tally()
            before = (await client.get("/metrics")).text
            cpu0 = cpu_seconds(pid)
            t0 = time.monotonic()
            await asyncio.gather(*(stream_client(client, i, args.max_tokens, streams) for i in range(args.clients)))
            t1 = time.monotonic()
            await asyncio.gather(*(storm_client(client, i, storm, rng) for i in range(args.storm)))
            t2 = time.monotonic()
            health = await wait_idle(client, args.slots)
            metrics = (await client.get("/metrics")).text

            def delta(name: str, labels: str = "") -> float:
                return metric(metrics, name, labels) - metric(before, name, labels)
            steps = delta("rwkv_step_seconds_count")
            report["rounds"].append({
                "streams": summarize(streams, t1 - t0), "storm": summarize(storm, t2 - t1),
                "idle_after_s": round(time.monotonic() - t2, 2),
                "health_after": health, "rss_mb_after": rss_mb(pid),
                "server_cpu_s": round(cpu_seconds(pid) - cpu0, 1),
                "engine": {"steps": steps, "mean_step_ms": round(1000 * delta("rwkv_step_seconds_sum") / steps, 2),
                           "mean_rows_per_step": round(delta("rwkv_step_batch_rows_sum") / steps, 1),
                           "generated_tokens": delta("rwkv_generated_tokens_total"),
                           "cancelled_rows": delta("rwkv_finished_rows_total", '{reason="cancelled"}')},
            })
            print(json.dumps(report["rounds"][-1], indent=1), flush=True)
        return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000, help="concurrent streaming clients per round")
    ap.add_argument("--storm", type=int, default=500, help="clients that disconnect mid-stream per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per row for the streaming clients")
    ap.add_argument("--slots", type=int, default=64, help="server --max-batch-size")
    ap.add_argument("--model-path", help="default: the built-in demo model")
    ap.add_argument("--name", default="cpu", help="results go to bench/results/load_<name>.json")
    args = ap.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per client
    port = free_port()
    cmd = [sys.executable, str(REPO / "app.py"), "--port", str(port), "--max-batch-size", str(args.slots),
           "--max-queued-requests", str(4 * (args.clients + args.storm)), "--log-level", "warning"]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    server = subprocess.Popen(cmd, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("server did not start")
            time.sleep(0.2)
        report = asyncio.run(run_rounds(base, server.pid, args))
    finally:
        server.terminate()
        server.wait(60)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "model": args.model_path or "built-in demo model (random weights)",
        "config": {k: v for k, v in vars(args).items() if k != "name"},
        **report,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"load_{args.name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
