"""py-spy around a stretch of a running server's work: where each of its threads spends its time.

    from pyspy import recorded
    profile = recorded(server.pid, lambda: run_the_load())   # None when py-spy is missing or may not attach

A thread's samples over the rate are its busy seconds: by default the seconds it was not idle as py-spy sees it
(which counts some waits for the GIL as running); with ``gil=True`` only the thread holding the GIL is sampled, so
they are the seconds it held the GIL (what a server whose threads share one GIL is bound by).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

RATE_HZ = 250


def thread_role(name: str) -> str:
    return "event loop" if name == "MainThread" else "engine" if name == "rwkv-engine" else "other"


def profile_summary(raw: Path, top: int = 30) -> dict:
    """py-spy --format raw (collapsed stacks with counts) -> per thread role: busy seconds, self and inclusive
    sample shares."""
    per_thread: dict[str, Counter] = defaultdict(Counter)
    incl: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread = thread_role(frames[0].partition(": ")[2])
        c = int(count)
        totals[thread] += c
        names = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].split("/")[-1] + ")" for f in frames[1:]]
        if names:
            per_thread[thread][names[-1]] += c
        for name in set(names):
            incl[thread][name] += c
    out = {}
    for thread, total in totals.items():
        out[thread] = {"samples": total, "busy_s": round(total / RATE_HZ, 3),
                       "self": [(name, round(100 * c / total, 1)) for name, c in per_thread[thread].most_common(top)],
                       "inclusive": [(name, round(100 * c / total, 1)) for name, c in incl[thread].most_common(top)]}
    return out


def recorded(pid: int, work: Callable[[], object], label: str = "server", gil: bool = False) -> dict | None:
    """Run ``work`` while py-spy records process ``pid``'s threads (``gil``: only the one holding the GIL); their
    summary (None: no py-spy, or it could not attach, e.g. ptrace not permitted)."""
    if shutil.which("py-spy") is None:
        print("py-spy not found: no profile", flush=True)
        return None
    raw = Path(tempfile.gettempdir()) / f"pyspy_{label}_{os.getpid()}.txt"
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw",
                            "--threads", *(["--gil"] if gil else []), "-o", str(raw)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    try:
        work()
    finally:
        spy.send_signal(signal.SIGINT)
        _, err = spy.communicate(timeout=60)
    if not raw.exists():
        print(f"py-spy recorded nothing: {err.strip()[-500:]}", flush=True)
        return None
    return profile_summary(raw)


def print_profile(profile: dict, top: int = 15) -> None:
    for thread, p in profile.items():
        print(f"\npy-spy, {thread} thread ({p['samples']} samples, {p.get('busy_s', '?')} s busy), top self %:")
        for name, pct in p["self"][:top]:
            print(f"  {pct:5.1f}  {name}")
