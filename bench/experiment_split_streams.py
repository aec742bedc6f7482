"""Experiment: a large decode batch as parts on separate CUDA streams, captured in one graph.

At batch 256 a 7.2B decode step is ~60 % cuBLAS GEMMs (compute-bound, few tiles per matrix at 256 rows) and
~40 % the time-mix kernel (bound by reading and writing the fp32 state). Rows are independent sequences, so
the batch can run as P forwards of B/P rows on P streams: one part's time mix can then run beside another
part's GEMMs. This times a step as one forward and as P parts (the same rows, slots and state pool), both
replayed as CUDA graphs, and checks that the parts give the same logits as the one forward.

    python bench/experiment_split_streams.py --sizes 7.2b --batches 256,512 --parts 2,4
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_decode import capture_calls, load_model, static_batch, time_steps  # noqa: E402
from infer.model import RWKV7  # noqa: E402


def forward_parts(model: RWKV7, batches: list, pool, streams: list[torch.cuda.Stream]) -> list[torch.Tensor]:
    """One forward per part, part i on streams[i]; every stream waits for the current one first and the
    current one for all of them after."""
    main = torch.cuda.current_stream()
    outs = []
    for batch, stream in zip(batches, streams):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            outs.append(model.forward(batch, pool))
    for stream in streams:
        main.wait_stream(stream)
    return outs


def run(name: str, batches: list[int], parts_list: list[int], steps: int) -> list[dict]:
    model = load_model(name, "fp16")
    rows = []
    for B in batches:
        tokens = torch.randint(1, 65530, (B,)).tolist()
        whole = static_batch(tokens, list(range(B)))
        pool = model.new_state_pool(B)
        graph, _ = capture_calls(lambda: model.forward(whole, pool))
        one = time_steps(graph.replay, steps)
        del graph
        row = {"size": name, "batch": B, "one_stream_ms": round(one * 1000, 3), "one_stream_tok_s": round(B / one, 1)}
        for parts in parts_list:
            size = B // parts
            pieces = [static_batch(tokens[i * size:(i + 1) * size], list(range(i * size, (i + 1) * size)))
                      for i in range(parts)]
            streams = [torch.cuda.Stream() for _ in range(parts)]
            # the same step from the same state, once whole and once in parts: the logits must agree
            start = pool.wkv.clone(), pool.att_shift.clone(), pool.ffn_shift.clone()
            want = model.forward(whole, pool).clone()
            for saved, live in zip(start, (pool.wkv, pool.att_shift, pool.ffn_shift)):
                live.copy_(saved)
            got = torch.cat(forward_parts(model, pieces, pool, streams))
            torch.cuda.synchronize()
            diff = float((got - want).abs().max())
            graph, _ = capture_calls(lambda: forward_parts(model, pieces, pool, streams))
            t = time_steps(graph.replay, steps)
            del graph
            row[f"parts{parts}_ms"] = round(t * 1000, 3)
            row[f"parts{parts}_tok_s"] = round(B / t, 1)
            row[f"parts{parts}_max_logit_diff"] = round(diff, 4)
        rows.append(row)
        print(row, flush=True)
        del pool
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7.2b")
    ap.add_argument("--batches", default="256,512")
    ap.add_argument("--parts", default="2,4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="bench/results/experiment_split_streams_h200.json")
    args = ap.parse_args()
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    for name in args.sizes.split(","):
        result["rows"] += run(name, [int(b) for b in args.batches.split(",")],
                              [int(p) for p in args.parts.split(",")], args.steps)
    Path(args.out).write_text(json.dumps(result, indent=1))
    parts = args.parts.split(",")
    print(f"{'size':>5} {'batch':>5} {'1 stream tok/s':>15} " + " ".join(f"{p + ' parts':>12}" for p in parts))
    for r in result["rows"]:
        print(f"{r['size']:>5} {r['batch']:>5} {r['one_stream_tok_s']:>15} "
              + " ".join(f"{r[f'parts{p}_tok_s']:>12}" for p in parts))


if __name__ == "__main__":
    main()
