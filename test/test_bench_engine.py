"""bench/bench_engine.py's split of a concurrent run (ramp, steady rate, the engine's own steps from its metrics):
what `bash bench/h200_pending.sh engine-256` reports. Checked on the CPU with a tiny model, so that a renamed metric
or a changed engine does not turn the breakdown into zeros unnoticed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_engine import concurrent_breakdown  # noqa: E402
from infer.engine import Engine  # noqa: E402
from infer.model import RWKV7  # noqa: E402
from infer.random_model import make_config, random_state_dict  # noqa: E402
from infer.runner import ModelRunner  # noqa: E402
from infer.tokenizer import load_world_tokenizer  # noqa: E402


@pytest.mark.parametrize("decode_ahead", [False, True])
def test_concurrent_breakdown_counts_the_engines_steps(decode_ahead):
    model = RWKV7.from_state_dict(random_state_dict(make_config(2, 128, 65536), seed=5, dtype=torch.float32),
                                  device="cpu")
    tokenizer = load_world_tokenizer()
    engine = Engine(ModelRunner(model, 8), tokenizer, decode_ahead=decode_ahead)
    engine.start()
    try:
        prompt = tokenizer.encode("User: hello\n\nAssistant:")
        out = concurrent_breakdown(engine, [prompt] * 4, max_tokens=6)
    finally:
        engine.shutdown()
    # 4 rows of 6 tokens: at least the 6 steps of the longest row, each of at most 4 rows; 24 tokens in all
    assert out["steps"] >= 6 and 1.0 <= out["rows_per_step"] <= 4.0
    assert out["step_ms_mean"] > 0 and out["tok_s"] > 0 and out["steady_tok_s"] > 0
    assert out["last_first_token_ms"] > 0
    # decode ahead queues each all-decoding step behind the last: most steps; never without it
    assert (out["steps_ahead"] > 0) == decode_ahead and out["steps_ahead"] < out["steps"]
