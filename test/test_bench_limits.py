"""bench/limits.py: the H200 limit every benchmark row is stated against (issue 6, benchmark 6). It computes the
limits of ../shared/spec/performance-limits.md §3 from the shapes; these tests hold it to the spec's own tables
(values copied from Tables L2 and L3), so that a wrong byte count or a state of the wrong width shows. Also how
summarize.py and bench_serving.py attach the limit to a figure."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import limits, summarize  # noqa: E402
from bench.bench_serving import limit_of  # noqa: E402

BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024)
# performance-limits.md Table L3, aggregate tok/s: (size, state, engine) -> one value per batch of BATCHES
TABLE_L3 = {
    ("1.5b", "fp32", "fp16"): (1529, 11500, 38171, 62225, 90848, 117985, 138700, 152048),
    ("1.5b", "fp16", "fp16"): (1536, 11900, 42971, 76077, 123745, 180199, 233451, 273925),
    ("7.2b", "fp32", "fp16"): (309, 2388, 8576, 15100, 24368, 35157, 45152, 52634),
    ("7.2b", "fp16", "fp16"): (309, 2433, 9192, 17117, 30089, 48448, 56986, 56986),
    ("7.2b", "fp16", "cutlass"): (598, 4629, 16653, 29370, 47511, 56986, 56986, 56986),
    ("7.2b", "fp16", "gemlite:A16W4_HQQ_INT"): (1064, 8031, 26908, 44237, 56986, 56986, 56986, 56986),
}


@pytest.mark.parametrize("key", sorted(TABLE_L3))
def test_decode_limits_are_the_specs_table(key):
    size, state, engine = key
    for batch, want in zip(BATCHES, TABLE_L3[key]):
        got = limits.decode_tok_s(size, batch, state, engine)
        assert got == pytest.approx(want, rel=5e-3), (key, batch, got, want)


def test_small_model_limits_and_the_batch_1_bounds_of_each_format():
    # the note under Table L3 (0.1B, fp32 / fp16 state) and Table L2's batch-1 bounds (fp32 state)
    # (the note gives three figures: 1 %)
    for batch, fp32, fp16 in ((8, 108e3, 114e3), (32, 316e3, 383e3), (256, 730e3, 1.22e6), (1024, 849e3, 1.59e6)):
        assert limits.decode_tok_s("0.1b", batch, "fp32") == pytest.approx(fp32, rel=1e-2)
        assert limits.decode_tok_s("0.1b", batch, "fp16") == pytest.approx(fp16, rel=1e-2)
    for engine, want in (("fp16", 309), ("cutlass", 595), ("gemlite:A16W8_INT8", 595), ("gemlite:A16W4_HQQ_INT", 1055)):
        assert limits.decode_tok_s("7.2b", 1, "fp32", engine) == pytest.approx(want, rel=5e-3)
    assert limits.decode_tok_s("1.5b", 1, "fp32", "cutlass") == pytest.approx(2922, rel=5e-3)


def test_prefill_ceiling_and_ttft_floors():
    assert limits.prefill_tok_s("7.2b") == pytest.approx(59.3e3, rel=5e-3)
    assert limits.prefill_tok_s("1.5b") == pytest.approx(314e3, rel=5e-3)
    for size, floors in (("7.2b", (17.3, 69.1, 276)), ("1.5b", (3.3, 13.1, 52.2))):
        for tokens, want in zip((1024, 4096, 16384), floors):
            assert limits.ttft_floor_ms(size, tokens) == pytest.approx(want, rel=1e-2, abs=0.05)  # spec: 1 decimal
    # a prompt of a few tokens cannot beat one read of the weights
    assert limits.ttft_floor_ms("7.2b", 2) == pytest.approx(1000 * 13.863e9 / limits.BANDWIDTH)


def test_state_bytes_are_the_closed_form():
    assert limits.SHAPES["7.2b"].state_bytes("fp32") == 260 * 32 * 4096  # 34.08 MB (Table L1)
    assert limits.SHAPES["7.2b"].state_bytes("fp16") == 132 * 32 * 4096  # 17.30 MB


def test_summarize_puts_every_rate_and_time_against_its_limit(tmp_path):
    decode = {"date": "2026-12-05T00:00:00+00:00", "gpu": "NVIDIA H200", "decode": [
        {"size": "7.2b", "engine": "fp16", "batch": 1, "state": "fp32", "graph_tok_s": 274.3},
        {"size": "7.2b", "engine": "fp16", "batch": 512, "state": "fp16", "graph_tok_s": 27623.2},
        {"size": "7.2b", "engine": "gemlite:A16W4_HQQ_INT", "batch": 1, "state": "fp32", "graph_tok_s": 448.7}],
        "prefill": [{"size": "7.2b", "engine": "fp16", "rows": 1, "prompt_tokens": 1024, "ms": 29.4, "tok_s": 34830},
                    {"size": "7.2b", "engine": "fp16", "rows": 16, "prompt_tokens": 4096, "ms": 1612, "tok_s": 40652}]}
    serving = {"date": "2026-12-05T00:00:00+00:00", "gpu": "NVIDIA H200", "max_tokens": 256,
               "server_args": ["--model-path", "/tmp/rwkv7-7.2b-random-fp16.pth"],
               "levels": [{"clients": 256, "tok_s": 16695.2, "ttft_ms_p50": 503.4},
                          {"clients": 32, "tok_s": 5178.2, "limit_tok_s": 9192}]}  # a level with its own limit
    (tmp_path / "decode_h200_x.json").write_text(json.dumps(decode))
    (tmp_path / "serving_h200_7.2b.json").write_text(json.dumps(serving))
    old_argv = sys.argv
    sys.argv = ["summarize.py", "--results", str(tmp_path)]
    try:
        summarize.main()
    finally:
        sys.argv = old_argv
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["decode_bsz1_7.2b_fp16_tok_s"]["pct_of_limit"] == pytest.approx(88.8, abs=0.15)
    assert summary["decode_b512_7.2b_fp16_fp16state_tok_s"]["limit"] == pytest.approx(56986, rel=5e-3)
    assert summary["decode_bsz1_7.2b_w4_tok_s"]["pct_of_limit"] == pytest.approx(42.5, abs=0.15)
    assert summary["ttft_1k_7.2b_ms"]["pct_of_limit"] == pytest.approx(100 * 17.27 / 29.4, abs=0.15)  # floor / time
    assert summary["prefill_batched_7.2b_tok_s"]["pct_of_limit"] == pytest.approx(68.6, abs=0.15)
    assert summary["serving_256_7.2b_tok_s"]["limit"] == pytest.approx(35157, rel=5e-3)
    assert summary["serving_32_7.2b_tok_s"]["limit"] == 9192
    assert "limit" not in summary["serving_256_7.2b_ttft_ms_p50"]


def test_serving_limit_follows_the_servers_command_line():
    args = ["--model-path", "/tmp/rwkv7-1.5b-random-fp16.pth", "--state-dtype", "fp16"]
    assert limit_of(None, args, 256) == pytest.approx(180199, rel=5e-3)
    assert limit_of("7.2b", ["--model-path=/x/model.pth"], 256) == pytest.approx(35157, rel=5e-3)
    assert limit_of(None, ["--model-path", "/x/model.pth"], 256) is None  # size unknown
    assert limit_of("7.2b", ["--inference-engine", "cutlass"], 1) == pytest.approx(595, rel=5e-3)
    assert limit_of("7.2b", ["--inference-engine", "gemlite"], 1) is None  # format only in the checkpoint
