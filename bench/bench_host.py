"""Host-side cost of serving, without a model: the real engine, tokenizer, bridge and HTTP stack
around a stub runner whose ``step`` sleeps a simulated GPU time.

The stub takes the place of ``ModelRunner`` (same methods the engine calls). Its ``step``
emulates a CUDA step: ``--launch-ops`` short Python-side op launches (each holds the GIL for
``--launch-op-us`` and then releases it for a few microseconds, as a torch call does), the
forward's GPU time starting at the graph replay (the first launch), a call of ``on_launched``
(when the engine passes one), then a sync that sleeps until the GPU is done (``time.sleep``
releases the GIL as ``Tensor.tolist()`` does while it waits for the device). The GPU time of a step is interpolated from
``--gpu-ms`` (fed tokens -> ms; default: the 7.2B fused graphed forward on the H200, 5.1 ms at 1 row,
16 ms at 256). It returns random printable-text token ids, so detokenization and stop matching do
real work. Nothing is ever sampled as token 0, so every row runs to ``--max-tokens``.

Two measurements:

(a) ``engine``: the engine alone (``run_once`` on this thread, events into lists), and ``bridge``:
    the engine thread feeding real ``EventStream``s read by an asyncio loop on this thread (no
    HTTP). Host time per step = the time between the stub's step returning and the next step
    starting (all engine bookkeeping, detokenization, stops, event hand-off), on full decode steps.
(b) ``http``: ``create_app`` with the real engine + stub in a uvicorn server process, N streaming
    ``/v1/completions`` clients (temperature 1, top-p 0.9, a logit bias, like bench_serving.py) in a
    separate lean client process; client-side tok/s, TTFT and inter-token latency against the
    ideal (one token per row per simulated GPU step), and server-side step period and host time.

    python bench/bench_host.py --label before             # engine, bridge and http at 1,32,256
    python bench/bench_host.py --label after --profile    # + py-spy of the server at the top level
    python bench/bench_host.py --only engine --levels 256 --cprofile

Results go to bench/results/host_cpu.json under ``--label`` (other labels are kept), and a table
of every label is printed.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The client role imports nothing of the server (no torch): it starts fast and stays lean. app.py imports torch
# only when it starts a server.
from app import DEFAULT_GIL_SWITCH_MS  # noqa: E402
from bench.pyspy import print_profile, recorded  # noqa: E402

DEFAULT_GPU_MS = "1:5.1,8:6.9,64:8.7,256:16,512:28"  # 7.2B fused graphed forward, H200 (decode_h200_fused.json)
PROMPT = "User: Write a long story about a lighthouse keeper and the sea.\n\nAssistant:"
RESULTS = REPO / "bench" / "results" / "host_cpu.json"
# hashlib releases the GIL for inputs of 2 KiB or more (time.sleep(0) would too, but costs ~80 us of timer slack)
_GIL_FREE_WORK = bytes(4096)


# ---------------------------------------------------------------------------- the stub runner
class GpuModel:
    """Piecewise-linear GPU ms of a step by fed tokens (linear extrapolation past the last point)."""

    def __init__(self, spec: str):
        if ":" not in spec:  # one ms for every step
            spec = f"1:{spec}"
        points = sorted((int(a), float(b)) for a, b in (p.split(":") for p in spec.split(",")))
        if len(points) == 1:
            points.append((points[0][0] + 1, points[0][1]))
        self.x, self.y = [p[0] for p in points], [p[1] for p in points]

    def ms(self, tokens: int) -> float:
        i = min(max(bisect.bisect_left(self.x, tokens), 1), len(self.x) - 1)
        x0, x1, y0, y1 = self.x[i - 1], self.x[i], self.y[i - 1], self.y[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), self.y[0] if tokens >= self.x[0] else 0.0)


def text_token_ids(tokenizer) -> list[int]:
    """Ids whose bytes are printable UTF-8 text without line breaks (so no stop like "\\n\\nUser:" matches)."""
    ids = []
    for i in range(1, tokenizer.vocab_size):
        try:
            text = tokenizer.decode_bytes([i]).decode("utf-8")
        except (UnicodeDecodeError, ValueError):
            continue
        if text and text.isprintable():
            ids.append(i)
    return ids


class StubRunner:
    """The engine-facing surface of ``ModelRunner`` with a simulated GPU."""

    def __init__(self, num_slots: int, gpu: GpuModel, token_ids: Sequence[int], launch_ops: int = 24,
                 launch_op_us: float = 10.0, sampler_ms: float = 0.0, seed: int = 0, eager_host_ms: float = 0.0):
        from infer.runner import StepOutput, graph_covers
        self._output, self._graphed = StepOutput, graph_covers
        self.num_slots = num_slots
        self.gpu, self.launch_ops, self.launch_op_s = gpu, launch_ops, launch_op_us / 1e6
        self.sampler_s = sampler_ms / 1000
        # a step the real runner cannot replay from CUDA graphs (graph_covers: two prompt rows or more, or a prompt
        # of more than PROMPT_GRAPH_MAX_TOKENS) launches its forward op by op: this much host time
        self.eager_ops = round(eager_host_ms * 1000 / launch_op_us) if launch_op_us > 0 else 0
        rng = random.Random(seed)
        self._tokens = [rng.choice(token_ids) for _ in range(1 << 16)]
        self._next = 0
        self._gpu_free_at = 0.0
        self.log: list[tuple[float, float, int, int, float]] = []  # start, end, rows, fed tokens, gpu s

    def implementations(self) -> dict[str, str]:
        return {"runner": f"stub: gpu {self.gpu.x}->{self.gpu.y} ms, {self.launch_ops} launches of "
                          f"{self.launch_op_s * 1e6:g} us, sampler {self.sampler_s * 1000:g} ms"}

    def start_row(self, slot, params, initial=None) -> None:
        pass

    def end_row(self, slot) -> None:
        pass

    def export_state(self, slot):
        import torch

        from infer.state import SlotState
        return SlotState(torch.zeros(1, 4), torch.zeros(1, 1, 2, 2), torch.zeros(1, 4))

    def step(self, rows, slots, sample, want_logprobs=False, score=None, on_launched=None):
        return self.launch(rows, slots, sample, want_logprobs, score, on_launched).result()

    def launch(self, rows, slots, sample, want_logprobs=False, score=None, on_launched=None) -> "StubStep":
        start = time.perf_counter()
        fed = sum(map(len, rows))
        gpu_s = self.gpu.ms(fed) / 1000
        done_at = self._queue(gpu_s, self.launch_ops if self._graphed(rows) else max(self.launch_ops, self.eager_ops))
        if on_launched is not None:
            on_launched()
        n = sum(sample)
        scores = {i: [(-1.0, []) for _ in targets] for i, (targets, _) in (score or {}).items()}
        out = self._output(self._draw(n), [-1.0] * n if want_logprobs else None, None, None, scores)
        return StubStep(self, (start, len(rows), fed, gpu_s), done_at, out)

    def launch_next(self, step: "StubStep") -> "StubStep":
        """The next decode step of the same rows, queued behind ``step`` on the simulated GPU."""
        start, rows = time.perf_counter(), len(step.out.tokens)
        gpu_s = self.gpu.ms(rows) / 1000
        done_at = self._queue(gpu_s, self.launch_ops)
        logprobs = [-1.0] * rows if step.out.logprobs is not None else None
        return StubStep(self, (start, rows, rows, gpu_s), done_at, self._output(self._draw(rows), logprobs, None, None))

    def _queue(self, gpu_s: float, ops: int) -> float:
        """The step's Python-side launches (hold the GIL, then drop it, as a torch call does); returns when the
        simulated GPU finishes the step, which starts at the graph replay (the first launch) or when the GPU is
        done with the step queued before it."""
        done_at = 0.0
        for i in range(ops):
            end = time.perf_counter() + self.launch_op_s
            while time.perf_counter() < end:
                pass
            if i == 0:
                done_at = max(time.perf_counter(), self._gpu_free_at) + gpu_s
            hashlib.sha1(_GIL_FREE_WORK)  # drops the GIL for ~3 us, as a torch op's dispatch does
        self._gpu_free_at = max(done_at, time.perf_counter()) + self.sampler_s
        return self._gpu_free_at

    def _draw(self, n: int) -> list[int]:
        if self._next + n > len(self._tokens):
            self._next = 0
        self._next += n
        return self._tokens[self._next - n:self._next]


class StubStep:
    """A stub step queued on the simulated GPU; ``result`` waits for it (GIL released) as a token read does."""

    def __init__(self, runner: StubRunner, entry: tuple[float, int, int, float], done_at: float, out):
        self.runner, self.entry, self.done_at, self.out = runner, entry, done_at, out

    def result(self):
        wait = self.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        start, rows, fed, gpu_s = self.entry
        self.runner.log.append((start, time.perf_counter(), rows, fed, gpu_s))
        return self.out


class StubRunnerNoHook(StubRunner):
    """A runner without ``on_launched``: the engine hands events over before launching the step."""

    def step(self, rows, slots, sample, want_logprobs=False, score=None):
        return super().step(rows, slots, sample, want_logprobs, score)


def make_runner(args, slots: int, tokenizer) -> StubRunner:
    cls = StubRunnerNoHook if args.flush_before_launch else StubRunner
    return cls(slots, GpuModel(args.gpu_ms), text_token_ids(tokenizer), args.launch_ops, args.launch_op_us,
               args.sampler_ms, eager_host_ms=args.eager_host_ms)


def percentile(values: Sequence[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def step_stats(log: Sequence[tuple[float, float, int, int, float]], rows: int) -> dict:
    """Full decode steps (``rows`` rows, one token each) followed by another step: period, host time
    between steps, time the step took beyond its GPU time."""
    period, host, over = [], [], []
    for (s0, e0, r0, f0, g0), (s1, _, _, _, _) in zip(log, log[1:]):
        if r0 == rows and f0 == rows:
            period.append((s1 - s0) * 1000)
            host.append((s1 - e0) * 1000)
            over.append((e0 - s0 - g0) * 1000)
    gpu = log[0][4] * 1000 if log else float("nan")
    for s in log:
        if s[2] == rows and s[3] == rows:
            gpu = s[4] * 1000
            break
    r2 = lambda x: round(x, 3)  # noqa: E731
    mean = lambda xs: r2(statistics.fmean(xs)) if xs else None  # noqa: E731
    return {"decode_steps": len(period), "gpu_ms": r2(gpu),
            "period_ms_p50": r2(percentile(period, 0.5)), "period_ms_mean": mean(period),
            "host_ms_p50": r2(percentile(host, 0.5)), "host_ms_mean": mean(host),
            "host_ms_p99": r2(percentile(host, 0.99)),
            "step_over_gpu_ms_p50": r2(percentile(over, 0.5))}


def sampling():
    from infer.sampler import SamplingParams
    return SamplingParams(temperature=1.0, top_p=0.9, logit_bias={0: -100.0})


def server_engine(args, runner, tokenizer):
    """The engine as app.py builds it on a GPU (which the stub stands for), with app.py's prompt budgets."""
    from app import GPU_PREFILL_STEP_TOKENS, build_parser
    from infer.engine import Engine
    return Engine(runner, tokenizer, prefill_chunk_size=build_parser().get_default("prefill_chunk_size"),
                  prefill_step_tokens=GPU_PREFILL_STEP_TOKENS, decode_ahead=args.decode_ahead)


# ---------------------------------------------------------------------------- (a) engine alone
def engine_level(args, tokenizer, n: int) -> dict:
    """``run_once`` on this thread; events go into lists (no consumer)."""
    from infer.engine import GenerationOptions, Request, RowFinished
    runner = make_runner(args, max(n, 1), tokenizer)
    engine = server_engine(args, runner, tokenizer)
    prompt = tokenizer.encode(PROMPT)
    options = GenerationOptions(max_tokens=args.max_tokens, stop=args.stop, sampling=sampling())
    sinks = [[] for _ in range(n)]
    for s in sinks:
        engine.submit(Request([prompt], options, s.append))
    profiler = None
    if args.cprofile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    started = time.perf_counter()
    while engine.run_once():
        pass
    wall = time.perf_counter() - started
    if profiler is not None:
        profiler.disable()
        import pstats
        print(f"--- cProfile, engine alone, {n} rows (stub sleep included)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    assert all(isinstance(s[-1], RowFinished) and s[-1].completion_tokens == args.max_tokens for s in sinks)
    return {"rows": n, **step_stats(runner.log, n), "wall_s": round(wall, 3)}


def bridge_level(args, tokenizer, n: int) -> dict:
    """The engine thread feeding n EventStreams read by this thread's asyncio loop (no HTTP)."""
    from infer.api.bridge import EventStream, RowGroup
    from infer.engine import GenerationOptions, RowText
    runner = make_runner(args, max(n, 1), tokenizer)
    engine = server_engine(args, runner, tokenizer)
    prompt = tokenizer.encode(PROMPT)
    options = GenerationOptions(max_tokens=args.max_tokens, stop=args.stop, sampling=sampling())

    async def consume(stream: EventStream) -> int:
        tokens = 0
        async for events in stream.batches():
            tokens += sum(1 for e in events if isinstance(e, RowText))
        return tokens

    async def run() -> list[int]:
        streams = [EventStream(engine, [RowGroup([prompt], options)]) for _ in range(n)]
        for s in streams:
            s.submit()
        return await asyncio.gather(*(consume(s) for s in streams))

    engine.start()
    try:
        started = time.perf_counter()
        counts = asyncio.run(run())
        wall = time.perf_counter() - started
    finally:
        engine.shutdown()
    assert counts == [args.max_tokens] * n, counts[:4]
    return {"rows": n, **step_stats(runner.log, n), "wall_s": round(wall, 3)}


# ---------------------------------------------------------------------------- (b) http: server
def serve(args) -> None:
    import uvicorn
    from fastapi.responses import JSONResponse

    from infer.api.context import ServerContext
    from infer.api.server import create_app
    from infer.prefix_cache import PrefixCache
    from infer.tokenizer import load_world_tokenizer

    sys.setswitchinterval((args.switch_interval_ms or DEFAULT_GIL_SWITCH_MS) / 1000)  # as app.py's --gil-switch-ms
    tokenizer = load_world_tokenizer()
    runner = make_runner(args, args.slots, tokenizer)
    engine = server_engine(args, runner, tokenizer)
    prefix_cache = PrefixCache("2GiB", block=256, registry=engine.metrics.registry)  # as app.py's default
    app = create_app(ServerContext(engine, load_world_tokenizer(), "bench-stub", prefix_cache=prefix_cache,
                                   stream_interval=args.stream_interval))
    def thread_cpu() -> dict[str, float]:
        """CPU seconds (user + system) of the event loop thread, the engine thread and the rest."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {"loop": 0.0, "engine": 0.0, "other": 0.0}
        for tid in os.listdir("/proc/self/task"):
            try:
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            name = ("loop" if int(tid) == os.getpid() else
                    "engine" if int(tid) == engine._thread.native_id else "other")
            out[name] += (int(fields[11]) + int(fields[12])) / tick
        return out

    mark = {"cpu": time.process_time(), "wall": time.perf_counter(), "threads": {}}

    profiler = None

    async def stats(reset: int = 0):
        nonlocal profiler
        log = list(runner.log)
        threads = thread_cpu()
        body = {"log": log, "cpu_s": time.process_time() - mark["cpu"], "wall_s": time.perf_counter() - mark["wall"],
                "thread_cpu_s": {k: round(v - mark["threads"].get(k, 0.0), 2) for k, v in threads.items()}}
        if profiler is not None:  # the event loop thread since the last reset
            profiler.disable()
            body["loop_profile"] = top_functions(profiler)
            profiler = None
        if reset:
            runner.log.clear()
            mark.update(cpu=time.process_time(), wall=time.perf_counter(), threads=threads)
            if args.cprofile:
                import cProfile
                profiler = cProfile.Profile(time.thread_time)  # CPU time: a wait for the GIL is not charged
                profiler.enable()  # this thread only: the event loop
        return JSONResponse(body)

    app.add_api_route("/bench/stats", stats, methods=["GET"])
    engine.start()
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", loop=args.loop, http=args.http)
    finally:
        engine.shutdown()


def top_functions(profiler, n: int = 25) -> dict:
    """cProfile of the event loop: the functions with the most own time, the share of all, and their main caller."""
    import pstats
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ncalls, tottime, cumtime, callers)
    total = sum(v[2] for v in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    def where(key) -> str:
        file, line, name = key
        return f"{name} ({Path(file).name}:{line})"

    def top_caller(callers: dict) -> str:  # the caller that accounts for most of the function's own time
        return where(max(callers, key=lambda c: callers[c][2])) if callers else ""

    return {"total_s": round(total, 3), "top_self": [
        (where(key), calls, round(100 * tt / total, 1), round(100 * ct / total, 1), top_caller(callers))
        for key, (_, calls, tt, ct, callers) in rows]}


# ---------------------------------------------------------------------------- (b) http: client
async def _client_stream(port: int, body: bytes) -> tuple[list[float], int]:
    """One streaming request over a raw connection: its start and the arrival times of the chunks that
    carry text, and the output tokens of its usage chunk (a chunk can carry several tokens)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    times = [time.perf_counter()]
    writer.write(head + body)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP status {status!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    assert chunked
    buf = b""
    done = False
    tokens = 0
    while not done:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            break
        data = await reader.readexactly(size + 2)
        now = time.perf_counter()
        buf += data[:-2]
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            if event == b"data: [DONE]":
                done = True
                break
            chunk = json.loads(event[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(now)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    writer.close()
    return times, tokens


def client(args) -> None:
    body = json.dumps({"model": "bench", "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 1.0,
                       "top_p": 0.9, "stream": True, "stream_options": {"include_usage": True},
                       "logit_bias": {"0": -100},
                       **({"stop": args.stop} if args.stop else {})}).encode()

    async def run() -> list[tuple[list[float], int]]:
        return await asyncio.gather(*(_client_stream(args.port, body) for _ in range(args.n)))

    cpu = time.process_time()
    streams = asyncio.run(run())
    print(json.dumps({"streams": [t for t, _ in streams], "tokens": [n for _, n in streams],
                      "cpu_s": time.process_time() - cpu}))


# ---------------------------------------------------------------------------- (b) http: driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stub_args(args) -> list[str]:
    return [*(["--flush-before-launch"] if args.flush_before_launch else []),
            *(["--decode-ahead"] if args.decode_ahead else []), "--gpu-ms", args.gpu_ms,
            "--launch-ops", str(args.launch_ops), "--launch-op-us", str(args.launch_op_us),
            "--sampler-ms", str(args.sampler_ms), "--eager-host-ms", str(args.eager_host_ms),
            "--max-tokens", str(args.max_tokens),
            "--stream-interval", str(args.stream_interval),
            *(["--stop", *args.stop] if args.stop else [])]


def get_json(port: int, path: str) -> dict:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.loads(r.read())


def run_clients(args, port: int, n: int, max_tokens: int) -> dict:
    cmd = [sys.executable, __file__, "client", "--port", str(port), "--n", str(n), "--max-tokens", str(max_tokens),
           *(["--stop", *args.stop] if args.stop else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"client failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def http_levels(args, levels: list[int]) -> tuple[list[dict], dict | None]:
    port = free_port()
    slots = max(levels)
    cmd = [sys.executable, __file__, "serve", "--port", str(port), "--slots", str(slots), "--loop", args.loop,
           "--http", args.http, *stub_args(args), *(["--cprofile"] if args.cprofile else []),
           *(["--switch-interval-ms", str(args.switch_interval_ms)] if args.switch_interval_ms is not None else [])]
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows, profile = [], None
    gpu = GpuModel(args.gpu_ms)
    try:
        for _ in range(600):
            try:
                get_json(port, "/health")
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError("server exited during startup")
                time.sleep(0.2)
        run_clients(args, port, 2, 4)  # warm-up
        for n in levels:
            get_json(port, "/bench/stats?reset=1")
            started = time.perf_counter()
            result = run_clients(args, port, n, args.max_tokens)
            wall = time.perf_counter() - started
            stats = get_json(port, "/bench/stats?reset=1")
            streams = result["streams"]
            itl = [(b - a) * 1000 for s in streams for a, b in zip(s[1:], s[2:])]
            ttft = [(s[1] - s[0]) * 1000 for s in streams if len(s) > 1]
            tokens = sum(result["tokens"])
            # steady state: while every stream is between its first and last token (text chunks: a lower bound
            # on tokens when chunks carry several)
            lo, hi = max(s[1] for s in streams), min(s[-1] for s in streams)
            steady = sum(1 for s in streams for t in s[1:] if lo < t <= hi)
            server_steps = step_stats([tuple(x) for x in stats["log"]], n)
            steps, threads = max(len(stats["log"]), 1), stats["thread_cpu_s"]
            ideal_ms = gpu.ms(n)
            rows.append({
                "clients": n, "output_tokens": tokens, "text_chunks": sum(len(s) - 1 for s in streams),
                "wall_s": round(wall, 2),
                "tok_s": round(tokens / (max(s[-1] for s in streams) - min(s[0] for s in streams)), 1),
                "steady_tok_s": round(steady / (hi - lo), 1) if hi > lo else None,
                "ideal_tok_s": round(n / ideal_ms * 1000, 1), "gpu_ms": round(ideal_ms, 2),
                "ttft_ms_p50": round(percentile(ttft, 0.5), 1), "ttft_ms_p99": round(percentile(ttft, 0.99), 1),
                "itl_ms_p50": round(percentile(itl, 0.5), 2), "itl_ms_p99": round(percentile(itl, 0.99), 2),
                "server": {**server_steps, "cpu_s": round(stats["cpu_s"], 2), "wall_s": round(stats["wall_s"], 2),
                           "thread_cpu_s": threads, "steps": len(stats["log"]),
                           "loop_cpu_ms_per_step": round(1000 * threads["loop"] / steps, 2),
                           "engine_cpu_ms_per_step": round(1000 * threads["engine"] / steps, 2)},
                "client_cpu_s": round(result["cpu_s"], 2),
                **({"loop_profile": stats["loop_profile"]} if "loop_profile" in stats else {})})
            print(json.dumps(rows[-1]), flush=True)
        if args.profile:  # a separate, unmeasured run of the top level under py-spy (it slows the server)
            profile = recorded(server.pid, lambda: run_clients(args, port, max(levels), args.max_tokens), args.label,
                               gil=True)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return rows, profile


# ---------------------------------------------------------------------------- report
def print_table(data: dict) -> None:
    labels = list(data["runs"])
    print("\n(a) engine host ms per full decode step beyond the simulated GPU time (p50 / mean)")
    print(f"{'label':>10} {'mode':>7} {'rows':>5} {'gpu ms':>7} {'period p50':>10} {'host p50':>9} {'host mean':>9}")
    for label in labels:
        for mode in ("engine", "bridge"):
            for r in data["runs"][label].get(mode, []):
                print(f"{label:>10} {mode:>7} {r['rows']:>5} {r['gpu_ms']:>7} {r['period_ms_p50']:>10} "
                      f"{r['host_ms_p50']:>9} {r['host_ms_mean']:>9}")
    print("\n(b) HTTP, N streaming /v1/completions clients (client process separate)")
    print(f"{'label':>10} {'N':>4} {'tok/s':>8} {'steady':>8} {'ideal':>8} {'ITL p50':>8} {'ITL p99':>8} {'gpu ms':>7} "
          f"{'TTFT p50':>8} {'srv period':>10} {'srv host':>9} {'srv cpu%':>8} {'cli cpu%':>8}")
    for label in labels:
        for r in data["runs"][label].get("http", []):
            s = r["server"]
            wall = max(s["wall_s"], 1e-9)
            print(f"{label:>10} {r['clients']:>4} {r['tok_s']:>8} {r['steady_tok_s']!s:>8} {r['ideal_tok_s']:>8} "
                  f"{r['itl_ms_p50']:>8} {r['itl_ms_p99']:>8} {r['gpu_ms']:>7} {r['ttft_ms_p50']:>8} "
                  f"{s['period_ms_p50']:>10} {s['host_ms_p50']:>9} {100 * s['cpu_s'] / wall:>8.0f} "
                  f"{100 * r['client_cpu_s'] / r['wall_s']:>8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", default="bench", choices=("bench", "serve", "client"))
    ap.add_argument("--label", default="current", help="key of this run in the result file")
    ap.add_argument("--levels", default="1,32,256")
    ap.add_argument("--only", choices=("engine", "bridge", "http"), action="append",
                    help="run only these measurements (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stop", nargs="*", default=[],
                    help="stop strings for every request (none match the stub's text)")
    ap.add_argument("--gpu-ms", default=DEFAULT_GPU_MS,
                    help="fed tokens:ms points of the simulated GPU time, or one ms for every step")
    ap.add_argument("--launch-ops", type=int, default=24, help="torch calls per step (each drops the GIL once)")
    ap.add_argument("--launch-op-us", type=float, default=10.0, help="Python time of one torch call")
    ap.add_argument("--sampler-ms", type=float, default=0.0, help="extra GPU time per step after the last launch")
    ap.add_argument("--eager-host-ms", type=float, default=0.0,
                    help="host time (GIL held, in --launch-op-us pieces) of a step that CUDA graphs do not cover, "
                         "e.g. 8 for the 1.5B forward's eager launches on an H200 (bench/results/mixed_steps_h200.json)")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy --gil of the server at the largest http level (the GIL holder only)")
    ap.add_argument("--cprofile", action="store_true",
                    help="cProfile the engine-alone runs and the server's event loop thread (slows both)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval of the server process (default: app.py's --gil-switch-ms default)")
    ap.add_argument("--stream-interval", type=int, default=1, help="app.py's --stream-interval")
    ap.add_argument("--flush-before-launch", action="store_true",
                    help="stub without on_launched: the engine wakes the event loop before each launch")
    ap.add_argument("--decode-ahead", action="store_true",
                    help="the engine queues each decode step before reading the last one's tokens")
    ap.add_argument("--loop", default="auto")
    ap.add_argument("--http", default="auto")
    ap.add_argument("--out", default=str(RESULTS))
    # internal roles
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--n", type=int, default=1)
    args = ap.parse_args()
    if args.role == "serve":
        return serve(args)
    if args.role == "client":
        return client(args)

    from infer.tokenizer import load_world_tokenizer
    levels = [int(x) for x in args.levels.split(",")]
    only = set(args.only or ("engine", "bridge", "http"))
    tokenizer = load_world_tokenizer()
    run: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=REPO).stdout.strip(),
                 "config": {"gpu_ms": args.gpu_ms, "launch_ops": args.launch_ops, "launch_op_us": args.launch_op_us,
                            "sampler_ms": args.sampler_ms, "eager_host_ms": args.eager_host_ms,
                            "max_tokens": args.max_tokens, "stop": args.stop,
                            "flush_before_launch": args.flush_before_launch, "decode_ahead": args.decode_ahead,
                            "stream_interval": args.stream_interval,
                            "server_switch_interval_ms": args.switch_interval_ms or DEFAULT_GIL_SWITCH_MS}}
    if "engine" in only:
        run["engine"] = []
        for n in levels:
            run["engine"].append(engine_level(args, tokenizer, n))
            print("engine", json.dumps(run["engine"][-1]), flush=True)
    if "bridge" in only:
        run["bridge"] = []
        for n in levels:
            run["bridge"].append(bridge_level(args, tokenizer, n))
            print("bridge", json.dumps(run["bridge"][-1]), flush=True)
    if "http" in only:
        import importlib.util
        run["config"]["uvicorn"] = {"loop": args.loop, "http": args.http,
                                    "uvloop": importlib.util.find_spec("uvloop") is not None,
                                    "httptools": importlib.util.find_spec("httptools") is not None}
        run["http"], profile = http_levels(args, levels)
        if profile is not None:
            run["profile_top_level"] = profile
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data.setdefault("machine", {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "python": platform.python_version()})
    data.setdefault("runs", {})[args.label] = run
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print_table(data)
    for r in run.get("http", [])[-1:]:
        if "loop_profile" in r:
            print(f"\ncProfile of the event loop thread, {r['clients']} clients "
                  f"({r['loop_profile']['total_s']} s profiled): own % / inclusive %")
            for name, calls, own, incl, caller in r["loop_profile"]["top_self"][:20]:
                print(f"  {own:5.1f} {incl:5.1f} {calls:>8}  {name}  <- {caller}")
    if run.get("profile_top_level"):
        print_profile(run["profile_top_level"])


if __name__ == "__main__":
    main()
