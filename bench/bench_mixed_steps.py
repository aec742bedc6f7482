"""A step of decoding rows and one short prompt (a request arriving while others stream): eager against replayed
from CUDA graphs (the decode graph, then the prompt's), wall time of ModelRunner.step (launch to tokens on the host)
at each number of decoding rows (StepGraphs.mixed_steps off and on).

    python bench/bench_mixed_steps.py --sizes 7.2b,1.5b --out bench/results/mixed_steps_h200.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_decode import load_model  # noqa: E402
from infer.runner import ModelRunner  # noqa: E402
from infer.sampler import SamplingParams  # noqa: E402


def step_ms(runner: ModelRunner, rows: list[list[int]], slots: list[int]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.step(rows, slots, [True] * len(rows))
    return 1e3 * (time.perf_counter() - start)


def measure(runner: ModelRunner, decoding: int, prompt_tokens: int, repeats: int) -> dict:
    """Median step time, eager and from graphs, of ``decoding`` one-token rows and a prompt; the two alternate."""
    slots = list(range(decoding + 1))
    rows = [[1 + s] for s in slots[:-1]] + [list(range(100, 100 + prompt_tokens))]
    for s in slots:
        runner.start_row(s, SamplingParams(temperature=0))
    times: dict[str, list[float]] = {"eager": [], "graphs": []}
    for i in range(repeats + 3):
        for path, mixed in (("eager", False), ("graphs", True)):
            runner.graphs.mixed_steps = mixed
            assert runner.graphs.covers(rows) == (path == "graphs")
            ms = step_ms(runner, rows, slots)
            if i >= 3:  # the first rounds load kernels and pick cuBLAS algorithms
                times[path].append(ms)
    for s in slots:
        runner.end_row(s)
    eager, graphs = statistics.median(times["eager"]), statistics.median(times["graphs"])
    return {"decoding_rows": decoding, "prompt_tokens": prompt_tokens, "eager_ms": round(eager, 3),
            "graphs_ms": round(graphs, 3), "eager_over_graphs": round(eager / graphs, 3),
            "eager_ms_all": [round(t, 3) for t in times["eager"]],
            "graphs_ms_all": [round(t, 3) for t in times["graphs"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7.2b,1.5b")
    ap.add_argument("--rows", default="1,4,16,32,64,96,128,256", help="decoding rows beside the prompt")
    ap.add_argument("--prompt-tokens", default="19,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    counts = [int(r) for r in args.rows.split(",")]
    results = {"gpu": torch.cuda.get_device_name(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "torch": torch.__version__, "method": "median wall time of ModelRunner.step (fp16 weights, fp32 state, "
               "greedy), eager and replayed alternating", "sizes": {}}
    for size in args.sizes.split(","):
        model = load_model(size, "fp16")
        runner = ModelRunner(model, max(counts) + 1, torch.float32, cuda_graphs=True)
        runner.graphs.warmup()
        timings = []
        for length in (int(n) for n in args.prompt_tokens.split(",")):
            for decoding in counts:
                timings.append(measure(runner, decoding, length, args.repeats))
                r = timings[-1]
                print(f"{size:>5} prompt {length:>3} + {decoding:>4} decoding rows: eager {r['eager_ms']:8.2f} ms  "
                      f"graphs {r['graphs_ms']:8.2f} ms  ({r['eager_over_graphs']:.2f}x)", flush=True)
        results["sizes"][size] = timings
        del runner, model
        torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{'size':>5} {'prompt':>6} {'rows':>5} {'eager ms':>9} {'graphs ms':>9} {'ratio':>6}")
    for size, timings in results["sizes"].items():
        for r in timings:
            print(f"{size:>5} {r['prompt_tokens']:>6} {r['decoding_rows']:>5} {r['eager_ms']:>9.2f} "
                  f"{r['graphs_ms']:>9.2f} {r['eager_over_graphs']:>6.2f}")


if __name__ == "__main__":
    main()
