"""Where a lone short request's time to first token goes inside the engine (no HTTP): the engine as app.py builds
it on a GPU (CUDA graphs, decode ahead, app.py's prompt budgets), run on this thread, one request at a time.

For each request: submit to first token (the engine's own TTFT) and the time of each engine round until then
(admission and the prompt step share one round); the first request is timed apart (what a server pays once,
without and with ``ModelRunner.warm_up_prompts``, which app.py runs). With --cprofile, the
host functions of one steady-state request's prompt step by their own time.

    python bench/profile_ttft.py --size 7.2b --prompt-tokens 19 --out bench/results/profile_ttft_h200.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import GPU_PREFILL_STEP_TOKENS, build_parser  # noqa: E402
from bench.bench_decode import load_model  # noqa: E402
from bench.bench_serving import STORY_PROMPT  # noqa: E402
from infer.engine import Engine, GenerationOptions, Request, RowText  # noqa: E402
from infer.runner import ModelRunner  # noqa: E402
from infer.sampler import SamplingParams  # noqa: E402
from infer.tokenizer import load_world_tokenizer  # noqa: E402



def build_engine(size: str, warm_up: bool, slots: int) -> Engine:
    model = load_model(size, "fp16")
    runner = ModelRunner(model, slots, torch.float32, cuda_graphs=True)
    runner.graphs.warmup()
    chunk = build_parser().get_default("prefill_chunk_size")
    if warm_up:
        runner.warm_up_prompts(sorted({16, chunk, GPU_PREFILL_STEP_TOKENS}))
    return Engine(runner, load_world_tokenizer(), prefill_chunk_size=chunk,
                  prefill_step_tokens=GPU_PREFILL_STEP_TOKENS, decode_ahead=True)


def one_request(engine: Engine, prompt: list[int], profiler: cProfile.Profile | None = None) -> dict:
    """Submit, run the engine on this thread until the first token, then until the request ends."""
    events = []
    done = []
    options = GenerationOptions(max_tokens=4, sampling=SamplingParams(temperature=1.0, top_p=0.9,
                                                                       logit_bias={0: -100.0}))
    request = Request([prompt], options, lambda e: (events.append((time.perf_counter(), e)),
                                                    done.append(1) if request.unfinished == 0 else None))
    torch.cuda.synchronize()
    submitted = time.perf_counter()
    engine.submit(request)
    marks = []
    if profiler is not None:
        profiler.enable()
    while not any(isinstance(e, RowText) for _, e in events):
        engine.run_once()
        marks.append(time.perf_counter())
    if profiler is not None:
        profiler.disable()
    first = next(t for t, e in events if isinstance(e, RowText))
    while not done:
        engine.run_once()
    while engine.run_once():
        pass
    return {"ttft_ms": round(1e3 * (first - submitted), 2), "steps_to_first_token": len(marks),
            "step_ms": [round(1e3 * (b - a), 2) for a, b in zip([submitted] + marks, marks)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="7.2b")
    ap.add_argument("--prompt-tokens", type=int, default=19, help="19: the serving benchmark's story request")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--runs", default="cold,warmed_up", help="engines timed: without and with the prompt warm-up")
    ap.add_argument("--out", default="bench/results/profile_ttft_h200.json")
    args = ap.parse_args()
    tokenizer = load_world_tokenizer()
    prompt = tokenizer.encode(STORY_PROMPT) if args.prompt_tokens == 19 else [1] * args.prompt_tokens
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "size": args.size, "prompt_tokens": len(prompt), "runs": {}}
    for key in args.runs.split(","):
        warm_up = key == "warmed_up"
        engine = build_engine(args.size, warm_up, args.slots)
        runs = [one_request(engine, prompt) for _ in range(args.requests)]
        steady = [r["ttft_ms"] for r in runs[1:]]
        result["runs"][key] = {"first": runs[0], "steady_ttft_ms_median": round(statistics.median(steady), 2),
                               "steady": runs[1:]}
        print(key, json.dumps(result["runs"][key]["first"]), "steady median", result["runs"][key][
            "steady_ttft_ms_median"], [r["step_ms"] for r in runs[1:3]], flush=True)
        if args.cprofile and warm_up:
            profiler = cProfile.Profile()
            one_request(engine, prompt, profiler)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            result["cprofile_tottime"] = text.getvalue()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumtime").print_stats(40)
            result["cprofile_cumtime"] = text.getvalue()
            print(result["cprofile_tottime"][:6000])
            print(result["cprofile_cumtime"][:8000])
        del engine
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'':>10} {'first TTFT':>10} {'steady TTFT':>11}  (ms, engine only)")
    for key, run in result["runs"].items():
        print(f"{key:>10} {run['first']['ttft_ms']:>10} {run['steady_ttft_ms_median']:>11}")


if __name__ == "__main__":
    main()
