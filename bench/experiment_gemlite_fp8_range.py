"""Whether GemLite's A16W8 layers stay finite as the activations grow: one random 1024 x 1024 matrix packed
the way export_quant_gemlite packs it (A16W8_FP8 and, as the control, A16W8_INT8), multiplied by fp16
activations of growing magnitude at several batch sizes, against the dequantized product in fp32; each format
post-scaled (as packed) and read pre-scaled (as GemLiteLinear reads 8-bit layers), and A16W8_FP8 through
GemLiteLinear itself.

Why: on the H200 the A16W8_FP8 engine gave NaN logits on the trained tiny model (bench/results/
quant_accuracy_trained_h200.json) but not on random ones, whose activations are small. The first run
(experiment_gemlite_fp8_range_first_h200.json, post-scaled layers only) found non-finite outputs in both formats
once |x| reached ~100: GemLite rounds a post-scaled layer's sum over the codes to fp16 before the scale. An
experiment, not a benchmark of the product.

    python bench/experiment_gemlite_fp8_range.py --out bench/results/experiment_gemlite_fp8_range_h200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from infer.quant.gemlite_linear import read_pre_scaled, require_gemlite  # noqa: E402
from infer.quant.quantize import quantize_fp8, quantize_int8  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/experiment_gemlite_fp8_range_h200.json")
    args = ap.parse_args()
    gemlite = require_gemlite("cuda", purpose="this experiment")
    from infer.quant.export_quant_gemlite import packer
    from infer.quant.gemlite_linear import GemLiteLinear
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(1024, 1024, generator=gen, device="cuda") * 0.02
    helper = gemlite.helper
    variants = {}  # name: (layer, dequantized weights)
    for fmt, quantize, cls in (("A16W8_FP8", quantize_fp8, helper.A16W8_FP8),
                               ("A16W8_INT8", quantize_int8, helper.A16W8_INT8)):
        q, scale = quantize(weight)
        dequantized = q.float() * scale.float()[:, None]
        made = lambda: cls(device="cuda:0", dtype=torch.float16, post_scale=True).from_weights(q, scales=scale)  # noqa: E731
        variants[f"{fmt} post-scaled"] = (made(), dequantized)
        prescaled = made()
        assert read_pre_scaled(prescaled)
        variants[f"{fmt} read pre-scaled"] = (prescaled, dequantized)
    packed = packer("A16W8_FP8", 64, False, torch.device("cuda"))("w", weight)
    variants["A16W8_FP8 GemLiteLinear"] = (GemLiteLinear({k.removeprefix("w.gemlite."): v.cuda()
                                                         for k, v in packed.items()}), variants["A16W8_FP8 post-scaled"][1])
    rows = []
    for name, (layer, dequantized) in variants.items():
        for batch in (1, 8, 256):
            for magnitude in (1.0, 100.0, 1000.0):
                x = (torch.randn(batch, 1024, generator=gen, device="cuda") * magnitude / 4).half()
                x[:, 0] = magnitude  # one channel at exactly this size
                y = layer(x).float()
                exact = x.float() @ dequantized.T
                finite = torch.isfinite(y)
                err = ((y - exact).abs()[finite].max() / exact.abs().max()).item() if finite.any() else float("nan")
                row = {"layer": name, "batch": batch, "max_abs_activation": magnitude,
                       "finite_pct": round(100 * finite.float().mean().item(), 2), "max_rel_err": round(err, 5)}
                rows.append(row)
                print(row, flush=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "gemlite": gemlite.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
