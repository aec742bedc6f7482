"""The grouped GEMV launches of one 7.2B (or 1.5B) decode layer at batch 1, each alone: where a launch's time
goes against the bytes it streams. Each variant is captured as a CUDA graph of one launch per layer, every
layer with its own weights (so they come from HBM, as in a decode step), and reported in us per launch and
TB/s. Variants regroup the same matrices (r/k/v with or without the LoRA first halves, the LoRA alone, the
LoRA first) to find what costs the r/k/v launch its extra time over the FFN key's (profile_nopdl_*.json).

    python bench/bench_gemv.py --size 7.2b --out bench/results/gemv_h200.json
    RWKV_PDL=0 python bench/bench_gemv.py ...   # without programmatic dependent launch
    RWKV_GEMV_SPLIT=0 python bench/bench_gemv.py ...   # without row splitting
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_decode import SIZES, time_steps  # noqa: E402
from infer.ops.fused import EPI_NONE, EPI_RELU_SQUARE, EPI_SIGMOID, EPI_TANH, load_fused_kernels  # noqa: E402
from infer.ops.linear import DenseLinear  # noqa: E402
from infer.random_model import make_config  # noqa: E402


def variants(C: int, ranks: dict[str, int], ffn: int) -> dict[str, list[tuple[str, int, int, int]]]:
    """name -> [(matrix, out, in, epilogue)] of one launch."""
    rkv = [("r", C, C, EPI_NONE), ("k", C, C, EPI_NONE), ("v", C, C, EPI_NONE)]
    lora = [("w1", ranks["w"], C, EPI_TANH), ("a1", ranks["a"], C, EPI_NONE), ("g1", ranks["g"], C, EPI_SIGMOID),
            ("v1", ranks["v"], C, EPI_NONE)]
    return {"rkv+lora (forward)": rkv + lora, "lora+rkv": lora + rkv, "rkv": rkv, "lora down": lora,
            "rkv as one matrix": [("rkv", 3 * C, C, EPI_NONE)], "ffn key": [("fk", ffn, C, EPI_RELU_SQUARE)],
            "output": [("o", C, C, EPI_NONE)]}


def time_variant(kernels, tasks, layers: int, steps: int) -> float:
    """us per launch of ``tasks``, replayed as a graph of ``layers`` launches over distinct weights."""
    launches = []
    for _ in range(layers):
        launch = []
        for _, out, inp, epi in tasks:
            w = DenseLinear(torch.randn(out, inp, device="cuda", dtype=torch.float16) * 0.02)
            x = torch.randn(1, inp, device="cuda", dtype=torch.float16)
            launch.append((w, x, torch.empty(1, out, device="cuda", dtype=torch.float16), epi, None))
        launches.append(launch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for launch in launches:
            kernels.gemv(launch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            kernels.gemv(launch)
    seconds = time_steps(graph.replay, steps)
    del graph, launches
    torch.cuda.empty_cache()
    return seconds / layers * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="7.2b", choices=list(SIZES))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    kernels = load_fused_kernels()
    assert kernels is not None, "the fused kernels did not load"
    L, C = SIZES[args.size]
    cfg = make_config(L, C, 65536)
    ranks = {"w": cfg.rank_w, "a": cfg.rank_a, "g": cfg.rank_g, "v": cfg.rank_v}
    env = {k: os.environ[k] for k in ("RWKV_PDL", "RWKV_GEMV_SPLIT") if k in os.environ}
    rows = []
    for name, tasks in variants(C, ranks, cfg.ffn_dim).items():
        us = time_variant(kernels, tasks, args.layers, args.steps)
        mb = sum(out * inp * 2 for _, out, inp, _ in tasks) / 1e6
        rows.append({"variant": name, "us": round(us, 2), "MB": round(mb, 2), "TB_s": round(mb / us, 3)})
        print(f"{args.size} {name:>20}: {us:7.2f} us  {mb:7.1f} MB  {mb / us:5.2f} TB/s  {env}", flush=True)
    if args.out:
        result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
                  "size": args.size, "batch": 1, "env": env, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
