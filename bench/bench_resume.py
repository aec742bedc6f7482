"""Time to first token of a follow-up turn in a long conversation: resumed from the session's
stored state (L1, L2 or SQLite) versus re-prefilling the whole transcript (what a stateless client
that resends the history costs). No HTTP: the route's path from the session store through the
event bridge to the engine thread, on the demo-size random model.

    python bench/bench_resume.py [--n-layer 4 --n-embd 256 --transcript 4096] [--out bench/results/resume_cpu.json]

Each case is repeated ``--repeats`` times; the table shows the median (and the fastest). "load" is
the store's part (finding the state, copying it to the device, decoding a database row).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from infer.api.bridge import EventStream, RowGroup  # noqa: E402
from infer.engine import Engine, GenerationOptions, RowFinished, RowText  # noqa: E402
from infer.model import RWKV7  # noqa: E402
from infer.random_model import make_config, random_state_dict  # noqa: E402
from infer.runner import ModelRunner  # noqa: E402
from infer.sampler import SamplingParams  # noqa: E402
from infer.sessions import SessionService  # noqa: E402
from infer.state import SlotState  # noqa: E402
from infer.tokenizer import load_world_tokenizer  # noqa: E402
from state_pool import SessionStore  # noqa: E402

NAMESPACE = "bench"
FOLLOW_UP = "\n\nUser: Given all of that, what should we do first tomorrow morning?\n\nAssistant:"
GREEDY = SamplingParams(temperature=0)


def transcript(tokenizer, n_tokens: int) -> list[int]:
    """A deterministic chat transcript of about ``n_tokens`` tokens."""
    turns, i = [], 0
    while len(tokenizer.encode("\n\n".join(turns))) < n_tokens:
        turns += [f"User: Item {i}: please summarise the plan for day {i} of the project and the risks.",
                  f"Assistant: Day {i} covers design review {i}, two experiments and a write-up; the risk "
                  f"is that experiment {i} slips, so we keep a buffer of {i % 5 + 1} hours."]
        i += 1
    return tokenizer.encode("\n\n".join(turns))[:n_tokens]


async def first_token(engine: Engine, prompt: list[int], state: SlotState | None) -> float:
    """Seconds from now to the first sampled token of ``prompt`` run from ``state``."""
    started = time.perf_counter()
    stream = EventStream(engine, [RowGroup([prompt], GenerationOptions(max_tokens=1, sampling=GREEDY),
                                           [state])])
    stream.submit()
    first = None
    async for events in stream.batches():
        if first is None and any(isinstance(e, (RowText, RowFinished)) for e in events):
            first = time.perf_counter() - started
    return first


async def resume(engine: Engine, service: SessionService, session: str, follow_up: list[int]) -> tuple[float, float]:
    """(load seconds, time to first token) of a turn on ``session``, as /state/chat/completions runs it."""
    started = time.perf_counter()
    turn = await service.continue_session(NAMESPACE, session)
    loaded = time.perf_counter() - started
    ttft = await first_token(engine, follow_up, turn.state) + loaded
    await turn.release()  # the benchmark does not store the follow-up: every repeat starts from the same state
    return loaded, ttft


async def place(store: SessionStore, session: str, tier: str, fillers: list[str], state: SlotState) -> None:
    """Make ``session`` live in ``tier`` (L1 and L2 hold one session each in this benchmark)."""
    await store.get(NAMESPACE, session)  # now the most recent in L1
    if tier == "l1":
        return
    for filler in fillers[:1 if tier == "l2" else 2]:
        await store.put(NAMESPACE, filler, state)
    await store.flush()  # written rows: a session on disk keeps no copy in RAM
    assert {i.session_id: str(i.tier) for i in (await store.list(NAMESPACE))[1]}[session] == tier


async def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    config = make_config(args.n_layer, args.n_embd, 65536)
    model = RWKV7.from_state_dict(random_state_dict(config, seed=1, dtype=torch.float32), device="cpu")
    tokenizer = load_world_tokenizer()
    engine = Engine(ModelRunner(model, 4), tokenizer, prefill_chunk_size=args.chunk)
    engine.start()
    history = transcript(tokenizer, args.transcript)
    follow_up = tokenizer.encode(FOLLOW_UP)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = SessionStore(Path(tmp) / "sessions.db", "bench", config, l1=1, l2=1, flush_interval=3600)
        await store.start()
        try:
            stream = EventStream(engine, [RowGroup([history], GenerationOptions(max_tokens=1, sampling=GREEDY,
                                                                              keep_state=True))])
            stream.submit()
            state = [e.state async for events in stream.batches() for e in events if isinstance(e, RowFinished)][0]
            await store.put(NAMESPACE, "conversation", state)
            service = SessionService(store)
            await first_token(engine, follow_up, state)  # warm-up
            for tier, label in (("l1", "resume from L1 (device)"), ("l2", "resume from L2 (host RAM)"),
                                ("disk", "resume from SQLite")):
                loads, ttfts = [], []
                for _ in range(args.repeats):
                    await place(store, "conversation", tier, ["filler-a", "filler-b"], state)
                    load, ttft = await resume(engine, service, "conversation", follow_up)
                    loads.append(load)
                    ttfts.append(ttft)
                results[label] = {"prompt_tokens": len(follow_up), "load_ms": summary(loads), "ttft_ms": summary(ttfts)}
            ttfts = [await first_token(engine, history + follow_up, None) for _ in range(args.repeats)]
            results["re-prefill the transcript"] = {"prompt_tokens": len(history) + len(follow_up),
                                                    "load_ms": None, "ttft_ms": summary(ttfts)}
        finally:
            await store.close()
            engine.shutdown()
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor()
            or platform.machine(), "cpus": torch.get_num_threads(), "torch": torch.__version__,
            "model": f"L{args.n_layer} C{args.n_embd} V65536 (random, fp32, CPU)",
            "state_bytes": state.nbytes(), "transcript_tokens": len(history), "prefill_chunk": args.chunk,
            "repeats": args.repeats, "results": results}


def summary(seconds: list[float]) -> dict[str, float]:
    return {"median": round(1000 * statistics.median(seconds), 2), "min": round(1000 * min(seconds), 2)}


def table(report: dict) -> str:
    base = report["results"]["re-prefill the transcript"]["ttft_ms"]["median"]
    lines = [f"{report['model']}, {report['transcript_tokens']}-token transcript, state {report['state_bytes']} B, "
             f"median of {report['repeats']}",
             f"{'case':<28} {'prompt tok':>10} {'load ms':>9} {'TTFT ms':>9} {'min ms':>9} {'speed-up':>9}"]
    for case, r in report["results"].items():
        load = f"{r['load_ms']['median']:.2f}" if r["load_ms"] else "-"
        lines.append(f"{case:<28} {r['prompt_tokens']:>10} {load:>9} {r['ttft_ms']['median']:>9.2f} "
                     f"{r['ttft_ms']['min']:>9.2f} {base / r['ttft_ms']['median']:>8.1f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--transcript", type=int, default=4096, help="tokens of conversation before the follow-up")
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per engine step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    report = asyncio.run(run(args))
    report["table"] = table(report).splitlines()
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
