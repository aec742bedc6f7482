"""Rounding of the fused GEMV's int8 tasks against the exact product, per way of summing (a child process
each: the launcher reads RWKV_GEMV_INT8_TC once): the per-thread fp32 code (0), tensor-core bands whose
partial sums leave the tensor cores per vector (1, the default), and bands summed in the mma accumulators
throughout (2). int8 times fp16 is exact, so every output should be the exact product rounded once to fp16;
this prints how far each way lands from it, in fp16 steps, on a 7.2B layer's shapes.

    python bench/experiment_gemv_int8_error.py --out bench/results/experiment_gemv_int8_error_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
MODES = {"0": "per-thread fp32", "1": "bands, sums promoted per vector", "2": "bands, mma accumulators only"}
SHAPES = [(4096, 4096), (16384, 4096), (4096, 16384), (65536, 4096)]  # r/k/v/o, FFN key, FFN value, head


def measure(rows_list: list[int]) -> list[dict]:
    import torch

    sys.path.insert(0, str(ROOT))
    from infer.ops.fused import EPI_NONE, load_fused_kernels

    kernels = load_fused_kernels()
    assert kernels is not None, "the fused kernels did not build"
    out = []
    for n, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        q = torch.randint(-128, 128, (n, k), generator=gen, device="cuda", dtype=torch.int8)
        scale = ((torch.rand(n, generator=gen, device="cuda") + 0.5) / (127 * k ** 0.5)).half()
        linear = SimpleNamespace(int8_rows=(q, scale), in_features=k, out_features=n)  # as GemLite int8 layers
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen, device="cuda").half()
            y = torch.empty(rows, n, device="cuda", dtype=torch.float16)
            kernels.gemv([(linear, x, y, EPI_NONE, None)])
            exact = (x.double() @ q.double().T) * scale.double()
            step = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs())[1] - 11).clamp_min(2.0 ** -24)
            err = (y.double() - exact) / step
            out.append(dict(n=n, k=k, rows=rows, max_steps=round(err.abs().max().item(), 3),
                            mean_signed_steps=round(err.mean().item(), 4),
                            share_rounded_exact=round((y == exact.half()).float().mean().item(), 5),
                            share_over_one_step=round((err.abs() > 1.0).float().mean().item(), 6),
                            shrink_share=round(((y.double().abs() < exact.abs()) &
                                                (y != exact.half())).float().mean().item(), 4)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        print(json.dumps(measure(rows)))
        return
    results = {}
    for mode, name in MODES.items():
        env = dict(os.environ, RWKV_GEMV_INT8_TC=mode)
        proc = subprocess.run([sys.executable, __file__, "--child", "--rows", args.rows], env=env,
                              capture_output=True, text=True, check=True)
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{'way of summing':34} {'n x k':>13} {'rows':>4} {'max steps':>9} {'mean':>8} {'exact':>8} "
          f"{'>1 step':>8} {'shrunk':>7}")
    for name, rows_out in results.items():
        for r in rows_out:
            print(f"{name:34} {r['n']:>6} x {r['k']:<5} {r['rows']:>4} {r['max_steps']:>9} "
                  f"{r['mean_signed_steps']:>8} {r['share_rounded_exact']:>8} {r['share_over_one_step']:>8} "
                  f"{r['shrink_share']:>7}")
    if args.out:
        import torch
        Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), results=results), indent=1))


if __name__ == "__main__":
    main()
