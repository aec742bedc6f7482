"""The grouped GEMV launches of one 7.2B (or 1.5B) decode layer at batch 1, each alone: where a launch's time
goes against the bytes it streams. Each variant is captured as a CUDA graph of one launch per layer, every
layer with its own weights (so they come from HBM, as in a decode step), and reported in us per launch and
TB/s. Variants regroup the same matrices (r/k/v with or without the LoRA first halves, the LoRA alone, the
LoRA first) to find what costs the r/k/v launch its extra time over the FFN key's (profile_nopdl_*.json).

    python bench/bench_gemv.py --size 7.2b --out bench/results/gemv_h200.json
    python bench/bench_gemv.py --weights uint4 --rows 2 ...   # GemLite A16W4 words (int8: W8A16), 2 rows of x
    ncu ... python bench/bench_gemv.py --weights int8 --once  # each launch once, eagerly, for a profiler
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
from types import SimpleNamespace

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
            "ffn value": [("fv", C, ffn, EPI_NONE)],
            "output": [("o", C, C, EPI_NONE)]}


GROUP = 64  # 4-bit: input columns per scale and zero (GemLite A16W4_HQQ_INT, group 64)


def random_layer(out: int, inp: int, weights: str):
    """A linear layer of random weights as the grouped GEMV reads it: fp16, int8 with fp16 scales (W8A16), or
    GemLite's packed 4-bit words with fp16 scales and zeros per group of 64 inputs."""
    if weights == "fp16":
        return DenseLinear(torch.randn(out, inp, device="cuda", dtype=torch.float16) * 0.02)
    if weights == "int8":
        q = torch.randint(-128, 128, (out, inp), device="cuda", dtype=torch.int8)
        scale = torch.rand(out, device="cuda", dtype=torch.float16) * 1e-3
        return SimpleNamespace(int8_rows=(q, scale), in_features=inp, out_features=out)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (inp // 8, out), device="cuda", dtype=torch.int32)
    scale = torch.rand(inp // GROUP, out, device="cuda", dtype=torch.float16) * 1e-3
    zero = -8 * scale
    return SimpleNamespace(uint4_groups=(words, scale, zero, GROUP), in_features=inp, out_features=out)


def matrix_weights(out: int, inp: int, weights: str) -> str:
    """The weights an engine of ``weights`` gives a matrix: the LoRA factors stay fp16 in every engine."""
    return weights if out >= 1024 and inp >= 1024 else "fp16"


def weight_bytes(out: int, inp: int, weights: str) -> int:
    """Bytes a launch streams for one matrix: the weights, and the scales (and 4-bit zeros)."""
    if weights == "fp16":
        return out * inp * 2
    if weights == "int8":
        return out * inp + out * 2
    return out * inp // 2 + 2 * (inp // GROUP) * out * 2


def make_launches(tasks, layers: int, rows: int, weights: str) -> list[list[tuple]]:
    """``layers`` launches of ``tasks``, each over weights of its own (so they come from HBM)."""
    launches = []
    for _ in range(layers):
        launch = []
        for _, out, inp, epi in tasks:
            w = random_layer(out, inp, matrix_weights(out, inp, weights))
            x = torch.randn(rows, inp, device="cuda", dtype=torch.float16)
            launch.append((w, x, torch.empty(rows, out, device="cuda", dtype=torch.float16), epi, None))
        launches.append(launch)
    return launches


def time_variant(kernels, launches: list[list[tuple]], steps: int) -> float:
    """us per launch, the launches replayed as one graph."""
    layers = len(launches)
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
    ap.add_argument("--weights", default="fp16", choices=["fp16", "int8", "uint4"])
    ap.add_argument("--rows", type=int, default=1, help="rows of x (the decode batch)")
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    ap.add_argument("--once", action="store_true", help="run each variant's launches once, eagerly (for ncu)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    kernels = load_fused_kernels()
    assert kernels is not None, "the fused kernels did not load"
    L, C = SIZES[args.size]
    cfg = make_config(L, C, 65536)
    ranks = {"w": cfg.rank_w, "a": cfg.rank_a, "g": cfg.rank_g, "v": cfg.rank_v}
    env = {k: v for k, v in os.environ.items() if k.startswith("RWKV_")}
    rows = []
    chosen = variants(C, ranks, cfg.ffn_dim)
    if args.only:
        chosen = {name: chosen[name] for name in args.only.split(",")}
    for name, tasks in chosen.items():
        launches = make_launches(tasks, 2 if args.once else args.layers, args.rows, args.weights)
        if args.once:
            for launch in launches:
                kernels.gemv(launch)
            torch.cuda.synchronize()
            print(f"{args.size} {args.weights} {name}: ran once", flush=True)
            continue
        us = time_variant(kernels, launches, args.steps)
        mb = sum(weight_bytes(out, inp, matrix_weights(out, inp, args.weights)) for _, out, inp, _ in tasks) / 1e6
        rows.append({"variant": name, "us": round(us, 2), "MB": round(mb, 2), "TB_s": round(mb / us, 3)})
        print(f"{args.size} {args.weights} x{args.rows} {name:>20}: {us:7.2f} us  {mb:7.1f} MB  {mb / us:5.2f} TB/s"
              f"  {env}", flush=True)
    if args.out and rows:
        result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
                  "size": args.size, "batch": args.rows, "weights": args.weights, "env": env, "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
