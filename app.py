"""RWKV-7 inference server: parse options, load the model, start the engine, serve HTTP.

    python app.py                                  # built-in demo model (random, untrained)
    RWKV_PASSWORD=secret python app.py --model-path /models/rwkv7-g1-1.5b.pth --port 8000
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("rwkv7-server")

INFERENCE_ENGINES = ("fp16", "cutlass", "gemlite")
SHUTDOWN_GRACE_SECONDS = 10
DEFAULT_GIL_SWITCH_MS = 0.5
# Prompt tokens an engine step may feed. On the H200, 256 short prompts arriving at once were admitted
# with a TTFT p50 ~25 % lower at 2048 than at 512 a step (docs/BENCHMARKS.md), while a long prompt
# fed 2048 tokens a step stretched the running streams' ITL p99 from 33 to 102 ms: so prompts over
# --prefill-chunk-size (512) still go 512 tokens a step. A CPU step of 2048 tokens would stall too long.
GPU_PREFILL_STEP_TOKENS, CPU_PREFILL_STEP_TOKENS = 2048, 512


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="RWKV-7 batch inference server (OpenAI and rwkv_lightning compatible)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model-path", help="RWKV-7 x070 checkpoint (.pth or .safetensors, extension optional); "
                                         "omitted: a small built-in demo model with random weights")
    ap.add_argument("--inference-engine", "--backend", dest="inference_engine", choices=INFERENCE_ENGINES,
                    default="fp16", help="linear-layer implementation: fp16 (dense half precision), cutlass (W8A16), "
                                         "gemlite (A16W8/A16W4)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    # No argparse default from the environment: --help prints defaults, and must not print the password.
    ap.add_argument("--password", default=None,
                    help="require this password (Authorization: Bearer, or body 'password' on POST routes); "
                         "prefer the RWKV_PASSWORD environment variable, which is used when this is not given "
                         "and does not show in the process list")
    ap.add_argument("--translate-no-auth", action="store_true",
                    help="serve /translate/v1/batch-translate without the password (for browser extensions "
                         "that cannot send one)")
    ap.add_argument("--cors-origins", default="",
                    help="comma-separated origins allowed to call the API from a browser (e.g. "
                         "https://app.example.com, or * for any); empty: no CORS headers")
    ap.add_argument("--max-body-bytes", type=int, default=16 * 2**20,
                    help="larger request bodies get HTTP 413")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present")
    ap.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default=None,
                    help="weights/activations; default fp32 on CPU, fp16 on CUDA")
    ap.add_argument("--state-dtype", choices=("fp32", "fp16"), default="fp32", help="storage of the WKV state")
    ap.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                    help="replay decode steps (bucketed batch sizes) and steps feeding one row a prompt of 2-64 tokens "
                         "(alone or beside decoding rows) as CUDA graphs (auto: on for CUDA devices)")
    ap.add_argument("--decode-ahead", choices=("auto", "on", "off"), default="auto",
                    help="queue each decode step before the last one's tokens are read, so the GPU does not wait "
                         "for the host between steps (same outputs; auto: on for CUDA devices)")
    ap.add_argument("--wkv", choices=("auto", "cuda", "fla", "torch"), default="auto",
                    help="WKV recurrence implementation: auto picks the CUDA kernel on GPUs when it builds; fla adds "
                         "fla-core's chunked kernel (pip install fla-core==0.6.0) for prefill chunks of 64+ tokens")
    ap.add_argument("--fused-kernels", choices=("auto", "on", "off"), default="auto",
                    help="fused CUDA forward (layer norm/shift/mix, time mix, grouped GEMV): auto uses it on GPUs "
                         "with fp16 activations when it builds; off keeps the readable per-op forward")
    ap.add_argument("--max-batch-size", type=int, default=None,
                    help="state slots = rows running at once; default: 16 on CPU, from free memory on GPU")
    ap.add_argument("--prefill-chunk-size", type=int, default=512,
                    help="prompt tokens per engine step for prompts longer than this (a long prompt holds the "
                         "running streams up by one such chunk a step)")
    ap.add_argument("--prefill-step-tokens", type=int, default=None,
                    help="most prompt tokens one engine step feeds: prompts of at most --prefill-chunk-size "
                         "tokens are fed whole up to this, so a burst of them is admitted in few steps; default: "
                         "2048 on GPU, 512 on CPU (at least --prefill-chunk-size)")
    ap.add_argument("--max-queued-requests", type=int, default=1024, help="beyond this, requests get HTTP 429")
    ap.add_argument("--max-tokens", type=int, default=8192, help="upper limit for a request's max_tokens")
    ap.add_argument("--max-prompt-tokens", type=int, default=131072, help="upper limit for one prompt")
    ap.add_argument("--max-rows-per-request", type=int, default=256,
                    help="upper limit for rows in one request (prompts x choices)")
    ap.add_argument("--state-db", default=None,
                    help="SQLite file of the session states (default: sessions.db in the data directory, "
                         "$RWKV_SERVER_HOME or ~/.local/share/rwkv7-server)")
    ap.add_argument("--state-l1", default="16",
                    help="sessions kept on the model's device: a count, or a size like 2GB")
    ap.add_argument("--state-l2", default="64", help="sessions kept in host RAM: a count, or a size like 8GB")
    ap.add_argument("--state-flush-interval", type=float, default=1.0,
                    help="seconds between writes of changed sessions to the database (a hard kill loses at "
                         "most this much; a graceful stop writes everything)")
    ap.add_argument("--state-max-sessions", type=int, default=None,
                    help="most sessions stored; beyond it the least recently used are deleted")
    ap.add_argument("--state-max-bytes", default="32GB",
                    help="most state bytes stored (the database's size); beyond it the least recently used "
                         "sessions are deleted")
    ap.add_argument("--state-ttl", type=float, default=None, help="delete sessions unused for this many seconds")
    ap.add_argument("--session-busy", choices=("wait", "reject"), default="wait",
                    help="a request on a session that is already in a turn waits for it, or gets HTTP 409")
    ap.add_argument("--prefix-cache", default="2GiB",
                    help="memory for cached prompt-prefix states: a count or a size; 0 turns the cache off")
    ap.add_argument("--prefix-cache-block", type=int, default=256,
                    help="prompt prefixes are cached at multiples of this many tokens (and at chat turn boundaries)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens a streamed row gathers before its next chunk is sent (its first token goes at once): "
                         "fewer, larger chunks, less event-loop work per token for hundreds of streams of a small model "
                         "(default 1: a chunk a token)")
    ap.add_argument("--gil-switch-ms", type=float, default=DEFAULT_GIL_SWITCH_MS,
                    help="how long a thread may hold Python's GIL while another waits for it (sys.setswitchinterval): "
                         "the engine thread waits up to this long for it whenever the HTTP event loop is busy "
                         "(Python's own default is 5 ms)")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                    help="server and access log verbosity (no log line ever contains a password or a prompt)")
    return ap


def default_slots(model, device: str, wkv_dtype) -> int:
    """Slots that fit in half of the free GPU memory (capped at 1024); 16 on CPU."""
    import torch
    if torch.device(device).type != "cuda":
        return 16
    free, _ = torch.cuda.mem_get_info()
    per_slot = model.new_state_pool(1, wkv_dtype).bytes_per_slot + 4 * model.config.vocab_size * 2
    return max(1, min(1024, int(free * 0.5) // per_slot))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_tokens", "max_prompt_tokens", "max_rows_per_request", "max_body_bytes", "max_queued_requests",
                 "prefill_chunk_size", "prefill_step_tokens", "prefix_cache_block", "state_max_sessions",
                 "stream_interval"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("state_flush_interval", "state_ttl", "gil_switch_ms"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import uvicorn

    from infer.api.context import ServerContext, ServerLimits
    from infer.api.server import create_app
    from infer.checkpoint import CheckpointError, open_checkpoint
    from infer.engine import Engine
    from infer.fingerprint import fingerprint
    from infer.model import RWKV7, default_device
    from infer.ops.fused import select_fused
    from infer.ops.wkv_cuda import select_wkv
    from infer.quant.engines import warm_up_gemlite
    from infer.prefix_cache import PrefixCache
    from infer.random_model import data_dir, ensure_demo_model
    from infer.runner import ModelRunner
    from infer.sessions import KEY_CHARS, SessionService
    from infer.tokenizer import load_world_tokenizer
    from state_pool import SessionStore, parse_capacity

    try:
        capacities = {name: parse_capacity(getattr(args, name)) for name in ("state_l1", "state_l2", "prefix_cache")}
        if not parse_capacity(args.state_max_bytes).in_bytes:
            raise ValueError(f"--state-max-bytes {args.state_max_bytes!r}: expected a size like 32GB")
    except ValueError as e:
        parser.error(str(e))

    device = default_device() if args.device == "auto" else args.device
    if args.model_path:
        model_path, model_name = args.model_path, Path(args.model_path).name.removesuffix(".pth").removesuffix(
            ".safetensors")
    else:
        model_path, model_name = str(ensure_demo_model()), "rwkv7-demo-untrained"
        log.warning("no --model-path given: serving the built-in DEMO model with RANDOM, UNTRAINED weights; "
                    "its output is gibberish. Pass --model-path for a real model.")
    try:
        model = RWKV7.load(model_path, device=device, dtype=args.dtype, engine=args.inference_engine)
        model_id = fingerprint(open_checkpoint(model_path))
    except (CheckpointError, RuntimeError, ValueError) as e:
        sys.exit(f"cannot load model: {e}")
    model.wkv = select_wkv(model.device, args.wkv, heads=model.config.n_head)
    try:
        select_fused(model, "off" if args.wkv == "torch" else args.fused_kernels)
    except RuntimeError as e:
        sys.exit(f"cannot start: {e}")
    wkv_dtype = torch.float16 if args.state_dtype == "fp16" else torch.float32
    step_tokens = args.prefill_step_tokens or max(args.prefill_chunk_size, (
        GPU_PREFILL_STEP_TOKENS if model.device.type == "cuda" else CPU_PREFILL_STEP_TOKENS))
    slots = args.max_batch_size or default_slots(model, device, wkv_dtype)
    if args.inference_engine == "gemlite":  # GemLite autotunes per power-of-two row bucket on first use
        most_rows = slots + step_tokens
        warm_up_gemlite(model, sorted({min(2 ** i, most_rows) for i in range(most_rows.bit_length() + 1)}),
                        data_dir())
    graphs = args.cuda_graphs == "on" or (args.cuda_graphs == "auto" and model.device.type == "cuda")
    if graphs and model.device.type != "cuda":
        sys.exit("--cuda-graphs on needs a CUDA device")
    runner = ModelRunner(model, slots, wkv_dtype, cuda_graphs=graphs)
    if runner.graphs is not None:
        log.info("capturing CUDA graphs: decode steps of %s rows (their sampler too), one-row prompt steps of 2-%d "
                 "tokens", runner.graphs.buckets, runner.graphs.prompt_lengths[-1])
        runner.warm_up_graphs()
    if model.device.type == "cuda":  # what a first forward of a shape loads lazily, before the first request
        lengths = sorted({16, args.prefill_chunk_size, step_tokens})
        log.info("warming up prompt steps of %s tokens", lengths)
        runner.warm_up_prompts(lengths)
    for part, impl in runner.implementations().items():
        log.info("%-8s %s", part, impl)
    decode_ahead = args.decode_ahead == "on" or (args.decode_ahead == "auto" and model.device.type == "cuda")
    engine = Engine(runner, load_world_tokenizer(), prefill_chunk_size=args.prefill_chunk_size,
                    prefill_step_tokens=step_tokens,
                    max_queued_requests=args.max_queued_requests, decode_ahead=decode_ahead)
    log.info("decode   %s", "steps queued ahead of the host" if decode_ahead else "one step at a time")
    log.info("prefill  up to %d prompt tokens a step; prompts over %d tokens fed that many a step", step_tokens,
             args.prefill_chunk_size)
    state_db = Path(args.state_db) if args.state_db else data_dir() / "sessions.db"
    log.info("session states: %s (model fingerprint %s)", state_db, model_id)
    store = SessionStore(state_db, model_id, model.config, device=model.device, l1=capacities["state_l1"],
                         l2=capacities["state_l2"], max_sessions=args.state_max_sessions,
                         max_bytes=args.state_max_bytes, ttl=args.state_ttl, flush_interval=args.state_flush_interval,
                         max_key_len=KEY_CHARS)
    prefix_cache = None
    if capacities["prefix_cache"].limit > 0:
        prefix_cache = PrefixCache(capacities["prefix_cache"], block=args.prefix_cache_block,
                                   registry=engine.metrics.registry)
    if args.password:
        log.warning("--password is visible in the process list; prefer the RWKV_PASSWORD environment variable")
    password = args.password or os.environ.get("RWKV_PASSWORD") or None
    if password is None and not is_loopback(args.host):
        log.warning("listening on %s without a password: anyone who can reach this port can use the server",
                    args.host)
    limits = ServerLimits(max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
                          max_rows=args.max_rows_per_request, max_body_bytes=args.max_body_bytes)
    origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()]
    app = create_app(ServerContext(engine, load_world_tokenizer(), model_name, password, limits,
                                   translate_no_auth=args.translate_no_auth, cors_origins=origins,
                                   sessions=SessionService(store, args.session_busy), prefix_cache=prefix_cache,
                                   stream_interval=args.stream_interval))
    log.info("streams  a chunk every %d token(s) a row after the first", args.stream_interval)
    sys.setswitchinterval(args.gil_switch_ms / 1000)
    log.info("GIL      a thread waiting for it gets it within %g ms", args.gil_switch_ms)
    engine.start()
    try:
        # Open streams must not hold up a shutdown forever.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
