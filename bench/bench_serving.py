"""End-to-end serving: N concurrent streaming HTTP clients against the real server.

Starts ``app.py`` (extra server arguments after ``--``), then for each concurrency level N sends
N streaming ``/v1/completions`` requests at once (fixed-length outputs: the end-of-document
token is biased away and no stop strings are set) and measures aggregate output tokens/s, time
to first token and inter-token latency (p50/p99) from the client side. Tokens are counted from
each stream's usage chunk (``stream_options.include_usage``), not from its text chunks: a chunk
can carry several tokens (a stream that fell a step behind gets them merged) or none (bytes of a
character still incomplete), so counting chunks undercounts. ITL is the gap between text chunks.

    python bench/bench_serving.py --levels 1,8,32 --max-tokens 64 -- --max-batch-size 64
    python bench/bench_serving.py --levels 1,32,256 --max-tokens 256 --name h200_7.2b -- \\
        --model-path /tmp/rwkv7-7.2b.pth --max-batch-size 256
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench import limits  # noqa: E402
from bench.pyspy import print_profile, recorded  # noqa: E402
LONG_PROMPT_DELAY_S = 1.0  # after a level's streams start: they are decoding by then
STORY_PROMPT = "User: Write a long story about a lighthouse keeper and the sea.\n\nAssistant:"  # 19 tokens


def filler_prompt(tokens: int) -> str:
    """A prompt of ``tokens`` tokens (" the" is one token of the World vocabulary)."""
    return " the" * tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arg_value(args: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in a command line, else None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def limit_of(size: str | None, server_args: list[str], streams: int) -> float | None:
    """The H200's decode limit (bench/limits.py) for the served shape at ``streams`` rows a step, with the server's
    state dtype and weights; None when the shape or the weight format is not known from the command line."""
    engine = {"fp16": "fp16", "cutlass": "cutlass"}.get(arg_value(server_args, "--inference-engine") or "fp16")
    if size is None:
        match = re.search(r"(\d+\.\d+b)", arg_value(server_args, "--model-path") or "")
        size = match.group(1) if match else None
    if size not in limits.SHAPES or engine is None:
        return None
    return limits.decode_tok_s(size, streams, arg_value(server_args, "--state-dtype") or "fp32", engine)


def device_name(server_args: list[str]) -> str:
    """The GPU the server most likely ran on (it picks CUDA when present), for the result file."""
    if "cpu" not in server_args:
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=30).stdout.split("\n")
            if names[0].strip():
                return names[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    import platform
    return f"cpu ({platform.processor() or platform.machine()})"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[list[float], int]:
    """The request's start and its text chunks' arrival times, and the output tokens the server
    counted (its usage chunk)."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 0.9,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {"0": -100}}
    times = [time.perf_counter()]
    tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices", [])):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    if tokens is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return times, tokens


async def client_streams(base: str, starts: list[float], max_tokens: int,
                         prompt: str = STORY_PROMPT) -> list[tuple[list[float], int]]:
    """Concurrent streams from this process, stream j starting at ``starts[j]`` (time.perf_counter, which on
    Linux is the system-wide monotonic clock, so processes share it)."""
    limits = httpx.Limits(max_connections=len(starts) + 8, max_keepalive_connections=len(starts) + 8)

    async def stream_at(at: float) -> tuple[list[float], int]:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        return await one_stream(client, prompt, max_tokens)

    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(stream_at(at) for at in starts))


def client_process(base: str, starts: list[float], max_tokens: int,
                   prompt: str = STORY_PROMPT) -> list[tuple[list[float], int]]:
    return asyncio.run(client_streams(base, starts, max_tokens, prompt))


# the server's own histograms read around a level: submit to first sampled token, a row's gap between tokens, and one
# engine step (the client's ITL adds detokenizing and the stream; a step longer than the GPU's is host-bound)
SERVER_HISTOGRAMS = ("rwkv_time_to_first_token_seconds", "rwkv_inter_token_latency_seconds", "rwkv_step_seconds")


def server_histograms(base: str) -> dict[str, float]:
    """(name)_sum in seconds and (name)_count of each of SERVER_HISTOGRAMS, from /metrics."""
    wanted = {f"{h}_{part}" for h in SERVER_HISTOGRAMS for part in ("sum", "count")}
    values = dict.fromkeys(wanted, 0.0)
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            values[name] = float(value)
    return values


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms of each histogram over the level's observations (ttft, itl, step) and the level's step count."""
    delta = {k: after[k] - before[k] for k in after}
    means = {}
    for histogram, key in zip(SERVER_HISTOGRAMS, ("ttft", "itl", "step")):
        count = delta[f"{histogram}_count"]
        means[f"server_{key}_ms_mean"] = round(1000 * delta[f"{histogram}_sum"] / count, 2) if count else float("nan")
    return {**means, "server_steps": int(delta["rwkv_step_seconds_count"])}


def long_prompt_ttft(base: str, tokens: int, start_at: float) -> float:
    """TTFT in ms of one request whose prompt is ``tokens`` tokens, sent at ``start_at``."""
    async def run() -> float:
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            times, _ = await one_stream(client, filler_prompt(tokens), 8)
            return (times[1] - times[0]) * 1000
    return asyncio.run(run())


def level(base: str, n: int, max_tokens: int, procs: int, long_prompt: int = 0, prompt: str = STORY_PROMPT,
          stagger_s: float = 0.0) -> dict:
    """N streams split over up to ``procs`` client processes: one Python process parsing every
    stream's chunks would itself become the bottleneck at a few thousand chunks per second.
    ``long_prompt`` > 0: one more request with a prompt that long arrives ``LONG_PROMPT_DELAY_S``
    after the streams (while they decode); the streams' ITL shows what feeding it costs them.
    ``stagger_s`` > 0: stream i starts i * stagger_s after the first (each arrives while the earlier ones decode)
    instead of all at once."""
    procs = max(1, min(procs, n))
    shares = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    start_at = time.perf_counter() + 1.0 + 0.05 * procs  # time for the workers to start
    # stream i of the level is process i % procs's stream i // procs
    starts = [[start_at + (p + procs * j) * stagger_s for j in range(share)] for p, share in enumerate(shares)]
    histograms_before = server_histograms(base)
    long_pool = ThreadPoolExecutor(1)
    long_ttft = long_pool.submit(long_prompt_ttft, base, long_prompt, start_at + LONG_PROMPT_DELAY_S) \
        if long_prompt else None
    if procs == 1:
        streams = client_process(base, starts[0], max_tokens, prompt)
    else:
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(procs, mp_context=spawn) as pool:
            parts = pool.map(client_process, [base] * procs, starts, [max_tokens] * procs, [prompt] * procs)
            streams = [s for part in parts for s in part]
    times = [t for t, _ in streams]
    wall = max(t[-1] for t in times) - min(t[0] for t in times)
    ttft = [(t[1] - t[0]) * 1000 for t in times if len(t) > 1]
    itl = [(b - a) * 1000 for t in times for a, b in zip(t[1:], t[2:])]
    tokens = sum(count for _, count in streams)
    chunks = sum(len(t) - 1 for t in times)
    long = {"long_prompt_tokens": long_prompt, "long_prompt_ttft_ms": round(long_ttft.result(), 1)} if long_ttft else {}
    long_pool.shutdown()
    server = server_means(histograms_before, server_histograms(base))
    return {"clients": n, "client_processes": procs, "output_tokens": tokens, "text_chunks": chunks,
            "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1),
            "ttft_ms_p50": round(percentile(ttft, 0.5), 1), "ttft_ms_p99": round(percentile(ttft, 0.99), 1),
            "itl_ms_p50": round(percentile(itl, 0.5), 2), "itl_ms_p99": round(percentile(itl, 0.99), 2),
            "itl_ms_max": round(max(itl, default=float("nan")), 2),
            # server_ttft_ms_mean: over the level's requests, submit to first sampled token inside the server (engine
            # queue, prefill, sampling); the client's TTFT adds the HTTP request, tokenizing, detokenizing and the stream
            **server, **long}


def main() -> None:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--name", default="cpu")
    ap.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                    help="client processes the streams of a level are split over (default: half the CPUs, <= 8)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="each stream's prompt: this many tokens (0: a 19-token story request)")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="tokens of one extra prompt sent mid-level (0: none); reports its TTFT and the ITL max")
    ap.add_argument("--stagger-ms", default="0",
                    help="start a level's streams this far apart instead of all at once (each arrives while the "
                         "earlier ones decode); one value, or one per level (comma-separated)")
    ap.add_argument("--profile", action="store_true",
                    help="after the levels, the largest once more (unmeasured) under py-spy --gil: how long each "
                         "server thread holds the GIL a step, and where")
    ap.add_argument("--out-dir", default=str(REPO / "bench" / "results"))
    ap.add_argument("--size", choices=sorted(limits.SHAPES), default=None,
                    help="the served shape, for each level's share of the H200 limit (default: the size named in "
                         "--model-path, e.g. rwkv7-7.2b-random-fp16.pth)")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    out = Path(args.out_dir) / f"serving_{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    copy = Path(os.environ["OUT"]) / out.name if os.environ.get("OUT") and Path(os.environ["OUT"]).is_dir() else None
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": device_name(server_args),
              "server_args": server_args, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens or 19,
              "long_prompt": args.long_prompt, "levels": []}
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, str(REPO / "app.py"), "--port", str(port), "--log-level", "warning",
                               *server_args], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for _ in range(1200):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                sys.exit("server exited during startup")
            time.sleep(0.5)
        result["server_startup_s"] = round(time.perf_counter() - started, 1)
        print(f"server up after {result['server_startup_s']}s", flush=True)
        level(base, 2, 4, 1)  # warm-up
        levels = args.levels.split(",")
        staggers = [float(ms) for ms in args.stagger_ms.split(",")]
        if len(staggers) not in (1, len(levels)):
            sys.exit("--stagger-ms: one value, or one per level")
        for n, stagger_ms in zip(levels, staggers * len(levels) if len(staggers) == 1 else staggers):
            prompt = filler_prompt(args.prompt_tokens) if args.prompt_tokens else STORY_PROMPT
            measured = level(base, int(n), args.max_tokens, args.client_procs, args.long_prompt, prompt,
                             stagger_ms / 1000)
            limit = limit_of(args.size, server_args, int(n))
            if limit is not None:
                measured.update(limit_tok_s=round(limit), pct_of_limit=limits.percent(measured["tok_s"], limit))
            result["levels"].append({**measured, "stagger_ms": stagger_ms})
            print(result["levels"][-1], flush=True)
            for path in [out] + ([copy] if copy else []):  # after every level: a later timeout keeps these
                path.write_text(json.dumps(result, indent=2) + "\n")
        if args.profile:
            n = max(int(x) for x in levels)
            steps_before = server_histograms(base)
            profile = recorded(server.pid, lambda: level(base, n, args.max_tokens, args.client_procs), args.name,
                               gil=True)
            if profile is not None:
                steps = server_means(steps_before, server_histograms(base))["server_steps"]
                for thread in profile.values():
                    thread["busy_ms_per_step"] = round(1000 * thread["busy_s"] / max(steps, 1), 3)
                result["profile"] = {"clients": n, "server_steps": steps, "threads": profile}
                for path in [out] + ([copy] if copy else []):
                    path.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:  # a slow shutdown must not lose the measurements
            server.kill()
            server.wait()
    long = f" {'long TTFT':>9}" if args.long_prompt else ""
    print(f"{'clients':>7} {'apart':>6} {'tok/s':>9} {'% limit':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'srv TTFT':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'ITL max':>8} {'srv ITL':>8} {'srv step':>8}{long}  (ms; srv: the server's means)")
    for r in result["levels"]:
        long = f" {r['long_prompt_ttft_ms']:>9}" if args.long_prompt else ""
        print(f"{r['clients']:>7} {r['stagger_ms']:>6} {r['tok_s']:>9} {r.get('pct_of_limit', '-'):>7} {r['ttft_ms_p50']:>9} {r['ttft_ms_p99']:>9} "
              f"{r['server_ttft_ms_mean']:>9} {r['itl_ms_p50']:>8} {r['itl_ms_p99']:>8} {r['itl_ms_max']:>8} "
              f"{r['server_itl_ms_mean']:>8} {r['server_step_ms_mean']:>8}{long}")
    if "profile" in result:
        p = result["profile"]
        print(f"\nprofile of {p['clients']} streams, {p['server_steps']} steps: ms a step holding the GIL " +
              ", ".join(f"{name} {t['busy_ms_per_step']}" for name, t in p["threads"].items()))
        print_profile(p["threads"])

if __name__ == "__main__":
    main()
