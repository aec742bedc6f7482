"""The H200's physical limits for the benchmarked RWKV-7 shapes, so that every measured row can be stated as a
percentage of the limit for that shape (issue 6, benchmark 6).

The model is ../shared/spec/performance-limits.md §3 (Tables L1-L3), computed rather than copied, so that batch
sizes, state dtypes and weight formats the tables leave out get a limit too:

* a decode step of B rows streams every weight once and reads and writes each row's whole state once, and does
  2 FLOPs per weight per row: tok/s <= B / max(B * flops / PEAK_FLOPS, (weights + B * state R+W) / BANDWIDTH);
* a prompt's tokens are compute-bound (the head runs on each prompt's last token only):
  tok/s <= PEAK_FLOPS / (2 * (params read per token - head params)); the time to the first token of a prompt of n
  tokens is at least n times that per-token time (and never less than one read of the weights).

4.3 TB/s and 790 TFLOP/s are what the spec measured on the lent H200, not the datasheet's.
"""
from __future__ import annotations

from dataclasses import dataclass

BANDWIDTH = 4.3e12     # bytes/s, HBM3e as measured on the lent H200
PEAK_FLOPS = 790e12    # dense fp16 tensor-core FLOP/s, as measured
VOCAB = 65536


@dataclass(frozen=True)
class Shape:
    layers: int
    width: int
    params_read: float           # parameters a decode token reads (all but the embedding table), Table L1
    weight_bytes: dict[str, float]  # bytes a decode token reads, per weight format (Table L1: fp16, int8, int4 g64)

    def state_bytes(self, state: str) -> float:
        """One row's recurrent state: L * C * (64 WKV values + 2 token shifts) (Table L1's closed form); the WKV
        state in fp32 or fp16, the shifts in fp16."""
        wkv = {"fp32": 4, "fp16": 2}[state]
        return self.layers * self.width * (64 * wkv + 2 * 2)

    @property
    def head_params(self) -> float:
        return VOCAB * self.width


SHAPES = {
    "0.1b": Shape(12, 768, 0.141e9, {"fp16": 0.282e9, "int8": 0.147e9, "int4": 0.083e9}),
    "1.5b": Shape(24, 2048, 1.393e9, {"fp16": 2.787e9, "int8": 1.446e9, "int4": 0.816e9}),
    "7.2b": Shape(32, 4096, 6.931e9, {"fp16": 13.863e9, "int8": 7.155e9, "int4": 4.006e9}),
}

# bench_decode.py's --engine values -> the bytes their weights take
ENGINE_FORMATS = {"fp16": "fp16", "cutlass": "int8", "gemlite:A16W8_INT8": "int8", "gemlite:A16W8_FP8": "int8",
                  "gemlite:A16W4_HQQ_INT": "int4"}


def decode_tok_s(size: str, batch: int, state: str = "fp32", engine: str = "fp16") -> float:
    """The most tokens a second one decode step of ``batch`` rows can deliver on the H200."""
    shape = SHAPES[size]
    flops_s = batch * 2 * shape.params_read / PEAK_FLOPS
    bytes_s = (shape.weight_bytes[ENGINE_FORMATS[engine]] + 2 * batch * shape.state_bytes(state)) / BANDWIDTH
    return batch / max(flops_s, bytes_s)


def prefill_tok_s(size: str) -> float:
    """The most prompt tokens a second: tensor-core bound, the head only on each prompt's last token."""
    shape = SHAPES[size]
    return PEAK_FLOPS / (2 * (shape.params_read - shape.head_params))


def ttft_floor_ms(size: str, prompt_tokens: int, engine: str = "fp16") -> float:
    """The shortest time to the first token of one prompt of ``prompt_tokens`` tokens (model only)."""
    shape = SHAPES[size]
    weights_s = shape.weight_bytes[ENGINE_FORMATS[engine]] / BANDWIDTH
    return 1000 * max(prompt_tokens / prefill_tok_s(size), weights_s)


def percent(measured: float, limit: float) -> float:
    return round(100 * measured / limit, 1)
