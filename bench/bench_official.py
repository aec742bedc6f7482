"""Peer column: single-stream decode speed of BlinkDL's official ``rwkv`` package (0.8.32).

Random weights of the real shapes (``infer/random_model.py``, drawn on the device, saved as an fp16
``.pth`` that the official loader reads; the file is kept and reused, e.g. by ``bench/h200_serving.sh``).
The official RWKV-7 class (``RWKV_V7_ON=1``, TorchScript ``RWKV_JIT_ON=1``) decodes one token per
``model.forward([token], state)``. ``RWKV_CUDA_ON=1`` makes ``import rwkv.model`` compile the package's
CUDA kernels with ninja; if that import fails, the error is recorded and the run is repeated with
``RWKV_CUDA_ON=0`` in a fresh process (each mode runs in its own subprocess, since the package reads
the variables at import time). Single-token decode uses the same torch code in both modes (the
package's WKV kernel serves only multi-token forwards), so both give comparable decode numbers.

Two timings per size after a warm-up: ``tok_s`` feeds pre-drawn tokens with one synchronize at the
end (the model forward alone, as in ``bench_decode.py``); ``greedy_tok_s`` picks each next token by
argmax of the logits, a host sync per token (a real decode loop).

    python bench/bench_official.py                                  # 1.5b,7.2b on CUDA, fp16
    python bench/bench_official.py --sizes tiny --device cpu        # plumbing check on the CPU
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# name: (n_layer, n_embd, vocab)
SIZES = {"tiny": (2, 128, 1024), "0.1b": (12, 768, 65536), "1.5b": (24, 2048, 65536), "7.2b": (32, 4096, 65536)}
DTYPES = ("fp16", "bf16", "fp32")


class Interrupted(Exception):
    """SIGTERM (e.g. from ``timeout``): stop, but write what was measured so far."""


def on_sigterm(signum, frame):
    raise Interrupted()


def checkpoint_path(ckpt_dir: str, size: str, dtype: str) -> Path:
    return Path(ckpt_dir) / f"rwkv7-{size}-random-{dtype}.pth"


def ensure_checkpoint(size: str, path: Path, dtype: str, device: str) -> float:
    """Write the random checkpoint unless it exists; seconds spent (0 when reused)."""
    if path.exists():
        print(f"{size}: reusing {path}", flush=True)
        return 0.0
    import torch
    from infer.random_model import make_config, random_state_dict, save_checkpoint
    L, C, V = SIZES[size]
    t0 = time.perf_counter()
    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    sd = random_state_dict(make_config(L, C, V), seed=0, dtype=tdtype, device=device)
    sd = {k: sd[k].cpu() for k in list(sd)}
    save_checkpoint(sd, path)
    del sd
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    print(f"{size}: wrote {path} ({path.stat().st_size / 1e9:.1f} GB) in {seconds:.1f}s", flush=True)
    return seconds


def time_size(rwkv_cls, size: str, args) -> dict:
    import torch
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    L, C, V = SIZES[size]
    path = checkpoint_path(args.ckpt_dir, size, args.dtype)
    row = {"size": size, "n_layer": L, "n_embd": C, "vocab": V, "mode": f"RWKV_CUDA_ON={os.environ['RWKV_CUDA_ON']}"}
    row["checkpoint_s"] = round(ensure_checkpoint(size, path, args.dtype, args.device), 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = rwkv_cls(model=str(path.with_suffix("")), strategy=f"{args.device} {args.dtype}")  # loader adds .pth
    sync()
    row["load_s"] = round(time.perf_counter() - t0, 1)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, V, (args.warmup + args.tokens,), generator=gen).tolist()
    state = None
    with torch.no_grad():
        for t in tokens[:args.warmup]:  # TorchScript profiles and optimizes on the first calls
            out, state = model.forward([t], state)
        sync()
        row["logits_finite"] = bool(torch.isfinite(out.float()).all())
        t0 = time.perf_counter()
        for t in tokens[args.warmup:]:
            out, state = model.forward([t], state)
        sync()
        fed = time.perf_counter() - t0
        token = int(out.float().argmax())
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            out, state = model.forward([token], state)
            token = int(out.float().argmax())  # host sync every token
        greedy = time.perf_counter() - t0
    row.update({"tokens": args.tokens, "ms_per_token": round(1000 * fed / args.tokens, 3),
                "tok_s": round(args.tokens / fed, 1), "greedy_ms_per_token": round(1000 * greedy / args.tokens, 3),
                "greedy_tok_s": round(args.tokens / greedy, 1)})
    if cuda:
        row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        from bench import limits  # (the worker has put the repository on sys.path)
        if size in limits.SHAPES:  # against the H200's batch-1 limit of the shape, as our rows are
            row["pct_of_limit"] = limits.percent(row["tok_s"], limits.decode_tok_s(size, 1))
    del model, state, out
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if not args.keep_checkpoints and size != "7.2b":
        path.unlink(missing_ok=True)
    return row


def worker(args) -> None:
    """One process, one RWKV_CUDA_ON mode (already in the environment): import, then time each size."""
    result: dict = {"mode": f"RWKV_CUDA_ON={os.environ['RWKV_CUDA_ON']}", "rows": [], "errors": {}}
    out = Path(args.worker_out)

    def flush() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    sys.path.insert(0, str(REPO))
    import torch
    t0 = time.perf_counter()
    try:
        import rwkv
        import rwkv.model
        from rwkv.model import RWKV
    except BaseException:  # a failed ninja/nvcc build raises from the import (RuntimeError, OSError, SystemExit)
        result["import_error"] = traceback.format_exc()[-4000:]
        flush()
        sys.exit(3)
    result["import_s"] = round(time.perf_counter() - t0, 1)
    result["rwkv_file"] = rwkv.__file__
    result["env"] = {k: os.environ.get(k) for k in ("RWKV_V7_ON", "RWKV_JIT_ON", "RWKV_CUDA_ON")}
    print(f"imported rwkv ({result['mode']}) in {result['import_s']}s; env after import {result['env']}", flush=True)
    flush()
    for size in args.sizes.split(","):
        try:
            row = time_size(RWKV, size, args)
            result["rows"].append(row)
            print(row, flush=True)
        except Exception:
            result["errors"][size] = traceback.format_exc()[-4000:]
            print(f"{size} failed:\n{result['errors'][size]}", flush=True)
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.5b,7.2b", help=f"comma-separated: {', '.join(SIZES)}")
    ap.add_argument("--device", default="cuda", help="cuda or cpu (the official strategy's device)")
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default fp16 on CUDA, fp32 on the CPU")
    ap.add_argument("--tokens", type=int, default=128, help="timed decode steps (at least 64)")
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--modes", default="1,0", help="RWKV_CUDA_ON values to try, in order, until one imports")
    ap.add_argument("--ckpt-dir", default="/tmp", help="where the random .pth files are written and reused")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep every size's .pth (the 7.2b one is always kept, for h200_serving.sh)")
    ap.add_argument("--worker-timeout", type=float, default=1200, help="seconds for one mode's subprocess")
    ap.add_argument("--out", default=None,
                    help="result JSON (default bench/results/official_h200.json on CUDA, official_cpu.json on CPU); "
                         "also copied into $OUT when that is set")
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "fp16")
    for size in args.sizes.split(","):
        if size not in SIZES:
            ap.error(f"unknown size {size!r}: one of {', '.join(SIZES)}")
    if args.worker_out:
        return worker(args)
    if args.tokens < 64:
        ap.error("--tokens must be at least 64")

    import torch  # the parent only reads versions and the device name
    cuda = args.device.startswith("cuda")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
              "device": args.device, "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "rwkv": package_version("rwkv"), "dtype": args.dtype,
              "strategy": f"{args.device} {args.dtype}", "tokens": args.tokens, "warmup": args.warmup,
              "batch": 1, "attempts": [], "results": []}
    remaining = args.sizes.split(",")
    signal.signal(signal.SIGTERM, on_sigterm)
    for mode in args.modes.split(","):
        if not remaining or any(a["returncode"] == "interrupted" for a in result["attempts"]):
            break
        attempt = run_mode(mode, remaining, args)
        result["attempts"].append(attempt["summary"])
        result["results"] += attempt["rows"]
        done = {r["size"] for r in attempt["rows"]} | set(attempt["errors"])  # a size that failed on its own
        remaining = [s for s in remaining if s not in done]                     # fails in every mode: no retry
        result.setdefault("errors", {}).update(attempt["errors"])
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the result file be written
    modes = sorted({r["mode"] for r in result["results"]})
    result["mode"] = modes[0] if len(modes) == 1 else modes
    if remaining:
        result["not_run"] = remaining
    out = Path(args.out or REPO / "bench" / "results" / f"official_{'h200' if cuda else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if os.environ.get("OUT") and Path(os.environ["OUT"]).is_dir():
        copy = Path(os.environ["OUT"]) / out.name
        if not copy.exists() or not copy.samefile(out):  # --out may already point into $OUT
            shutil.copy(out, copy)
    print(f"\nofficial rwkv {result['rwkv']} on {result['gpu']}, {result['strategy']}, torch {result['torch']}, "
          f"batch 1, {args.tokens} tokens")
    for a in result["attempts"]:
        print(f"  {a['mode']}: {'ran' if a['ok'] else 'FAILED: ' + a.get('error', '')[-300:].strip()}")
    print(f"{'size':>5} {'mode':>14} {'tok/s':>8} {'ms/token':>9} {'greedy tok/s':>13} {'greedy ms':>10} {'load s':>7}")
    for r in result["results"]:
        print(f"{r['size']:>5} {r['mode']:>14} {r['tok_s']:>8} {r['ms_per_token']:>9} {r['greedy_tok_s']:>13} "
              f"{r['greedy_ms_per_token']:>10} {r['load_s']:>7}")
    for size, err in result.get("errors", {}).items():
        print(f"{size}: FAILED: {err.strip().splitlines()[-1]}")
    print(f"wrote {out}")
    if not result["results"]:
        sys.exit(1)


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run_mode(mode: str, sizes: list[str], args) -> dict:
    """Run the worker for one RWKV_CUDA_ON value in a fresh interpreter; its rows and what went wrong."""
    import tempfile
    env = {**os.environ, "RWKV_V7_ON": "1", "RWKV_JIT_ON": "1", "RWKV_CUDA_ON": mode, "PYTHONUNBUFFERED": "1"}
    if mode == "1" and args.device.startswith("cuda"):
        import torch
        major, minor = torch.cuda.get_device_capability()
        env.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")  # build for this GPU only
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        worker_out = Path(f.name)
    cmd = [sys.executable, __file__, "--worker-out", str(worker_out), "--sizes", ",".join(sizes),
           "--device", args.device, "--dtype", args.dtype, "--tokens", str(args.tokens), "--warmup", str(args.warmup),
           "--ckpt-dir", args.ckpt_dir] + (["--keep-checkpoints"] if args.keep_checkpoints else [])
    print(f"=== RWKV_CUDA_ON={mode}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    try:
        rc = proc.wait(timeout=args.worker_timeout)
    except (subprocess.TimeoutExpired, Interrupted, KeyboardInterrupt) as e:
        rc = "timeout" if isinstance(e, subprocess.TimeoutExpired) else "interrupted"
        proc.kill()
        proc.wait()
    try:
        data = json.loads(worker_out.read_text())
    except (OSError, ValueError):
        data = {}
    worker_out.unlink(missing_ok=True)
    summary = {"mode": f"RWKV_CUDA_ON={mode}", "returncode": rc, "seconds": round(time.perf_counter() - t0, 1),
               "ok": bool(data.get("rows")), "import_s": data.get("import_s"), "env": data.get("env")}
    if data.get("import_error"):
        summary["error"] = data["import_error"]
    elif rc != 0:
        rows = len(data.get("rows", []))
        summary["error"] = f"worker exited with {rc} " + (f"after {rows} size(s)" if rows else "before timing anything")
    return {"summary": summary, "rows": data.get("rows", []), "errors": data.get("errors", {})}


if __name__ == "__main__":
    main()
