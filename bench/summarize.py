"""Collect the headline GPU figures from bench/results/*.json into bench/results/summary.json.

Stable keys (e.g. ``decode_bsz1_7.2b_fp16_tok_s``), each with its value, GPU, date and source
file; figures not measured yet are listed under ``missing``. Sources: ``decode_h200*.json``
(bench_decode.py; the newest measurement of a figure wins; ``experiment_*.json`` are variants kept
for the record and never summarized), ``official_h200*.json`` (bench_official.py, the official ``rwkv`` package) and
``serving_h200_<size>.json`` (bench_serving.py --name h200_<size>, e.g. from h200_serving.sh). Each figure also
carries the H200 limit for its shape (bench/limits.py) and its share of it (``pct_of_limit``; for times, the
floor over the measured time).

    python bench/summarize.py [--results DIR]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import limits  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WANTED = ["decode_bsz1_7.2b_fp16_tok_s", "decode_bsz1_1.5b_fp16_tok_s", "decode_b256_7.2b_fp16_tok_s",
          "decode_b512_7.2b_fp16_tok_s", "decode_bsz1_7.2b_w8_tok_s", "decode_b256_7.2b_w8_tok_s",
          "prefill_batched_7.2b_tok_s", "ttft_1k_7.2b_ms", "serving_256_7.2b_tok_s", "official_rwkv_bsz1_7.2b_tok_s",
          "official_rwkv_bsz1_1.5b_tok_s"]
SERVING_LEVELS = (1, 32, 256)
SERVING_STATS = ("tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
WANTED += [f"serving_{n}_7.2b_{stat}" for n in SERVING_LEVELS for stat in SERVING_STATS
           if f"serving_{n}_7.2b_{stat}" not in WANTED]
ENGINE_NAMES = {"fp16": "fp16", "cutlass": "w8", "gemlite:A16W8_INT8": "gemlite_w8", "gemlite:A16W8_FP8": "gemlite_fp8",
                "gemlite:A16W4_HQQ_INT": "w4"}
WANTED += ["decode_bsz1_7.2b_w4_tok_s", "decode_b256_7.2b_w4_tok_s", "decode_bsz1_7.2b_gemlite_w8_tok_s",
           "decode_b256_7.2b_gemlite_w8_tok_s"]
# performance-limits.md S2 states the batch-256/512 targets with fp16 state: those rows under keys of their own
WANTED += ["decode_b256_7.2b_fp16_fp16state_tok_s", "decode_b512_7.2b_fp16_fp16state_tok_s"]


# The batched-prefill figure is of 16 prompts or more: a file of only a few rows (an A/B of the small-grid
# kernels) must not replace it.
BATCHED_PREFILL_ROWS = 16


def against(limit: float, measured: float, time: bool = False) -> dict:
    """A figure's limit and its share of it: rate over limit, or for a time the floor over the time."""
    return {"limit": round(limit, 2 if time else None),
            "pct_of_limit": limits.percent(limit, measured) if time else limits.percent(measured, limit)}


def decode_figures(path: Path) -> dict[str, dict]:
    data = json.loads(path.read_text())
    out = {}
    for row in data.get("decode", []):
        state = row.get("state")
        if state not in ("fp32", "fp16") or "graph_tok_s" not in row:
            continue
        batch = "bsz1" if row["batch"] == 1 else f"b{row['batch']}"
        suffix = "_fp16state" if state == "fp16" else ""
        key = f"decode_{batch}_{row['size']}_{ENGINE_NAMES[row.get('engine', 'fp16')]}{suffix}_tok_s"
        out[key] = {"value": row["graph_tok_s"], "gpu": data["gpu"], "date": data["date"], "source": path.name,
                    **against(limits.decode_tok_s(row["size"], row["batch"], state, row.get("engine", "fp16")),
                              row["graph_tok_s"]),
                    "note": f"model forward ({row.get('forward', 'readable')}) replayed as a CUDA graph, {state} WKV "
                            "state, no sampling"}
    for row in data.get("prefill", []):
        if row.get("engine", "fp16") != "fp16":
            continue
        base = {"gpu": data["gpu"], "date": data["date"], "source": path.name}
        if row["rows"] == 1 and row["prompt_tokens"] == 1024:
            out[f"ttft_1k_{row['size']}_ms"] = {**base, "value": row["ms"],
                                                 **against(limits.ttft_floor_ms(row["size"], 1024), row["ms"], True),
                                                 "note": "one forward over a 1,024-token prompt (model only)"}
        if row["rows"] >= BATCHED_PREFILL_ROWS:
            key = f"prefill_batched_{row['size']}_tok_s"
            if row["tok_s"] > out.get(key, {}).get("value", 0):
                out[key] = {**base, "value": row["tok_s"], **against(limits.prefill_tok_s(row["size"]), row["tok_s"]),
                            "note": f"{row['rows']} prompts x {row['prompt_tokens']} tokens in one packed forward"}
    return out


def official_figures(path: Path) -> dict[str, dict]:
    """bench_official.py: the official package's batch-1 decode, one key per size."""
    data = json.loads(path.read_text())
    if not str(data.get("device", "")).startswith("cuda"):
        return {}
    out = {}
    for row in data.get("results", []):
        if "tok_s" not in row:
            continue
        out[f"official_rwkv_bsz1_{row['size']}_tok_s"] = {
            "value": row["tok_s"], "gpu": data["gpu"], "date": data["date"], "source": path.name,
            **against(limits.decode_tok_s(row["size"], 1), row["tok_s"]),
            "note": f"official rwkv {data.get('rwkv')} ({data.get('strategy')}, {row.get('mode')}, JIT), "
                    f"model.forward([token], state) per token, no sampling; greedy loop with a host sync per token: "
                    f"{row.get('greedy_tok_s')} tok/s"}
    return out


def serving_figures(path: Path) -> dict[str, dict]:
    """bench_serving.py --name h200_<size>: HTTP streaming tok/s, TTFT and ITL per concurrency level."""
    match = re.fullmatch(r"serving_h200_(\d+(?:\.\d+)?b)\.json", path.name)
    data = json.loads(path.read_text())
    if not match or not data.get("gpu") or str(data["gpu"]).startswith("cpu"):
        return {}
    size, out = match.group(1), {}
    base = {"gpu": data["gpu"], "date": data["date"], "source": path.name}
    for row in data.get("levels", []):
        n = row["clients"]
        for stat in SERVING_STATS:
            if stat in row:
                what = "aggregate output tokens/s" if stat == "tok_s" else stat.replace("_ms_", " ms ")
                # bench_serving.py writes each level's limit (older files: the server's default fp32 state)
                limit = against(row.get("limit_tok_s") or limits.decode_tok_s(size, n), row[stat]) \
                    if stat == "tok_s" else {}
                out[f"serving_{n}_{size}_{stat}"] = {
                    **base, "value": row[stat], **limit,
                    "note": f"{n} concurrent streaming /v1/completions clients, {data.get('max_tokens')} tokens each, "
                            f"{what}, client side; server {' '.join(data.get('server_args', []))}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(RESULTS), help="folder of the result files (summary.json goes there)")
    results = Path(ap.parse_args().results)
    figures: dict[str, dict] = {}

    def keep_newest(found: dict[str, dict]) -> None:  # a re-measured figure replaces an older one
        for key, fig in found.items():
            if key not in figures or fig["date"] >= figures[key]["date"]:
                figures[key] = fig

    for path in sorted(results.glob("decode_h200*.json")):
        keep_newest(decode_figures(path))
    for path in sorted(results.glob("official_h200*.json")):
        keep_newest(official_figures(path))
    for path in sorted(results.glob("serving_h200*.json")):
        keep_newest(serving_figures(path))
    summary = {key: figures[key] for key in WANTED if key in figures}
    summary["missing"] = [key for key in WANTED if key not in figures]
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for key, fig in summary.items():
        if key != "missing":
            share = f"{fig['pct_of_limit']:>5} % of {fig['limit']}" if "limit" in fig else ""
            print(f"{key:<38} {fig['value']:>10} {share:<22} {fig['gpu']}  {fig['date']}")
    print("not measured yet:", ", ".join(summary["missing"]))


if __name__ == "__main__":
    main()
