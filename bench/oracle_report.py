"""Measure how far the runtime is from the official implementation (CPU), for the record.

For random models of several shapes: max |diff| of logits (every prompt position, 16 decode
steps) and of the final state vs `rwkv==0.8.32` in fp32; greedy agreement over 32 tokens; and the
fp16 drift of ours and of the official package against the fp32 oracle.

    python bench/oracle_report.py [--out bench/results/oracle_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.update(RWKV_V7_ON="1", RWKV_CUDA_ON="0")

from infer.model import RWKV7  # noqa: E402
from infer.random_model import make_config, random_state_dict, save_checkpoint  # noqa: E402

SHAPES = [(2, 128, 1024), (4, 192, 65536), (4, 256, 65536), (12, 768, 65536)]


def measure(path: Path) -> dict:
    from rwkv.model import RWKV
    ref32 = RWKV(model=str(path)[:-4], strategy="cpu fp32")
    ref16 = RWKV(model=str(path)[:-4], strategy="cpu fp16")
    ours32 = RWKV7.load(str(path), device="cpu", progress=False)
    ours16 = RWKV7.load(str(path), device="cpu", dtype="fp16", progress=False)
    V = ours32.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, V, (64,), generator=g).tolist()
    decode = torch.randint(1, V, (16,), generator=g).tolist()

    want, state = ref32.forward(prompt, None, full_output=True)
    pool = ours32.new_state_pool(1)
    got = ours32.prefill([prompt], [0], pool, all_logits=True)
    prefill_diff = (got - want).abs().max().item()
    decode_diff = 0.0
    for t in decode:
        w, state = ref32.forward([t], state)
        decode_diff = max(decode_diff, (ours32.decode([t], [0], pool)[0] - w).abs().max().item())
    ours_state = pool.export_slot(0).to_official()
    state_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours_state, state))

    logits, state = ref32.forward(prompt, None)
    pool = ours32.new_state_pool(1)
    mine = ours32.prefill([prompt], [0], pool)[0]
    same = 0
    for _ in range(32):
        a, b = int(logits.argmax()), int(mine.argmax())
        if a != b:
            break
        same += 1
        logits, state = ref32.forward([a], state)
        mine = ours32.decode([b], [0], pool)[0]

    official16, _ = ref16.forward(prompt, None, full_output=True)
    mine16 = ours16.prefill([prompt], [0], ours16.new_state_pool(1), all_logits=True)
    return {
        "model": ours32.config.describe(), "logits_absmax": round(want.abs().max().item(), 2),
        "prefill_logits_max_diff": prefill_diff, "decode_logits_max_diff": decode_diff,
        "state_max_diff": state_diff, "greedy_tokens_identical": same,
        "fp16_drift_ours": (mine16 - want).abs().max().item(),
        "fp16_drift_official": (official16.float() - want).abs().max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/oracle_cpu.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for L, C, V in SHAPES:
            path = Path(tmp) / f"L{L}-C{C}-V{V}.pth"
            save_checkpoint(random_state_dict(make_config(L, C, V), seed=L * 1000 + C, dtype=torch.float32), path)
            rows.append(measure(path))
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "oracle": "rwkv 0.8.32, CPU fp32", "prompt_tokens": 64, "decode_steps": 16, "results": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'model':<48} {'prefill':>9} {'decode':>9} {'state':>9} {'greedy':>6} {'fp16 ours':>10} {'fp16 off.':>10}")
    for r in rows:
        print(f"{r['model']:<48} {r['prefill_logits_max_diff']:>9.2e} {r['decode_logits_max_diff']:>9.2e} "
              f"{r['state_max_diff']:>9.2e} {r['greedy_tokens_identical']:>6} {r['fp16_drift_ours']:>10.3f} "
              f"{r['fp16_drift_official']:>10.3f}")


if __name__ == "__main__":
    main()
