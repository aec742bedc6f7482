"""Decode speed of the model forward on one GPU with random weights of the real shapes.

Checks first (small model): CUDA fp16 vs the CPU fp32 path (which matches the official package
to ~1e-5, see oracle_cpu.json): logit drift, greedy agreement, batch invariance, graph replay
equal to eager. Then times one decode step (forward only, no sampling) at several batch sizes,
eager and replayed as a CUDA graph, and reports tok/s and the share of the H200 limit for that
shape, batch, state dtype and weight format (bench/limits.py, after ../shared/spec/performance-limits.md
§3); prefill rows likewise against the prefill ceiling, and one-prompt rows' time against the TTFT floor.

    python bench/bench_decode.py --sizes 0.1b,1.5b,7.2b --batches 1,8,64,256,512 --states fp32,fp16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infer.batch import PackedBatch  # noqa: E402
from infer.model import RWKV7  # noqa: E402
from infer.ops.wkv import TorchWKV  # noqa: E402
from infer.ops.fused import select_fused  # noqa: E402
from infer.ops.wkv_cuda import select_wkv  # noqa: E402
from infer.random_model import data_dir, make_config, random_state_dict  # noqa: E402
from bench import limits  # noqa: E402

SIZES = {name: (shape.layers, shape.width) for name, shape in limits.SHAPES.items()}  # (L, C) of each benchmarked size
ENGINES = tuple(limits.ENGINE_FORMATS)  # --engine: fp16, cutlass (W8A16) or gemlite:FORMAT, each with its limit


def checks() -> dict:
    sd = random_state_dict(make_config(2, 128, 65536), seed=5, dtype=torch.float32)
    cpu = RWKV7.from_state_dict({k: v.clone() for k, v in sd.items()}, device="cpu")
    gpu = RWKV7.from_state_dict(sd, device="cuda", dtype="fp16")
    gpu.wkv = select_wkv(gpu.device, "cuda")
    select_fused(gpu, FORWARD["fused"])
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 65530, (64,), generator=g).tolist()
    want = cpu.prefill([prompt], [0], cpu.new_state_pool(1), all_logits=True)
    got = gpu.prefill([prompt], [0], gpu.new_state_pool(1), all_logits=True).cpu()
    drift = (got - want).abs().max().item()
    # greedy continuation
    pc, pg = cpu.new_state_pool(1), gpu.new_state_pool(1)
    a, b = cpu.prefill([prompt], [0], pc)[0], gpu.prefill([prompt], [0], pg)[0]
    same = 0
    for _ in range(32):
        ta, tb = int(a.argmax()), int(b.argmax())
        if ta != tb:
            break
        same += 1
        a, b = cpu.decode([ta], [0], pc)[0], gpu.decode([tb], [0], pg)[0]
    # batch invariance (eager) and graph == eager
    prompts = [torch.randint(1, 65530, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    pool = gpu.new_state_pool(8)
    together = gpu.prefill(prompts, [5, 1, 7, 2], pool)
    alone = torch.stack([gpu.prefill([p], [0], gpu.new_state_pool(1))[0] for p in prompts])
    invariant = (together - alone).abs().max().item()
    return {"fp16_cuda_vs_fp32_cpu_max_logit_diff": drift, "greedy_tokens_identical": same,
            "batch_vs_alone_max_diff": invariant, "graph_vs_eager_max_diff": graph_vs_eager(gpu)}


def graph_vs_eager(model: RWKV7) -> float:
    pool_a, pool_b = model.new_state_pool(4), model.new_state_pool(4)
    batch = static_batch([3, 11, 12], [0, 1, 2])
    eager = model.forward(batch, pool_a).clone()
    graph, out = capture(model, batch, pool_b)
    pool_b.reset([0, 1, 2])  # the warm-up runs inside capture() advanced the state
    graph.replay()
    torch.cuda.synchronize()
    return (out - eager).abs().max().item()


def static_batch(tokens: list[int], slots: list[int]) -> PackedBatch:
    return PackedBatch.from_rows([[t] for t in tokens], slots, "cuda")


def capture(model: RWKV7, batch: PackedBatch, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    return capture_calls(lambda: model.forward(batch, pool))


def capture_calls(fn):
    """``fn`` run twice on a side stream (warm-up), then captured as a CUDA graph: (graph, what fn returned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_steps(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / steps


def random_weights(config, engine: str) -> dict[str, torch.Tensor]:
    """Random weights for ``engine``: fp16, cutlass (W8A16) or gemlite:FORMAT, quantized in memory as the
    export tools would (GemLite without HQQ's zero-point refinement: speed does not depend on it)."""
    return engine_weights(random_state_dict(config, seed=0, dtype=torch.float16, device="cuda"), config, engine)


def engine_weights(sd: dict[str, torch.Tensor], config, engine: str, hqq: bool = False) -> dict[str, torch.Tensor]:
    """The fp16 checkpoint dict ``sd`` (on the GPU) converted in place for ``engine`` as its export tool
    converts a file (``hqq``: refine 4-bit zero points, the GemLite exporter's default)."""
    if engine == "cutlass":
        from infer.checkpoint import W8A16_MARKER, W8A16_VERSION
        from infer.quant.export_quant import quantize_matrix
        for key in config.linear_keys():
            sd.update(quantize_matrix(key, sd.pop(key)))
        sd[W8A16_MARKER] = torch.tensor(W8A16_VERSION, dtype=torch.int32)
    elif engine.startswith("gemlite:"):
        from infer.quant.export_quant_gemlite import markers, packer
        fmt = engine.split(":", 1)[1]
        convert = packer(fmt, 64, hqq, torch.device("cuda"))
        for key in config.linear_keys():
            sd.update({k: v.cuda() for k, v in convert(key, sd.pop(key)).items()})
        sd.update(markers(fmt, 64))
    return sd


def load_model(name: str, engine: str) -> RWKV7:
    """The random model of size ``name`` for ``engine`` on the GPU, forward chosen by --forward/--wkv."""
    L, C = SIZES[name]
    model = RWKV7.from_state_dict(random_weights(make_config(L, C, 65536), engine), device="cuda", dtype="fp16",
                                  engine=engine.split(":")[0])
    model.wkv = select_wkv(model.device, FORWARD["wkv"], heads=model.config.n_head)
    select_fused(model, FORWARD["fused"])
    return model


FORWARD = {"fused": "on", "wkv": "auto"}  # --forward: "fused" (the fused CUDA kernels) or "readable" (per-op forward)


def ffn_zero_share(model: RWKV7, steps: int = 8) -> float:
    """Share of exact zeros in fp16 relu(k)^2, the FFN value matrix's input, over a short prompt and a few
    greedy decode steps of one row (readable forward): the weight rows the sparse-input GEMV skips."""
    counts = [0, 0]

    class Counting:
        def __init__(self, linear):
            self.linear = linear

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            counts[0] += int((torch.relu(y).float().square().half() == 0).sum())
            counts[1] += y.numel()
            return y

    keys = [blk.ffn_key for blk in model.blocks]
    for blk in model.blocks:
        blk.ffn_key = Counting(blk.ffn_key)
    try:
        with torch.inference_mode():
            pool = model.new_state_pool(1)
            logits = model.forward_reference(PackedBatch.from_rows([list(range(100, 116))], [0], model.device), pool)
            for _ in range(steps):
                step = PackedBatch.from_rows([[int(logits[0].argmax())]], [0], model.device)
                logits = model.forward_reference(step, pool)
    finally:
        for blk, key in zip(model.blocks, keys):
            blk.ffn_key = key
    return counts[0] / counts[1]


def bench_size(name: str, batches: list[int], steps: int, states: list[str], engine: str = "fp16") -> list[dict]:
    t0 = time.time()
    model = load_model(name, engine)
    print(f"{name}: built in {time.time() - t0:.1f}s, {model.implementations()}", flush=True)
    zero_share = round(ffn_zero_share(model), 4) if engine == "fp16" else None
    if zero_share is not None:
        print(f"{name}: share of zeros in the FFN value input (relu^2): {zero_share}", flush=True)
    if engine.startswith("gemlite"):  # tune GemLite's kernels for these batch sizes (once per GPU model)
        from infer.quant.engines import warm_up_gemlite
        t0 = time.time()
        warm_up_gemlite(model, batches, data_dir())
        print(f"{name}: GemLite warm-up {time.time() - t0:.1f}s", flush=True)
    rows = []
    for B, state in [(b, s) for s in states for b in batches]:
        torch.cuda.reset_peak_memory_stats()
        pool = model.new_state_pool(B, torch.float16 if state == "fp16" else torch.float32)
        batch = static_batch(torch.randint(1, 65530, (B,)).tolist(), list(range(B)))
        eager = time_steps(lambda: model.forward(batch, pool), steps)
        graph, _ = capture(model, batch, pool)
        replay = time_steps(graph.replay, steps)
        row = {"size": name, "engine": engine, "forward": "fused" if model.fused else "readable",
               "gemv_rows": model.fused.rows_for(model) if model.fused else None,
               "ffn_value": model.blocks[0].ffn_value.kind, "ffn_zero_share": zero_share,
               "batch": B, "state": state, "eager_ms": round(eager * 1000, 3),
               "graph_ms": round(replay * 1000, 3), "eager_tok_s": round(B / eager, 1),
               "graph_tok_s": round(B / replay, 1), "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}
        limit = limits.decode_tok_s(name, B, state, engine)
        row["limit_tok_s"] = round(limit)
        row["graph_pct_of_limit"] = limits.percent(row["graph_tok_s"], limit)
        rows.append(row)
        print(row, flush=True)
        del graph, pool
        torch.cuda.empty_cache()
    if name == "1.5b" and engine == "fp16":  # the portable torch WKV at one batch size, for the record
        model.wkv, model.fused = TorchWKV(), None
        pool = model.new_state_pool(64)
        batch = static_batch(torch.randint(1, 65530, (64,)).tolist(), list(range(64)))
        t = time_steps(lambda: model.forward(batch, pool), max(3, steps // 4))
        rows.append({"size": name, "batch": 64, "state": "fp32", "wkv": "torch", "eager_ms": round(t * 1000, 3),
                     "eager_tok_s": round(64 / t, 1)})
    return rows


def bench_prefill(name: str, lengths: list[int], rows_list: list[int], engine: str = "fp16") -> list[dict]:
    """Prefill throughput (tokens/s) and time to the first logits: one forward over ``rows`` prompts
    of ``length`` tokens each, packed; eager (prefill chunks are not graphed)."""
    model = load_model(name, engine)
    out = []
    for length in lengths:
        for rows in rows_list:
            pool = model.new_state_pool(rows)
            prompts = [torch.randint(1, 65530, (length,)).tolist() for _ in range(rows)]
            batch = PackedBatch.from_rows(prompts, list(range(rows)), "cuda")
            seconds = time_steps(lambda: model.forward(batch, pool), 3)  # (warm-up calls compile fla's kernels)
            row = {"size": name, "engine": engine, "forward": "fused" if model.fused else "readable",
                   "wkv": model.wkv.name, "prompt_tokens": length, "rows": rows,
                   "ms": round(seconds * 1000, 2), "tok_s": round(rows * length / seconds, 1)}
            row["pct_of_limit"] = limits.percent(row["tok_s"], limits.prefill_tok_s(name))
            if rows == 1:  # one prompt: its time to the first logits against the floor
                row["ttft_floor_ms"] = round(limits.ttft_floor_ms(name, length, engine), 2)
            out.append(row)
            print(row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.5b,7.2b")
    ap.add_argument("--batches", default="1,64,256", help="decode batch sizes ('' to skip decode)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--states", default="fp32", help="WKV state storage dtypes to time: fp32,fp16")
    ap.add_argument("--engine", default="fp16", choices=ENGINES,
                    help="linear layers: fp16, cutlass (W8A16) or gemlite:FORMAT (packed GemLite layers)")
    ap.add_argument("--no-checks", action="store_true", help="skip the correctness checks")
    ap.add_argument("--prefill", default="", help="also time prefill at these prompt lengths, e.g. 128,1024,4096")
    ap.add_argument("--prefill-rows", default="1,16", help="prompts per prefill forward")
    ap.add_argument("--forward", default="fused", choices=("fused", "readable"),
                    help="fused CUDA kernels or the readable per-op forward (CUDA WKV kernel in both)")
    ap.add_argument("--wkv", default="auto", choices=("auto", "cuda", "fla"),
                    help="auto/cuda: the CUDA kernel; fla: plus fla-core's chunked kernel for long rows")
    ap.add_argument("--out", default="bench/results/decode_h200.json")
    args = ap.parse_args()
    FORWARD["wkv"] = args.wkv
    FORWARD["fused"] = "on" if args.forward == "fused" else "off"
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "checks": {} if args.no_checks else checks()}
    print(result["checks"], flush=True)
    result["decode"], result["prefill"] = [], []
    for name in args.sizes.split(",") if args.prefill else []:
        result["prefill"] += bench_prefill(name, [int(x) for x in args.prefill.split(",")],
                                           [int(x) for x in args.prefill_rows.split(",")], args.engine)
    for name in args.sizes.split(",") if args.batches else []:
        result["decode"] += bench_size(name, [int(b) for b in args.batches.split(",")], args.steps,
                                       args.states.split(","), args.engine)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'size':>5} {'engine':>21} {'fwd':>8} {'batch':>6} {'state':>5} {'eager tok/s':>12} {'graph tok/s':>12} {'% limit':>8} {'peak GB':>8}")
    for r in result["decode"]:
        print(f"{r['size']:>5} {r.get('engine', 'fp16'):>21} {r.get('forward', '-'):>8} {r['batch']:>6} {r['state']:>5} {r['eager_tok_s']:>12} {r.get('graph_tok_s', '-'):>12} "
              f"{r.get('graph_pct_of_limit', '-'):>8} {r.get('peak_mem_gb', '-'):>8}  {r.get('wkv', 'cuda')}")
    for r in result["prefill"]:
        print(f"prefill {r['size']:>5} {r['engine']:>21} {r['forward']:>8} {r['rows']:>3} x {r['prompt_tokens']:>6}: "
              f"{r['ms']:>9} ms {r['tok_s']:>10} tok/s {r['pct_of_limit']:>5} % of the limit  ({r['wkv']})")


if __name__ == "__main__":
    main()
