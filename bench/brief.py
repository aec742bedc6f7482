"""One short line per record of bench result files (bench_decode.py, bench_w8_gemm.py), for a device call's log,
whose tail is all that may come back: decode graph tok/s, prompt ms, GEMM microseconds per kernel.

    python bench/brief.py bench/results/decode_h200_w4_split_min2048.json bench/results/w4_gemm_split_7.2b_h200.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def brief(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    lines = []
    for r in data.get("decode", []):
        lines.append(f"decode {r['size']} {r.get('engine', 'fp16')} b{r['batch']} {r.get('state', '')}: "
                     f"{r.get('graph_tok_s', r.get('eager_tok_s'))} tok/s")
    for r in data.get("prefill", []):
        lines.append(f"prefill {r['size']} {r.get('engine', 'fp16')} {r['rows']}x{r['prompt_tokens']}: {r['ms']} ms")
    for r in data.get("results", []):
        times = " ".join(f"{key[:-3]} {value:.1f}" for key, value in r.items() if key.endswith("_us"))
        lines.append(f"gemm {r.get('size', '7.2b')} {r['shape']} rows {r['rows']} (us): {times}")
    return lines


def main() -> None:
    for name in sys.argv[1:]:
        path = Path(name)
        if not path.is_file():
            print(f"{name}: missing")
            continue
        print(f"# {path.name}")
        for line in brief(path):
            print(line)


if __name__ == "__main__":
    main()
