"""Time of one ``Sampler.sample`` call on a GPU: the torch path (full sort for top-p) vs the CUDA kernel
path (cuda/sampler.cu: threshold and draw without sorting), at several batch sizes.

Every row of a batch samples with the same settings (default: top_p=0.9, temperature 1, no
top-k, no penalties) from random logits of the random-weight model's spread (std 3; --logit-std
to change), ids 65530.. masked as the engine does. Each configuration is timed with CUDA events
over --iters calls after --warmup calls, on the same logits for both paths; the tokens of the two
paths are compared as a check (they agree except in the rare inexact-fp64 cases described in
cuda/sampler.cu). Prints a table and writes JSON (bench/results/sampler_h200.json on an H200).

    python bench/bench_sampler.py                       # B in 1,32,256,512 x V=65536, top_p=0.9
    python bench/bench_sampler.py --configs p0.9,k40p0.9,k50,t1 --batches 1,256
    python bench/bench_sampler.py --fp16-logits --profile --batches 1,32,256   # as the model hands them over;
                                                      # + the kernel path's device time per call, by kernel
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infer.sampler import Sampler, SamplingParams  # noqa: E402

# name -> (temperature, top_k, top_p)
CONFIGS = {"p0.9": (1.0, 0, 0.9), "p0.95": (1.0, 0, 0.95), "k40p0.9": (1.0, 40, 0.9), "k50": (1.0, 50, 1.0),
           "k2000p0.9": (1.0, 2000, 0.9), "t1": (1.0, 0, 1.0)}


def time_sample(sampler: Sampler, logits: torch.Tensor, slots: torch.Tensor, warmup: int, iters: int) -> float:
    """Mean milliseconds of one sample() call (CUDA events around the loop)."""
    for _ in range(warmup):
        sampler.sample(logits, slots)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        sampler.sample(logits, slots)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


PROFILE_CALLS = 10


def device_time(sampler: Sampler, logits: torch.Tensor, slots: torch.Tensor, iters: int) -> tuple[float, list]:
    """(device ms per sample() call summed over its kernels and copies, the 8 costliest of them as [name, ms])."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            sampler.sample(logits, slots)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    per_call = [(e.key, getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) / 1000 / iters)
                for e in kernels]
    per_call.sort(key=lambda kv: -kv[1])
    return sum(ms for _, ms in per_call), [[name[:80], round(ms, 4)] for name, ms in per_call[:8]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,256,512")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--configs", default="p0.9", help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--fp16-logits", action="store_true", help="fp16 logits, as the model's head gives them")
    ap.add_argument("--profile", action="store_true",
                    help="also the kernel path's device time per call, by kernel (torch.profiler)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/sampler_<gpu>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    gpu = torch.cuda.get_device_name()
    tag = "h200" if "H200" in gpu else re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    out = Path(args.out or f"bench/results/sampler_{tag}.json")
    V, batches = args.vocab, [int(b) for b in args.batches.split(",")]
    max_b = max(batches)

    samplers = {impl: Sampler(V, max_b, "cuda", impl=impl) for impl in ("torch", "auto")}
    # the kernel path as it was before its preparation kernel: the torch steps before the softmax
    unprepared = samplers["unprepared"] = Sampler(V, max_b, "cuda", impl="auto")
    unprepared._prepare_on = lambda kernel, logits, slots, fp, ip: (*unprepared._prepare(logits, slots, fp)[1:5], None)
    kernel_name = samplers["auto"].name
    if kernel_name == "torch":
        from infer.ops.sampler_cuda import cuda_sampler_error
        sys.exit(f"the CUDA sampler kernel is unavailable: {cuda_sampler_error()}")
    print(f"{gpu}, torch {torch.__version__}, V={V}, kernel path: {kernel_name}", flush=True)

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for cfg in args.configs.split(","):
        temperature, top_k, top_p = CONFIGS[cfg]
        for s in samplers.values():
            for slot in range(max_b):
                s.reset_slot(slot, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=slot))
        for B in batches:
            logits = torch.randn(B, V, generator=gen, device="cuda") * args.logit_std
            if args.fp16_logits:
                logits = logits.half()
            slots = torch.arange(B, device="cuda")
            # same step counters in both samplers before the token check
            toks = {impl: s.sample(logits, slots).tokens for impl, s in samplers.items()}
            same = int((toks["torch"] == toks["auto"]).sum())
            assert torch.equal(toks["auto"], toks["unprepared"]), "the preparation kernel changed a token"
            ms = {impl: time_sample(s, logits, slots, args.warmup, args.iters) for impl, s in samplers.items()}
            row = dict(config=cfg, temperature=temperature, top_k=top_k, top_p=top_p, batch=B, vocab=V,
                       torch_ms=round(ms["torch"], 4), kernel_ms=round(ms["auto"], 4),
                       kernel_torch_prep_ms=round(ms["unprepared"], 4),
                       speedup=round(ms["torch"] / ms["auto"], 2), tokens_equal=f"{same}/{B}",
                       logits_dtype=str(logits.dtype).removeprefix("torch."))
            if args.profile:
                try:
                    total, top = device_time(samplers["auto"], logits, slots, PROFILE_CALLS)
                    row.update(kernel_device_ms=round(total, 4), kernel_top_ops=top)
                except Exception as e:  # the timings above stand without the profile
                    row["profile_error"] = repr(e)
                for _ in range(PROFILE_CALLS):  # the others' step counters too: the next check compares draws
                    samplers["torch"].sample(logits, slots)
                    samplers["unprepared"].sample(logits, slots)
            rows.append(row)
            print(row, flush=True)

    result = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), gpu=gpu, torch=torch.__version__,
                  kernel=kernel_name, logit_std=args.logit_std, iters=args.iters, rows=rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'config':>10} {'batch':>6} {'torch ms':>10} {'kernel ms':>10} {'speedup':>8} {'tokens equal':>13} "
          f"{'device ms':>10} {'unprep ms':>10}  (unprep: the kernel path with the torch steps before the softmax)")
    for r in rows:
        print(f"{r['config']:>10} {r['batch']:>6} {r['torch_ms']:>10.3f} {r['kernel_ms']:>10.3f} {r['speedup']:>7.1f}x "
              f"{r['tokens_equal']:>13} {r.get('kernel_device_ms', float('nan')):>10.3f} "
              f"{r['kernel_torch_prep_ms']:>10.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
