"""Where one decode step's GPU time goes: per-kernel device time (torch.profiler / CUPTI) of the
model forward at given sizes and batch sizes, against the step time of the same forward replayed as
a CUDA graph. The difference between the two is what the kernels' boundaries cost (launch, drain,
ramp-up), the part that fewer or overlapping launches can remove.

    python bench/profile_decode.py --sizes 1.5b,7.2b --batches 1,256 --out bench/results/profile_h200.json

With ``--prompts 1x1024,16x1024`` it profiles prefill forwards instead (rows x tokens each, eager, as the
engine runs them), timed with CUDA events, and the same forward captured as a CUDA graph (``graph_step_us``;
the eager time above it is what issuing the launches from the host costs). Every row lists the largest idle
gaps between consecutive kernels (``gaps``: the kernels on either side, µs averaged over the steps).

    python bench/profile_decode.py --sizes 7.2b --batches "" --prompts 1x1024 --out bench/results/profile_prefill_h200.json

``--engine cutlass`` (W8A16) or ``gemlite:FORMAT`` quantizes the random weights in memory as bench_decode does.

    python bench/profile_decode.py --engine cutlass --sizes 7.2b --batches 1 --out bench/results/profile_w8_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bench_decode  # noqa: E402
from bench.bench_decode import ENGINES, capture, data_dir, load_model, static_batch, time_steps  # noqa: E402
from infer.batch import PackedBatch  # noqa: E402


def short_name(name: str) -> str:
    """A kernel's name without template arguments and parameter lists, cut to 60 characters."""
    for sep in ("<", "("):
        name = name.split(sep)[0]
    return name.removeprefix("void ")[:60]


def kernel_times(fn, steps: int) -> tuple[dict[str, dict], float, list, dict]:
    """Per kernel name: launches and device µs per step; the summed kernel µs per step; the step's
    launches in order, [name, µs averaged over the steps] (which matrix each GEMV launch reads follows
    from the forward's order); and the idle time between consecutive launches within a step (total and the
    largest gaps)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    for event in kernels:
        entry = per[short_name(event.name)]
        entry[0] += 1
        entry[1] += event.device_time
    table = {name: {"launches_per_step": round(n / steps, 2), "us_per_step": round(us / steps, 1)}
             for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])}
    kernels.sort(key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    whole = per_step * steps == len(kernels)
    sequence = [[short_name(kernels[i].name),
                 round(sum(kernels[s * per_step + i].device_time for s in range(steps)) / steps, 2)]
                for i in range(per_step)] if whole else []
    return table, sum(v["us_per_step"] for v in table.values()), sequence, idle_gaps(kernels, steps) if whole else {}


def idle_gaps(kernels: list, steps: int, top: int = 12) -> dict:
    """The device's idle time between launch i and i + 1 of a step (next start - this end, averaged over the
    steps; overlapping launches count 0): the total per step and the ``top`` largest, with their neighbours."""
    per_step = len(kernels) // steps
    gaps = []
    for i in range(per_step - 1):
        idle = sum(max(0.0, kernels[s * per_step + i + 1].time_range.start - kernels[s * per_step + i].time_range.end)
                   for s in range(steps)) / steps
        gaps.append((idle, i, short_name(kernels[i].name), short_name(kernels[i + 1].name)))
    largest = sorted(gaps, reverse=True)[:top]
    return {"idle_us_per_step": round(sum(g[0] for g in gaps), 1),
            "largest": [{"after_launch": i, "after": a, "before": b, "us": round(us, 2)} for us, i, a, b in largest]}


def profile_size(name: str, batches: list[int], prompts: list[tuple[int, int]], steps: int, forward: str,
                 engine: str = "fp16", state: str = "fp32") -> list[dict]:
    bench_decode.FORWARD.update(fused="on" if forward == "fused" else "off", wkv="cuda")
    model = load_model(name, engine)
    if engine.startswith("gemlite"):  # GemLite's kernels tuned for these sizes before they are timed
        from infer.quant.engines import warm_up_gemlite
        warm_up_gemlite(model, batches + [count * length for count, length in prompts], data_dir())
    rows = []
    for B in batches:  # decode steps, replayed as CUDA graphs
        pool = model.new_state_pool(B, torch.float16 if state == "fp16" else torch.float32)
        batch = static_batch(torch.randint(1, 65530, (B,)).tolist(), list(range(B)))
        graph, _ = capture(model, batch, pool)
        rows.append(profile_step(graph.replay, steps, {"size": name, "engine": engine, "batch": B, "state": state,
                                                     "forward": forward}))
        del graph, pool
        torch.cuda.empty_cache()
    for count, length in prompts:  # prefill forwards, eager as the engine runs them
        pool = model.new_state_pool(count)
        batch = PackedBatch.from_rows([torch.randint(1, 65530, (length,)).tolist() for _ in range(count)],
                                      list(range(count)), "cuda")
        row = profile_step(lambda: model.forward(batch, pool), max(2, steps // 4),
                           {"size": name, "engine": engine, "prompts": count, "prompt_tokens": length,
                            "forward": forward})
        try:  # the same forward as a CUDA graph: no host in the way (and proof that it never syncs the host)
            graph, _ = capture(model, batch, pool)
            row["graph_step_us"] = round(time_steps(graph.replay, max(2, steps // 4) * 3) * 1e6, 1)
            del graph
        except Exception as err:  # noqa: BLE001 - reported, not fatal: the eager figures stand
            row["graph_error"] = f"{type(err).__name__}: {err}"[:300]
        print(f"  as a CUDA graph: {row.get('graph_step_us', row.get('graph_error'))}", flush=True)
        rows.append(row)
        del pool
        torch.cuda.empty_cache()
    return rows


def profile_step(fn, steps: int, row: dict) -> dict:
    """Time ``fn`` (one step) with CUDA events and per kernel with the profiler; print and return ``row``
    completed with both."""
    step_us = time_steps(fn, steps * 3) * 1e6
    kernels, kernel_us, sequence, gaps = kernel_times(fn, steps)
    launches = sum(v["launches_per_step"] for v in kernels.values())
    row.update({"step_us": round(step_us, 1), "kernel_us_per_step": round(kernel_us, 1),
                "launches_per_step": round(launches, 1),
                "boundary_us_per_launch": round((step_us - kernel_us) / max(launches, 1), 2),
                "kernels": kernels, "gaps": gaps, "sequence": sequence})
    what = f"batch {row['batch']}" if "batch" in row else f"prefill {row['prompts']} x {row['prompt_tokens']}"
    print(f"\n{row['size']} {row['engine']} {what} ({row['forward']}): step {step_us:.0f} us, kernels "
          f"{kernel_us:.0f} us in {launches:.0f} launches, {row['boundary_us_per_launch']} us per boundary", flush=True)
    for kname, v in list(kernels.items())[:14]:
        print(f"  {v['us_per_step']:>9.1f} us {v['launches_per_step']:>6.1f}x  {kname}", flush=True)
    if gaps:
        print(f"  idle between launches: {gaps['idle_us_per_step']} us per step; largest:", flush=True)
        for g in gaps["largest"][:6]:
            print(f"    {g['us']:>8.1f} us after launch {g['after_launch']} ({g['after']} -> {g['before']})", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.5b,7.2b")
    ap.add_argument("--batches", default="1,256", help="decode batch sizes ('' for none)")
    ap.add_argument("--prompts", default="", help="prefill forwards to profile, ROWSxTOKENS, e.g. 1x1024,16x1024")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--forward", default="fused", choices=("fused", "readable"))
    ap.add_argument("--engine", default="fp16", choices=ENGINES, help="weights: fp16, W8A16 or a GemLite format")
    ap.add_argument("--state", default="fp32", choices=("fp32", "fp16"), help="WKV state storage of the decode steps")
    ap.add_argument("--out", default="bench/results/profile_h200.json")
    args = ap.parse_args()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "profile": []}
    for name in args.sizes.split(","):
        batches = [int(b) for b in args.batches.split(",") if b]
        prompts = [tuple(int(n) for n in p.split("x")) for p in args.prompts.split(",") if p]
        result["profile"] += profile_size(name, batches, prompts, args.steps, args.forward, args.engine,
                                        args.state)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
