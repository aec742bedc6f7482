"""RWKV-7 "x070" weights and the batched forward pass over state slots (readable math).

The math follows ../shared/spec/rwkv7-math.md §2-3. Faster implementations plug in at three
places without touching this file's structure: the WKV recurrence (``infer.ops.wkv``), the
linear layers (``infer.ops.linear``) and the sampler (``infer.sampler``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F

from infer.batch import PackedBatch
from infer.checkpoint import (GEMLITE_INFIX, PROJECTIONS, SCALE_SUFFIX, CheckpointError, DictSource, ModelConfig,
                              TensorSource, infer_config, iter_tensors, open_checkpoint, weight_layout)
from infer.ops.linear import DenseLinear, Linear
from infer.quant.engines import LinearFactory, check_engine, linear_factory
from infer.ops.wkv import WKV, TorchWKV
from infer.state import StatePool

if TYPE_CHECKING:
    from infer.ops.fused import FusedKernels

log = logging.getLogger(__name__)

LN_EPS = 1e-5
GROUPNORM_EPS_PER_CHANNEL = 1e-5  # ln_x eps is head_size * 1e-5 (64e-5 for N=64)
EXP_MINUS_HALF = 0.606531         # decay w = exp(-e^-0.5 * sigmoid(d)) lies in (0.545, 1)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# LoRA factors are stored [in, out] (used as x @ w1): transposed once at load.
LORAS = ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2")
MIXES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "k_k", "k_a", "a0", "v0")


@dataclass
class Block:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    # time mix
    x_r: torch.Tensor
    x_w: torch.Tensor
    x_k: torch.Tensor
    x_v: torch.Tensor
    x_a: torch.Tensor
    x_g: torch.Tensor
    w0: torch.Tensor      # fp32: the decay is computed in fp32
    a0: torch.Tensor
    v0: torch.Tensor | None
    k_k: torch.Tensor
    k_a: torch.Tensor
    r_k: torch.Tensor     # [H, N]
    w1: Linear
    w2: Linear
    a1: Linear
    a2: Linear
    v1: Linear | None
    v2: Linear | None
    g1: Linear
    g2: Linear
    receptance: Linear
    key: Linear
    value: Linear
    output: Linear
    lnx_w: torch.Tensor   # fp32 (group norm runs in fp32)
    lnx_b: torch.Tensor
    # channel mix
    ffn_x_k: torch.Tensor
    ffn_key: Linear
    ffn_value: Linear
    # the fused forward's side-by-side copies of some matrices (infer.ops.fused.BatchedWeights), set
    # by select_fused; the linears above then view into them, so no weight is stored twice
    batched: object | None = None


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str | None, device: str) -> torch.dtype:
    if name is None:
        return torch.float32 if torch.device(device).type == "cpu" else torch.float16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


class RWKV7:
    """Weights on one device plus ``forward`` over a :class:`PackedBatch` of state slots."""

    def __init__(self, config: ModelConfig, emb: torch.Tensor, blocks: list[Block], ln_out_w: torch.Tensor,
                 ln_out_b: torch.Tensor, head: Linear, wkv: WKV | None = None, source: str = "<memory>"):
        self.config = config
        self.emb = emb
        self.blocks = blocks
        self.ln_out_w = ln_out_w
        self.ln_out_b = ln_out_b
        self.head = head
        self.wkv: WKV = wkv or TorchWKV()
        self.fused: FusedKernels | None = None  # the fused CUDA forward, when infer.ops.fused.select_fused enables it
        self.source = source
        self.dtype = emb.dtype
        self.device = emb.device

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str, device: str | None = None, dtype: str | None = None,
             progress: bool = True, engine: str = "fp16") -> "RWKV7":
        """Load a checkpoint file (``.pth`` or ``.safetensors``, extension optional) for an inference
        engine (``infer.quant.engines``: fp16, cutlass or gemlite; each serves one checkpoint layout)."""
        src = open_checkpoint(path)
        return cls.from_source(src, device=device, dtype=dtype, progress=progress, engine=engine)

    @classmethod
    def from_state_dict(cls, tensors: dict[str, torch.Tensor], device: str | None = None,
                        dtype: str | None = None, engine: str = "fp16") -> "RWKV7":
        """Build from tensors in memory (the random-model generator, benchmarks); consumes the dict."""
        return cls.from_source(DictSource(tensors), device=device, dtype=dtype, progress=False, engine=engine)

    @classmethod
    def from_source(cls, src: TensorSource, device: str | None = None, dtype: str | None = None,
                    progress: bool = True, engine: str = "fp16") -> "RWKV7":
        device = device or default_device()
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
        act = resolve_dtype(dtype, device)
        config = infer_config(src)
        check_engine(weight_layout(src), engine, src.path)
        make_linear = linear_factory(engine, torch.device(device), act)
        started = time.monotonic()
        converted = _convert_all(src, config, device, act, progress)
        log.info("loaded %s (%s) in %.1fs: %s on %s, engine %s", src.path, config.describe(),
                 time.monotonic() - started, str(act).removeprefix("torch."), device, engine)
        return cls._assemble(config, converted, src.path, make_linear)

    @classmethod
    def _assemble(cls, config: ModelConfig, t: dict[str, torch.Tensor], source: str,
                  make_linear: LinearFactory) -> "RWKV7":
        emb = F.layer_norm(t.pop("emb.weight").float(), (config.n_embd,), t.pop("blocks.0.ln0.weight").float(),
                           t.pop("blocks.0.ln0.bias").float(), LN_EPS)
        act = t["ln_out.weight"].dtype
        blocks = []
        for i in range(config.n_layer):
            p = f"blocks.{i}."
            g = lambda name: t.pop(p + name)  # noqa: E731 - short accessor, used only here
            lin = lambda name: DenseLinear(t.pop(p + name))  # noqa: E731 - the small LoRA factors
            proj = lambda name: make_linear(p + name, t)  # noqa: E731 - the big matrices: the engine's linear
            has_v = i > 0  # layer 0's value-residual gate is never used
            for name in ("att.v0", "att.v1", "att.v2"):
                if not has_v:
                    t.pop(p + name, None)
            blocks.append(Block(
                ln1_w=g("ln1.weight"), ln1_b=g("ln1.bias"), ln2_w=g("ln2.weight"), ln2_b=g("ln2.bias"),
                x_r=g("att.x_r"), x_w=g("att.x_w"), x_k=g("att.x_k"), x_v=g("att.x_v"), x_a=g("att.x_a"),
                x_g=g("att.x_g"), w0=g("att.w0").float(), a0=g("att.a0"), v0=g("att.v0") if has_v else None,
                k_k=g("att.k_k"), k_a=g("att.k_a"), r_k=g("att.r_k").float().view(config.n_head, config.head_size),
                w1=lin("att.w1"), w2=lin("att.w2"), a1=lin("att.a1"), a2=lin("att.a2"),
                v1=lin("att.v1") if has_v else None, v2=lin("att.v2") if has_v else None,
                g1=lin("att.g1"), g2=lin("att.g2"),
                receptance=proj("att.receptance.weight"), key=proj("att.key.weight"),
                value=proj("att.value.weight"), output=proj("att.output.weight"),
                lnx_w=g("att.ln_x.weight").float(), lnx_b=g("att.ln_x.bias").float(),
                ffn_x_k=g("ffn.x_k"), ffn_key=proj("ffn.key.weight"), ffn_value=proj("ffn.value.weight"),
            ))
        return cls(config, emb.to(act), blocks, t.pop("ln_out.weight"), t.pop("ln_out.bias"),
                   make_linear("head.weight", t), source=source)

    def projections(self) -> list[Linear]:
        """The big matrices: the head and six per block (the layers an inference engine swaps)."""
        return [self.head] + [lin for b in self.blocks for lin in (b.receptance, b.key, b.value, b.output,
                                                                   b.ffn_key, b.ffn_value)]

    def implementations(self) -> dict[str, str]:
        """Which implementation each swappable part uses (logged at startup, checked by tests)."""
        kinds = sorted({lin.kind for lin in self.projections()[1:]})
        return {"forward": self.fused.name if self.fused else "readable (per-op)", "wkv": self.wkv.name, "linear": ", ".join(kinds), "head": self.head.kind,
                "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch.")}

    def new_state_pool(self, num_slots: int, wkv_dtype: torch.dtype = torch.float32) -> StatePool:
        return StatePool(self.config, num_slots, self.device, self.dtype, wkv_dtype)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, batch: PackedBatch, state: StatePool, all_logits: bool = False) -> torch.Tensor:
        """Run every row's tokens from its slot's state; update the slots in place.

        Returns fp32 logits of each row's last token ``[B, V]``, or of every token ``[T, V]``
        (packed order) when ``all_logits``. Runs the fused CUDA kernels when they are enabled
        (``infer.ops.fused``), else the readable code below; both compute the same math.
        """
        if self.fused is not None:
            return self.fused.forward(self, batch, state, all_logits)
        return self.forward_reference(batch, state, all_logits)

    @torch.inference_mode()
    def forward_reference(self, batch: PackedBatch, state: StatePool, all_logits: bool = False) -> torch.Tensor:
        """The readable forward: one torch op per step of the math (WKV and linears swappable)."""
        x = self.emb[batch.tokens]
        v_first: torch.Tensor | None = None
        for i, blk in enumerate(self.blocks):
            xin = F.layer_norm(x, (self.config.n_embd,), blk.ln1_w, blk.ln1_b, LN_EPS)
            dx, v_first_out = self._time_mix(i, blk, xin, batch, state, v_first)
            x = x + dx
            v_first = v_first_out
            if i == len(self.blocks) - 1 and not all_logits and (tail := batch.readout_tail()) is not None:
                batch, positions = tail  # only each row's last token is read out
                x = x[positions]
            xin = F.layer_norm(x, (self.config.n_embd,), blk.ln2_w, blk.ln2_b, LN_EPS)
            x = x + self._channel_mix(i, blk, xin, batch, state)
        if not all_logits:
            x = x[batch.last]
        x = F.layer_norm(x, (self.config.n_embd,), self.ln_out_w, self.ln_out_b, LN_EPS)
        return self.head(x).float()

    def _time_mix(self, layer: int, blk: Block, xin: torch.Tensor, batch: PackedBatch, state: StatePool,
                  v_first: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        T, C = xin.shape
        H, N = self.config.n_head, self.config.head_size
        dx = _token_shift(xin, state.att_shift[layer], batch) - xin
        xr, xw, xk = xin + dx * blk.x_r, xin + dx * blk.x_w, xin + dx * blk.x_k
        xv, xa, xg = xin + dx * blk.x_v, xin + dx * blk.x_a, xin + dx * blk.x_g

        r, k, v = blk.receptance(xr), blk.key(xk), blk.value(xv)
        d = blk.w0 + blk.w2(torch.tanh(blk.w1(xw))).float()
        w = torch.exp(-EXP_MINUS_HALF * torch.sigmoid(d))                  # fp32 decay
        a = torch.sigmoid(blk.a0 + blk.a2(blk.a1(xa)))                     # in-context learning rate
        g = blk.g2(torch.sigmoid(blk.g1(xg)))                              # output gate

        kk = F.normalize((k * blk.k_k).view(T, H, N), dim=-1, p=2.0, eps=1e-12).view(T, C)
        k = k * (1 + (a - 1) * blk.k_a)                                    # kk above uses the original k
        if layer == 0:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(blk.v0 + blk.v2(blk.v1(xv)))

        y = self.wkv(state.wkv[layer], batch, r, w, k, v, -kk, kk * a)     # fp32 [T, C]
        y = F.group_norm(y, H, blk.lnx_w, blk.lnx_b, eps=GROUPNORM_EPS_PER_CHANNEL * N)
        bonus = (r.float() * k.float() * blk.r_k.view(C)).view(T, H, N).sum(-1, keepdim=True)
        y = y + (bonus * v.float().view(T, H, N)).view(T, C)
        return blk.output(y.to(xin.dtype) * g), v_first

    def _channel_mix(self, layer: int, blk: Block, xin: torch.Tensor, batch: PackedBatch,
                     state: StatePool) -> torch.Tensor:
        kf = xin + (_token_shift(xin, state.ffn_shift[layer], batch) - xin) * blk.ffn_x_k
        return blk.ffn_value(torch.relu(blk.ffn_key(kf)) ** 2)

    # ------------------------------------------------------------------ conveniences
    def prefill(self, rows: Sequence[Sequence[int]], slots: Sequence[int], state: StatePool,
                chunk_size: int | None = None, all_logits: bool = False) -> torch.Tensor:
        """Feed whole prompts, optionally ``chunk_size`` tokens of each row per forward call.

        Returns ``[B, V]`` last-token logits, or ``[sum(len), V]`` (rows concatenated) with
        ``all_logits``. Chunking changes only how much work one call does, not the result.
        """
        if chunk_size is None:
            chunk_size = max(len(r) for r in rows)
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        per_row: list[list[torch.Tensor]] = [[] for _ in rows]
        last = [None] * len(rows)
        for begin in range(0, max(len(r) for r in rows), chunk_size):
            active = [i for i, r in enumerate(rows) if len(r) > begin]
            batch = PackedBatch.from_rows([rows[i][begin:begin + chunk_size] for i in active],
                                          [slots[i] for i in active], self.device)
            logits = self.forward(batch, state, all_logits=all_logits)
            if all_logits:
                for j, part in enumerate(torch.split(logits, batch.lens)):
                    per_row[active[j]].append(part)
            else:
                for j, i in enumerate(active):
                    last[i] = logits[j]
        if all_logits:
            return torch.cat([torch.cat(parts) for parts in per_row])
        return torch.stack(last)

    def decode(self, tokens: Sequence[int], slots: Sequence[int], state: StatePool) -> torch.Tensor:
        """One token per row; returns ``[B, V]`` logits."""
        return self.forward(PackedBatch.from_rows([[t] for t in tokens], slots, self.device), state)


def _token_shift(xin: torch.Tensor, shift_state: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Previous token's normalised input per position (the slot's saved one for each row's first
    token); saves each row's last input back into its slot."""
    prev = torch.empty_like(xin)
    prev[1:] = xin[:-1]
    prev[batch.starts] = shift_state[batch.slots]
    shift_state[batch.slots] = xin[batch.last]
    return prev


def _convert_all(src: TensorSource, config: ModelConfig, device: str, act: torch.dtype,
                 progress: bool) -> dict[str, torch.Tensor]:
    """Convert every tensor to its runtime form one at a time (at most one extra tensor in host
    memory), with a progress bar when loading takes more than a moment."""
    keys = src.keys()
    bar: Callable[[object], object] = lambda it: it  # noqa: E731
    if progress:
        from tqdm import tqdm
        bar = lambda it: tqdm(it, total=len(keys), desc="loading weights", unit="tensor", delay=1.0)  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    for key, tensor in bar(iter_tensors(src, keys)):
        out[key] = _runtime_tensor(key, tensor, config, device, act)
    return out


def _runtime_tensor(key: str, tensor: torch.Tensor, config: ModelConfig, device: str,
                    act: torch.dtype) -> torch.Tensor:
    name = key.split(".", 2)[-1] if key.startswith("blocks.") else key
    if key == "emb.weight" or key.startswith("blocks.0.ln0"):
        return tensor.to(device=device, dtype=torch.float32)  # ln0 is folded into emb in fp32
    if name.startswith("att.") and name[4:] in LORAS:
        return tensor.to(device=device, dtype=act).t().contiguous()
    if name in PROJECTIONS or key == "head.weight":  # int8 (W8A16) matrices keep their dtype
        return tensor.to(device=device, dtype=act if tensor.is_floating_point() else None).contiguous()
    if key.endswith(SCALE_SUFFIX):
        return tensor.to(device=device, dtype=act)        # W8A16 per-channel scales
    if GEMLITE_INFIX in key:
        return tensor.to(device=device)                   # packed GemLite entries, as GemLite stored them
    if key.startswith("__") and key.endswith("__"):
        return tensor                                     # layout markers: read by validation only
    if key.endswith("att.r_k"):
        return tensor.to(device=device, dtype=act).reshape(-1)
    if tensor.ndim > 1 and tensor.numel() == tensor.shape[-1]:
        tensor = tensor.reshape(-1)  # [1,1,C] mixing vectors
    if name.startswith("att.") and name[4:] in MIXES + ("w0",) or name in ("ffn.x_k",) or "ln" in name:
        return tensor.to(device=device, dtype=act)
    raise CheckpointError(f"{key}: no conversion rule (unexpected key)")
