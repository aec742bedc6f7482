"""Collect the headline GPU figures from bench/results/*.json into bench/results/summary.json.

Stable keys (e.g. ``decode_bsz1_7.2b_fp16_tok_s``), each with its value, GPU, date and source
file; figures not measured yet are listed under ``missing``.

    python bench/summarize.py
"""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
WANTED = ["decode_bsz1_7.2b_fp16_tok_s", "decode_bsz1_1.5b_fp16_tok_s", "decode_b256_7.2b_fp16_tok_s",
          "decode_b512_7.2b_fp16_tok_s", "decode_bsz1_7.2b_w8_tok_s", "decode_b256_7.2b_w8_tok_s",
          "prefill_batched_7.2b_tok_s", "ttft_1k_7.2b_ms", "serving_256_7.2b_tok_s", "official_rwkv_bsz1_7.2b_tok_s"]
ENGINE_NAMES = {"fp16": "fp16", "cutlass": "w8"}


def decode_figures(path: Path) -> dict[str, dict]:
    data = json.loads(path.read_text())
    out = {}
    for row in data.get("decode", []):
        if row.get("state") != "fp32" or "graph_tok_s" not in row:
            continue
        batch = "bsz1" if row["batch"] == 1 else f"b{row['batch']}"
        key = f"decode_{batch}_{row['size']}_{ENGINE_NAMES[row.get('engine', 'fp16')]}_tok_s"
        out[key] = {"value": row["graph_tok_s"], "gpu": data["gpu"], "date": data["date"], "source": path.name,
                    "note": "model forward replayed as a CUDA graph, fp32 WKV state, no sampling"}
    for row in data.get("prefill", []):
        if row.get("engine", "fp16") != "fp16":
            continue
        base = {"gpu": data["gpu"], "date": data["date"], "source": path.name}
        if row["rows"] == 1 and row["prompt_tokens"] == 1024:
            out[f"ttft_1k_{row['size']}_ms"] = {**base, "value": row["ms"],
                                                 "note": "one forward over a 1,024-token prompt (model only)"}
        if row["rows"] > 1:
            key = f"prefill_batched_{row['size']}_tok_s"
            if row["tok_s"] > out.get(key, {}).get("value", 0):
                out[key] = {**base, "value": row["tok_s"],
                            "note": f"{row['rows']} prompts x {row['prompt_tokens']} tokens in one packed forward"}
    return out


def main() -> None:
    figures: dict[str, dict] = {}
    for path in sorted(RESULTS.glob("decode_h200*.json")):
        figures.update(decode_figures(path))
    summary = {key: figures[key] for key in WANTED if key in figures}
    summary["missing"] = [key for key in WANTED if key not in figures]
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for key, fig in summary.items():
        if key != "missing":
            print(f"{key:<34} {fig['value']:>10}  {fig['gpu']}  {fig['date']}")
    print("not measured yet:", ", ".join(summary["missing"]))


if __name__ == "__main__":
    main()
