"""Where the persistent batch-1 step's time goes (cuda/rwkv7_step.cu, RWKV_PERSISTENT): each block stamps its start
and end of every phase with the GPU's global timer (PersistentStep.timeline); per phase name, averaged over layers
and steps: the span (first block's start to last block's end), the mean block's busy time, the gap to the next
phase's first start (the grid barrier), the weight bytes read and their rate. Beside it, in the same process: the
step's time untimed and the fused launches' (CUDA graph), so the timeline's own cost shows.

    RWKV_PERSISTENT=1 python bench/profile_persistent.py --sizes 1.5b,7.2b --out bench/results/profile_persistent.json

Variants in one process: merged phases or a grid barrier before each (--merge 1,0), the FFN value K-major (sparse) or
row-major (--ffn kmajor,rowmajor; row-major copies the matrices).
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
os.environ.setdefault("RWKV_PERSISTENT", "1")

from bench.bench_decode import FORWARD, SIZES, capture, load_model, static_batch, time_steps  # noqa: E402
from infer.batch import PackedBatch  # noqa: E402
from infer.ops.linear import DenseLinear  # noqa: E402
from infer.ops.persistent import PersistentStep, phase_names  # noqa: E402


def weight_bytes(model, name: str, zero_share: float) -> int:
    """fp16 weight bytes a phase of ``name`` reads (the sparse FFN value: its nonzero inputs' rows)."""
    cfg, blk = model.config, model.blocks[-1]
    size = {m: getattr(blk, m).weight.numel() * 2 for m in ("receptance", "key", "value", "output", "ffn_key",
                                                            "ffn_value")}
    lora = sum(getattr(blk, m).weight.numel() * 2 for m in ("w1", "a1", "v1", "g1", "w2", "a2", "v2", "g2")
               if getattr(blk, m) is not None)
    sparse = 1.0 - zero_share if hasattr(blk.ffn_value, "weight_t") else 1.0
    return {"rkv+lora": size["receptance"] + size["key"] + size["value"] + lora,
            "rkv": size["receptance"] + size["key"] + size["value"] + lora // 2, "lora": lora // 2,
            "output": size["output"], "ffn key": size["ffn_key"],
            "ffn value": int(size["ffn_value"] * sparse),
            "ffn key+value": size["ffn_key"] + int(size["ffn_value"] * sparse),
            "head": cfg.vocab_size * cfg.n_embd * 2}.get(name, 0)


def summarize(model, timelines: list[torch.Tensor], names: list[str], zero_share: float) -> list[dict]:
    """Per phase name: mean span, busy, gap (us) over layers and steps, and the span's weight rate (TB/s)."""
    spans, busy, gaps = {}, {}, {}
    for t in timelines:
        t = t[:, :, :int((t[0, 0] >= 0).sum())].double()
        start, end = t[:, 0], t[:, 1]
        first, last = start.amin(dim=1), end.amax(dim=1)
        for p, name in enumerate(names):
            spans.setdefault(name, []).append(float(last[p] - first[p]) / 1e3)
            busy.setdefault(name, []).append(float((end[p] - start[p]).mean()) / 1e3)
            if p + 1 < len(names):
                gaps.setdefault(name, []).append(float(first[p + 1] - last[p]) / 1e3)
    steps = len(timelines)
    rows = []
    for name in dict.fromkeys(names):
        span = sum(spans[name]) / len(spans[name])
        nbytes = weight_bytes(model, name, zero_share)
        rows.append({"phase": name, "count_per_step": len(spans[name]) // steps, "span_us": round(span, 2),
                     "busy_us": round(sum(busy[name]) / len(busy[name]), 2),
                     "gap_us": round(sum(gaps.get(name, [0.0])) / max(len(gaps.get(name, [])), 1), 2),
                     "weight_mb": round(nbytes / 1e6, 2),
                     "tb_s": round(nbytes / (span * 1e-6) / 1e12, 2) if nbytes else None,
                     "total_us_per_step": round(sum(spans[name]) / steps + sum(gaps.get(name, [])) / steps, 1)})
    return rows


def profile(name: str, merges: list[bool], ffns: list[str], steps: int) -> list[dict]:
    model = load_model(name, "fp16")
    step: PersistentStep = model.fused.persistent
    if step is None:
        raise SystemExit("the persistent step did not load (RWKV_PERSISTENT=1, a CUDA GPU; see the log)")
    model.fused.persistent = None  # the launches' time first
    pool = model.new_state_pool(1)
    batch = static_batch([1234], [0])
    graph, _ = capture(model, batch, pool)
    launches_ms = time_steps(graph.replay, steps) * 1e3
    del graph
    results = []
    blocks = torch.cuda.get_device_properties(0).multi_processor_count * step.blocks_per_sm
    for ffn in ffns:
        if ffn == "rowmajor":
            for blk in model.blocks:
                blk.ffn_value = DenseLinear(blk.ffn_value.weight)
            torch.cuda.empty_cache()
        for merge in merges:
            step.merge = merge
            pool = model.new_state_pool(1)  # a new pool: a plan built with this merge
            one = PackedBatch.from_rows([[1234]], [0], model.device)
            untimed_ms = time_steps(lambda: step.logits(model, one, pool), steps) * 1e3
            plan = step._plan(model, pool)
            hidden = plan[2].hidden
            zero_share = float((hidden == 0).float().mean())
            timelines = [step.timeline(model, one, pool, blocks) for _ in range(steps)]
            torch.cuda.synchronize()
            names = phase_names(plan[1])
            timed = [float(t[-1, 1].max() - t[0, 0][t[0, 0] >= 0].min()) / 1e6 for t in timelines]
            row = {"size": name, "ffn_value": ffn, "merge": merge, "blocks_per_sm": step.blocks_per_sm,
                   "launches_graph_ms": round(launches_ms, 3), "persistent_ms": round(untimed_ms, 3),
                   "persistent_timed_ms": round(sorted(timed)[len(timed) // 2], 3),
                   "ffn_zero_share_last_layer": round(zero_share, 3),
                   "phases": summarize(model, timelines, names, zero_share)}
            results.append(row)
            print(f"\n{name} ffn {ffn} merge {int(merge)}: launches {launches_ms:.3f} ms, persistent "
                  f"{untimed_ms:.3f} ms (timed {row['persistent_timed_ms']:.3f}), zeros {zero_share:.2f}")
            print(f"{'phase':>14} {'n':>3} {'span us':>8} {'busy us':>8} {'gap us':>7} {'MB':>7} {'TB/s':>5} "
                  f"{'us/step':>8}")
            for p in row["phases"]:
                print(f"{p['phase']:>14} {p['count_per_step']:>3} {p['span_us']:>8} {p['busy_us']:>8} "
                      f"{p['gap_us']:>7} {p['weight_mb']:>7} {p['tb_s'] or '-':>5} {p['total_us_per_step']:>8}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1.5b,7.2b", help=f"of {','.join(SIZES)}")
    ap.add_argument("--merge", default="1,0", help="merged phases (1) and/or a grid barrier before each (0)")
    ap.add_argument("--ffn", default="kmajor", help="FFN value layouts: kmajor (sparse), rowmajor")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/profile_persistent.json")
    args = ap.parse_args()
    FORWARD["wkv"] = "cuda"
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    for name in args.sizes.split(","):
        result["runs"] += profile(name, [m == "1" for m in args.merge.split(",")], args.ffn.split(","), args.steps)
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
