"""Does a small host-to-device copy wait for the work already queued on the stream?

CUDA documents that a copy from pageable host memory "may synchronize with the stream". The runner
copies each step's token and slot ids to the device while the previous step may still be running (decode
ahead); if such a copy waits, the host cannot queue the next step before the device is idle. This queues
~20 ms of device sleep, then times on the host each way of copying a few ids, and prints a table.

    python bench/experiment_h2d_sync.py [--out bench/results/experiment_h2d_sync_h200.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def host_ms(action, busy_cycles: int) -> float:
    """Host time of ``action`` issued right after ~20 ms of device sleep was queued (median of 5)."""
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(busy_cycles)
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    # cycles for ~20 ms: calibrate on one sleep, after a first one (the first launch also loads the kernel)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    busy = int(10_000_000 * 20e-3 / (time.perf_counter() - start))
    rows = []
    for count in (1, 256):
        ids = list(range(count))
        dst = torch.empty(count, dtype=torch.long, device=device)
        pageable = torch.tensor(ids, dtype=torch.long)
        pinned = torch.tensor(ids, dtype=torch.long).pin_memory()
        cases = {
            "copy_ from pageable, non_blocking": lambda: dst.copy_(pageable, non_blocking=True),
            "copy_ from pinned, non_blocking": lambda: dst.copy_(pinned, non_blocking=True),
            "torch.tensor(list) + copy_ non_blocking": lambda: dst.copy_(torch.tensor(ids, dtype=torch.long),
                                                                         non_blocking=True),
            "torch.tensor(list, pin_memory) + copy_ non_blocking": lambda: dst.copy_(
                torch.tensor(ids, dtype=torch.long, pin_memory=True), non_blocking=True),
            "torch.tensor(list, device=cuda)": lambda: torch.tensor(ids, dtype=torch.long, device=device),
        }
        for name, action in cases.items():
            rows.append({"ids": count, "copy": name, "host_ms": round(host_ms(action, busy), 3)})
    print(f"{'ids':>4}  {'copy':55s} host ms (device busy ~20 ms)")
    for r in rows:
        print(f"{r['ids']:>4}  {r['copy']:55s} {r['host_ms']:8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
