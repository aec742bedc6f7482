"""Engine throughput and latency with a random model (no HTTP): CPU by default, or a GPU.

1. Aggregate output tokens/s for N concurrent requests (continuous batching) versus the same
   N requests run one after another; the concurrent run split into its ramp (until every request has
   its first token) and the steady decode after it, with the engine's own step count, mean step time,
   rows a step and steps queued ahead (its metrics).
2. Inter-token latency of running streams while a long prompt is admitted (chunked prefill
   interleaved with decode), versus the same streams alone.

    python bench/bench_engine.py [--n-layer 4 --n-embd 256] [--out bench/results/engine_cpu.json]
    python bench/bench_engine.py --device cuda --n-layer 32 --n-embd 4096 --requests 1,64,256 --slots 256 \
        --max-tokens 64 --graphs --decode-ahead --out bench/results/engine_h200_7.2b.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import CPU_PREFILL_STEP_TOKENS, GPU_PREFILL_STEP_TOKENS, build_parser  # noqa: E402
from infer.engine import Engine, GenerationOptions, Request, RowFinished, RowText  # noqa: E402
from infer.model import RWKV7  # noqa: E402
from infer.random_model import make_config, random_state_dict  # noqa: E402
from infer.runner import ModelRunner  # noqa: E402
from infer.sampler import SamplingParams  # noqa: E402
from infer.tokenizer import load_world_tokenizer  # noqa: E402


class Tracker:
    """Records token arrival times of one request (called on the engine thread). ``done``: the row has ended;
    ``counted``: the engine has also finished the step that ended it (its next flush point), so that step is in
    the engine's metrics."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.times: list[float] = []
        self.done = threading.Event()
        self.counted = threading.Event()

    def __call__(self, event):
        if isinstance(event, RowText):
            self.times.append(time.perf_counter())
        elif isinstance(event, RowFinished):
            self.done.set()
            self.engine.call_at_flush(self.counted.set)


def submit(engine: Engine, prompt: list[int], max_tokens: int) -> Tracker:
    tracker = Tracker(engine)
    # The random model may sample the end-of-document token; bias it away so every request runs full length.
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=1, logit_bias={0: -100.0})
    options = GenerationOptions(max_tokens=max_tokens, sampling=sampling)
    engine.submit(Request([prompt], options, tracker))
    return tracker


def sequential_throughput(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    started = time.perf_counter()
    trackers = []
    for p in prompts:
        trackers.append(submit(engine, p, max_tokens))
        trackers[-1].done.wait()
    return sum(len(t.times) for t in trackers) / (time.perf_counter() - started)


def engine_counts(engine: Engine) -> dict[str, float]:
    """The engine's step counters so far (its Prometheus metrics)."""
    value = engine.metrics.registry.get_sample_value
    return {"steps": value("rwkv_step_seconds_count") or 0.0, "step_s": value("rwkv_step_seconds_sum") or 0.0,
            "ahead": value("rwkv_decode_steps_ahead_total") or 0.0, "rows": value("rwkv_step_batch_rows_sum") or 0.0}


def concurrent_breakdown(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All of ``prompts`` submitted at once: tok/s, split into the ramp (until every request has its first token)
    and the steady decode after it, with the engine's own steps: how many, their mean duration and rows, and how
    many were queued ahead (--decode-ahead). Tells a host-bound engine (steps longer than the forward) from a slow
    ramp."""
    before = engine_counts(engine)
    started = time.perf_counter()
    trackers = [submit(engine, p, max_tokens) for p in prompts]
    for t in trackers:
        t.done.wait()
    ended = time.perf_counter()
    for t in trackers:  # the last step is observed after it ends its rows
        t.counted.wait()
    delta = {k: v - before[k] for k, v in engine_counts(engine).items()}
    all_started = max((t.times[0] for t in trackers if t.times), default=started)  # a request may end at once
    steady = sum(1 for t in trackers for x in t.times if x > all_started)
    steps = max(delta["steps"], 1.0)
    return {"tok_s": round(sum(len(t.times) for t in trackers) / (ended - started), 1),
            "last_first_token_ms": round(1000 * (all_started - started), 1),
            "steady_tok_s": round(steady / max(ended - all_started, 1e-9), 1),
            "steps": int(delta["steps"]), "step_ms_mean": round(1000 * delta["step_s"] / steps, 3),
            "rows_per_step": round(delta["rows"] / steps, 1), "steps_ahead": int(delta["ahead"])}


def gaps_ms(trackers: list[Tracker], start: float, end: float) -> list[float]:
    out = []
    for t in trackers:
        times = [x for x in t.times if start <= x <= end]
        out += [(b - a) * 1000 for a, b in zip(times, times[1:])]
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=None,
                    help="prompt tokens a step while streams decode, for prompts longer than this (default: app.py's "
                         "--prefill-chunk-size)")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="most prompt tokens a step (default: app.py's rule, 2048 on a GPU and 512 on the CPU)")
    ap.add_argument("--requests", default="1,8,32", help="concurrency levels")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--graphs", action="store_true", help="decode through CUDA graphs (GPU)")
    ap.add_argument("--decode-ahead", action="store_true",
                    help="queue the next decode step before reading the last one's tokens (the server's GPU default)")
    ap.add_argument("--out", default="bench/results/engine_cpu.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    config = make_config(args.n_layer, args.n_embd, 65536)
    on_gpu = args.device != "cpu"
    sd = random_state_dict(config, seed=1, dtype=torch.float16 if on_gpu else torch.float32, device=args.device)
    model = RWKV7.from_state_dict(sd, device=args.device)
    if on_gpu:  # the server's kernels
        from infer.ops.fused import select_fused
        from infer.ops.wkv_cuda import select_wkv
        model.wkv = select_wkv(model.device)
        select_fused(model, "auto")
    runner = ModelRunner(model, args.slots, cuda_graphs=args.graphs)
    runner.warm_up_graphs()
    tokenizer = load_world_tokenizer()
    # the server's prompt budgets, so that the ramp of a burst is the server's
    args.chunk = args.chunk or build_parser().get_default("prefill_chunk_size")
    args.step_tokens = args.step_tokens or max(args.chunk, GPU_PREFILL_STEP_TOKENS if on_gpu else CPU_PREFILL_STEP_TOKENS)
    engine = Engine(runner, tokenizer, prefill_chunk_size=args.chunk, prefill_step_tokens=args.step_tokens,
                    decode_ahead=args.decode_ahead)
    engine.start()
    prompt = tokenizer.encode("User: write a short story about a lighthouse keeper.\n\nAssistant:")
    concurrent_breakdown(engine, [prompt] * 2, 4)  # warm-up

    rows = []
    for n in [int(x) for x in args.requests.split(",")]:
        prompts = [prompt] * n
        # one after another the rate does not depend on how many: time at most 8 of them
        seq = sequential_throughput(engine, prompts[:8], args.max_tokens)
        conc = concurrent_breakdown(engine, prompts, args.max_tokens)
        rows.append({"requests": n, "sequential_tok_s": round(seq, 1), "concurrent_tok_s": conc["tok_s"],
                     "speedup": round(conc["tok_s"] / seq, 2), "concurrent": conc})

    # Streams running while a long prompt arrives.
    streams = [submit(engine, prompt, 10_000) for _ in range(8)]
    time.sleep(1.0)
    quiet_start = time.perf_counter()
    time.sleep(2.0)
    quiet_end = time.perf_counter()
    long_prompt = [int(x) for x in torch.randint(1, 65530, (args.long_prompt,))]
    long_tracker = submit(engine, long_prompt, 1)
    long_submit = time.perf_counter()
    long_tracker.done.wait()
    long_done = time.perf_counter()
    quiet = gaps_ms(streams, quiet_start, quiet_end)
    loaded = gaps_ms(streams, long_submit, long_done)
    engine.shutdown()

    latency = {
        "streams": 8, "long_prompt_tokens": args.long_prompt, "prefill_chunk_size": args.chunk,
        "prefill_step_tokens": args.step_tokens,
        "long_prompt_ttft_s": round(long_done - long_submit, 3),
        "itl_ms_without_long_prompt": {"p50": round(percentile(quiet, 0.5), 2), "p99": round(percentile(quiet, 0.99), 2),
                                       "max": round(max(quiet), 2)},
        "itl_ms_during_long_prefill": {"p50": round(percentile(loaded, 0.5), 2),
                                       "p99": round(percentile(loaded, 0.99), 2), "max": round(max(loaded), 2),
                                       "tokens_delivered": len(loaded)},
    }
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if on_gpu else None},
        "implementations": runner.implementations(),
        "model": config.describe(), "max_tokens": args.max_tokens, "decode_ahead": args.decode_ahead,
        "throughput": rows, "latency": latency,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    where = result["machine"]["gpu"] or f"CPU ({torch.get_num_threads()} threads)"
    print(f"model {config.describe()} on {where}, {args.max_tokens} tokens/request, {runner.implementations()}")
    print(f"{'requests':>8} {'sequential tok/s':>17} {'concurrent tok/s':>17} {'speedup':>8}")
    for r in rows:
        print(f"{r['requests']:>8} {r['sequential_tok_s']:>17} {r['concurrent_tok_s']:>17} {r['speedup']:>8}")
    print("concurrent: tok/s, last first token ms, steady tok/s; engine steps, mean ms, rows a step, ahead")
    for r in rows:
        c = r["concurrent"]
        print(f"{r['requests']:>8} {c['tok_s']:>9} {c['last_first_token_ms']:>9} {c['steady_tok_s']:>9}   "
              f"{c['steps']:>5} {c['step_ms_mean']:>8} {c['rows_per_step']:>6} {c['steps_ahead']:>5}")
    q, l = latency["itl_ms_without_long_prompt"], latency["itl_ms_during_long_prefill"]
    print(f"8 streams, inter-token ms p50/p99/max: alone {q['p50']}/{q['p99']}/{q['max']}; while a "
          f"{args.long_prompt}-token prompt prefills in chunks of {args.chunk}: {l['p50']}/{l['p99']}/{l['max']} "
          f"(prompt TTFT {latency['long_prompt_ttft_s']} s)")


if __name__ == "__main__":
    main()
