"""Prefill WKV on one GPU: the per-token CUDA kernel (CudaWKV) vs fla-core's chunked kernel (FlaWKV).

For H=64 (C=4096, the 7.2B model) and H=32 (C=2048, 1.5B) at rows x length = 1x1024, 1x4096,
16x1024, 4x4096 (fp16 activations, fp32 decay, fp32 state pool with nonzero states), times one
WKV call of one layer with CUDA events (median of --iters after --warmup calls) and reports:

- the first call of each implementation at each shape separately (fla: Triton compile for a new
  head count + fla's autotuning on its first shape; CudaWKV: its JIT build is timed at load);
- max |diff| of y and of the final states of FlaWKV against CudaWKV (also relative to max |ref|);
- for fla's default variant, the kernel alone (inputs prepared) to show the adapter's cost;
- "x layers": the per-call time times the model's layer count (32 for H=64, 24 for H=32).

TorchWKV (a Python step loop) is not timed: far too slow at these lengths.

Triton's compile cache goes to a fresh temporary folder unless TRITON_CACHE_DIR is set, so the
first-call numbers are cold compiles; fla's on-disk autotune cache is off (FLA_CACHE_RESULTS=0)
unless set, so configs are tuned here on this bench's first shape, not reused from test shapes.

    PYTHONPATH=/tmp/site python bench/bench_wkv_prefill.py
    PYTHONPATH=/tmp/site python bench/bench_wkv_prefill.py --triton-f32 ieee --out bench/results/wkv_prefill_h200_ieee.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADS = {64: 32, 32: 24}            # head count -> layers of the model with that width (7.2B, 1.5B)
SHAPES = [(1, 1024), (1, 4096), (16, 1024), (4, 4096)]
N = 64


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="64,32")
    ap.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES), help="rows x length, e.g. 1x1024,4x4096")
    ap.add_argument("--variants", default="c64-fp16,c16-fp16,c64-fp32",
                    help="FlaWKV variants: c<chunk>-<compute dtype: fp16|bf16|fp32|act>")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--triton-f32", default="", choices=("", "tf32", "ieee"),
                    help="TRITON_F32_DEFAULT for fp32 dots (default: Triton's, TF32 on NVIDIA)")
    ap.add_argument("--out", default="bench/results/wkv_prefill_h200.json")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of this script: tiny shapes, fla under Triton's interpreter, TorchWKV as the "
                         "reference, perf_counter timing; writes nothing unless --out is given")
    args = ap.parse_args()
    if args.smoke:
        args.heads, args.shapes, args.iters, args.warmup = "2", "1x70,2x33", 1, 0
        if args.out == ap.get_default("out"):
            args.out = ""
    return args


def main() -> None:
    args = parse_args()
    # Before Triton or fla is imported: see the module docstring.
    if args.triton_f32:
        os.environ["TRITON_F32_DEFAULT"] = args.triton_f32
    os.environ.setdefault("FLA_CACHE_RESULTS", "0")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, str(ROOT / "test"))
        from fla_interpret import enable_interpreter
        enable_interpreter()
    if "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")

    import torch
    import torch.nn.functional as F

    from infer.batch import PackedBatch
    from infer.ops.wkv import TorchWKV
    from infer.ops.wkv_cuda import cuda_wkv_error, load_cuda_wkv
    from infer.ops.wkv_fla import FlaWKV, cu_seqlens_of, log_decay

    if args.smoke:
        dev = torch.device("cpu")
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
    else:
        sys.exit("needs a CUDA device (or --smoke)")

    def synchronize():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def sync_time(fn):
        synchronize()
        t0 = time.perf_counter()
        out = fn()
        synchronize()
        return out, (time.perf_counter() - t0) * 1e3

    def event_time(fn) -> float:
        """median ms of one call."""
        for _ in range(args.warmup):
            fn()
        times = []
        for _ in range(args.iters):
            if dev.type != "cuda":
                times.append(sync_time(fn)[1])
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def make_inputs(T: int, H: int, seed: int):
        gen = torch.Generator(device=dev).manual_seed(seed)
        C = H * N
        r, k, v = (torch.randn(T, C, generator=gen, device=dev).half() for _ in range(3))
        w = torch.exp(-0.606531 * torch.rand(T, C, generator=gen, device=dev))        # the model's range
        kk = F.normalize(torch.randn(T, H, N, generator=gen, device=dev), dim=-1).view(T, C)
        gate = torch.rand(T, C, generator=gen, device=dev)
        return [r, w, k, v, (-kk).half(), (kk * gate).half()]

    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "none (--smoke)", "torch": torch.__version__,
            "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT", "(triton default: tf32)"),
            "fla_cache_results": os.environ["FLA_CACHE_RESULTS"], "iters": args.iters, "warmup": args.warmup}
    try:
        import triton
        info["triton"] = triton.__version__
        import fla
        info["fla"] = getattr(fla, "__version__", "?")
    except Exception as exc:  # noqa: BLE001
        info["fla_import_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(info))

    impls: dict[str, object] = {}
    load_s = {}
    ref = "torch" if args.smoke else "cuda"      # what FlaWKV's y and states are compared with
    if args.smoke:
        impls["torch"] = TorchWKV()
    else:
        t0 = time.perf_counter()
        cuda_kernel = load_cuda_wkv()
        load_s["cuda"] = time.perf_counter() - t0
        if cuda_kernel is None:
            print(f"CudaWKV unavailable: {cuda_wkv_error()}")
        else:
            impls["cuda"] = cuda_kernel
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "act": None}
    for variant in [v for v in args.variants.split(",") if v]:
        chunk, dtype = variant.split("-")
        t0 = time.perf_counter()
        try:
            impls["fla-" + variant] = FlaWKV(chunk_size=int(chunk.removeprefix("c")), compute_dtype=dtypes[dtype])
        except Exception as exc:  # noqa: BLE001
            print(f"FlaWKV {variant} unavailable: {type(exc).__name__}: {exc}")
            continue
        load_s["fla-" + variant] = time.perf_counter() - t0       # the import (first variant only)
    info["load_seconds"] = {k: round(v, 2) for k, v in load_s.items()}

    rows = []
    heads = [int(h) for h in args.heads.split(",") if h]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    for H in heads:
        for B, L in shapes:
            T, C = B * L, H * N
            batch = PackedBatch.from_rows([[0] * L for _ in range(B)], list(range(1, B + 1))[::-1], dev)
            inputs = make_inputs(T, H, seed=H * 1000 + B)
            gen = torch.Generator(device=dev).manual_seed(7)
            pool0 = torch.randn(B + 2, H, N, N, generator=gen, device=dev) * 0.3
            results = {}
            for name, impl in impls.items():
                pool = pool0.clone()
                try:
                    y, first_ms = sync_time(lambda: impl(pool, batch, *inputs))
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} H={H} {B}x{L}: {type(exc).__name__}: {str(exc)[-500:]}")
                    continue
                results[name] = (y, pool, first_ms)
                scratch = pool0.clone()
                ms = event_time(lambda: impl(scratch, batch, *inputs))
                row = {"impl": name, "H": H, "C": C, "rows": B, "len": L, "tokens": T,
                       "first_call_ms": round(first_ms, 2), "ms": round(ms, 4),
                       "x_layers_ms": round(ms * HEADS.get(H, 1), 3), "layers": HEADS.get(H, 1),
                       "mtok_per_s": round(T / ms / 1e3, 2)}
                if ref in results and name != ref:
                    y_ref, pool_ref, _ = results[ref]
                    used = batch.slots
                    dy = (y - y_ref).abs().max().item()
                    ds = (pool[used] - pool_ref[used]).abs().max().item()
                    row.update(y_maxdiff=dy, y_rel=dy / y_ref.abs().max().item(), state_maxdiff=ds,
                               state_rel=ds / pool_ref[used].abs().max().item(),
                               finite=bool(torch.isfinite(y).all() and torch.isfinite(pool).all()))
                rows.append(row)
                print(json.dumps(row), flush=True)
            # the fla kernel alone, inputs already in its layout: the adapter's cost is the rest
            fla_name = next((n for n in impls if n.startswith("fla-c64-fp16")), None)
            if fla_name is not None and fla_name in results:
                impl = impls[fla_name]
                q, k, v, a, b = (t.reshape(1, T, H, N) for t in (inputs[0], *inputs[2:]))
                g = log_decay(inputs[1]).reshape(1, T, H, N)
                h0 = pool0[batch.slots].transpose(-1, -2).contiguous()
                cu, host = cu_seqlens_of(batch.lens, dev)
                ms = event_time(lambda: impl._chunk(q, g, k, v, a, b, scale=1.0, initial_state=h0,
                                                    output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=host,
                                                    chunk_size=impl.chunk_size, lower_bound=impl.lower_bound))
                row = {"impl": fla_name + " (kernel only)", "H": H, "C": C, "rows": B, "len": L, "tokens": T,
                       "ms": round(ms, 4), "x_layers_ms": round(ms * HEADS.get(H, 1), 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del results
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    print()
    head = f"{'impl':<26}{'H':>4}{'rows x len':>12}{'first ms':>10}{'ms/layer':>10}{'x layers':>10}" \
           f"{'Mtok/s':>8}{'y rel':>10}{'state rel':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['impl']:<26}{r['H']:>4}{str(r['rows']) + 'x' + str(r['len']):>12}"
              f"{r.get('first_call_ms', float('nan')):>10.1f}{r['ms']:>10.3f}{r['x_layers_ms']:>10.2f}"
              f"{r.get('mtok_per_s', float('nan')):>8.1f}{r.get('y_rel', float('nan')):>10.2e}"
              f"{r.get('state_rel', float('nan')):>11.2e}")
    info["reference"] = ref
    if args.out:
        out = ROOT / args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**info, "results": rows}, indent=1) + "\n")
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
