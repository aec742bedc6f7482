"""A batch-1 decode step as one persistent CUDA kernel (``cuda/rwkv7_step.cu``): every block of a co-resident
grid walks every phase of every layer with a grid barrier between phases, instead of the fused path's ~8 launches a
layer. Opt-in with ``RWKV_PERSISTENT=1``: it runs at 0.56x the launches' speed on an H100 (docs/BENCHMARKS.md)
(``RWKV_PERSISTENT_BLOCKS``: blocks a multiprocessor, default 2; ``RWKV_PERSISTENT_PREFETCH=0``: no loads ahead of
the barriers). It takes fp16 dense weights (the FFN value K-major or row-major), fp32 or fp16 states, and steps of
one token of one row; the fused forward runs everything else.

This module builds what the kernel reads: the model's tensors as entries (data pointers, and each matrix's row
stride after its pointer) in the kernel's order (:data:`MODEL_ENTRIES`, :data:`LAYER_ENTRIES`), and the workspace
the step's intermediates live in. ``test/test_step_emulated.py`` runs the kernel on the CPU emulation from the same
entries.
"""
from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infer.batch import PackedBatch
from infer.ops.cuda_ext import BuildOnce, compile_kernels, env_flag, env_int
from infer.ops.linear import DenseLinear
from infer.state import StatePool

if TYPE_CHECKING:
    from infer.model import RWKV7

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent.parent
SOURCES = [ROOT / "cuda" / "rwkv7_step_op.cpp", ROOT / "cuda" / "rwkv7_step.cu"]

# The kernel's entry orders (cuda/rwkv7_step.cu: ModelEntry, LayerEntry). A matrix is followed by its row stride.
MODEL_ENTRIES = ("emb", "ln_out_w", "ln_out_b", "head", "head_ld", "att_shift", "ffn_shift", "wkv", "x", "lora_h",
                 "r", "k", "v", "dw", "da", "dv", "g", "v_first", "y", "hidden", "partial", "deps", "logits")
LAYER_VECTORS = ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "ffn_x_k", "a0", "v0",
                 "k_k", "k_a", "w0", "r_k", "lnx_w", "lnx_b")
LAYER_MATRICES = ("receptance", "key", "value", "output", "w1", "a1", "v1", "g1", "w2", "a2", "v2", "g2", "ffn_key",
                  "ffn_value")
LAYER_ENTRIES = LAYER_VECTORS + tuple(e for name in LAYER_MATRICES for e in (name, name + "_ld"))
MAX_WIDTH = 4096  # the folded layer norm holds x in registers (cuda/rwkv7_step.cu: kNormVecs)
DIMS = 12  # entries of step_dims
# the per-step vectors of the workspace, fp16 [C] unless listed
WORKSPACE_HALF = ("x", "r", "k", "v", "dw", "da", "dv", "g", "v_first", "y")


def _is_fp16_dense(lin) -> bool:
    return isinstance(lin, DenseLinear) and lin.weight.dtype == torch.float16


def _k_major(lin) -> bool:
    return hasattr(lin, "weight_t") and isinstance(lin, DenseLinear)


def unsupported(model: "RWKV7", state: StatePool) -> str | None:
    """Why the persistent step cannot run ``model`` on ``state`` (None if it can)."""
    cfg = model.config
    if model.dtype != torch.float16:
        return f"activations are {model.dtype}, the step kernel takes float16"
    if cfg.head_size != 64 or cfg.n_embd % 64 or cfg.n_embd > MAX_WIDTH:
        return (f"head size {cfg.head_size}, width {cfg.n_embd} (the kernel takes 64, and multiples of 64 up to "
                f"{MAX_WIDTH})")
    if any(r % 8 for r in (cfg.rank_w, cfg.rank_a, cfg.rank_v, cfg.rank_g)) or cfg.ffn_dim % 8:
        return "LoRA ranks and the FFN width must be multiples of 8"
    if state.wkv.dtype not in (torch.float32, torch.float16):
        return f"WKV states of {state.wkv.dtype}"
    for blk in model.blocks:
        linears = [getattr(blk, name) for name in LAYER_MATRICES if getattr(blk, name) is not None]
        if not all(_is_fp16_dense(lin) for lin in linears):
            return "a quantized or non-fp16 matrix (the step kernel takes fp16 dense weights)"
    if not _is_fp16_dense(model.head):
        return "a quantized head"
    return None


def _matrix(lin) -> tuple[int, int]:
    """(data pointer, row stride) of a linear's weights as the kernel reads them: [out, in] rows, or a K-major FFN
    value's [in, out] rows."""
    w = lin.weight_t if _k_major(lin) else lin.weight
    if w.stride(-1) != 1:
        raise ValueError("the step kernel reads weights with contiguous rows")
    return w.data_ptr(), w.stride(0)


class Workspace:
    """The step's intermediates on the model's device: fp16 vectors (:data:`WORKSPACE_HALF`, the LoRA first
    halves ``lora_h``, the FFN ``hidden``), the sparse FFN value's fp32 partial sums, fp32 ``logits``, the grid
    barrier's two counters ``sync`` and the merged phases' counters ``deps`` (both zero between steps).
    ``partial_floats``, ``deps``: the kernel's ``workspace(dims, 0 / 1)``."""

    def __init__(self, model: "RWKV7", partial_floats: int, deps: int):
        cfg, dev = model.config, model.emb.device
        C = cfg.n_embd
        for name in WORKSPACE_HALF:
            setattr(self, name, torch.zeros(C, dtype=torch.float16, device=dev))
        self.lora_h = torch.zeros(cfg.rank_w + cfg.rank_a + cfg.rank_v + cfg.rank_g, dtype=torch.float16, device=dev)
        self.hidden = torch.zeros(cfg.ffn_dim, dtype=torch.float16, device=dev)
        self.partial = torch.zeros(max(partial_floats, 1), dtype=torch.float32, device=dev)
        self.logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=dev)
        self.sync = torch.zeros(2, dtype=torch.int32, device=dev)
        self.deps = torch.zeros(max(deps, 1), dtype=torch.int32, device=dev)


def step_dims(model: "RWKV7", state: StatePool, merge: bool = True) -> torch.Tensor:
    """The kernel's dims: L, C, F, V, the four LoRA ranks, FFN value K-major, fp16 state, slots, merged phases (int64,
    CPU). ``merge``: the LoRA second halves and the sparse FFN value wait on counters inside the phases before them
    instead of a grid barrier each (cuda/rwkv7_step.cu: build_program)."""
    cfg = model.config
    return torch.tensor([cfg.n_layer, cfg.n_embd, cfg.ffn_dim, cfg.vocab_size, cfg.rank_w, cfg.rank_a, cfg.rank_v,
                         cfg.rank_g, int(_k_major(model.blocks[0].ffn_value)),
                         int(state.wkv.dtype == torch.float16), state.wkv.shape[1], int(merge)], dtype=torch.int64)


def step_entries(model: "RWKV7", state: StatePool, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """The model entries [len(MODEL_ENTRIES)] and layer entries [L, len(LAYER_ENTRIES)] (int64, CPU) of ``model``
    stepping on ``state`` with workspace ``ws``."""
    if len({_k_major(b.ffn_value) for b in model.blocks}) != 1:
        raise ValueError("every layer's FFN value must have the same layout")
    head, head_ld = _matrix(model.head)
    model_values = {"emb": model.emb.data_ptr(), "ln_out_w": model.ln_out_w.data_ptr(),
                    "ln_out_b": model.ln_out_b.data_ptr(), "head": head, "head_ld": head_ld,
                    "att_shift": state.att_shift.data_ptr(), "ffn_shift": state.ffn_shift.data_ptr(),
                    "wkv": state.wkv.data_ptr(), "lora_h": ws.lora_h.data_ptr(), "hidden": ws.hidden.data_ptr(),
                    "partial": ws.partial.data_ptr(), "deps": ws.deps.data_ptr(), "logits": ws.logits.data_ptr()}
    model_values.update({name: getattr(ws, name).data_ptr() for name in WORKSPACE_HALF})
    layers = []
    for blk in model.blocks:
        row = {name: (getattr(blk, name).data_ptr() if getattr(blk, name) is not None else 0)
               for name in LAYER_VECTORS}
        for name in LAYER_MATRICES:
            lin = getattr(blk, name)
            row[name], row[name + "_ld"] = _matrix(lin) if lin is not None else (0, 0)
        layers.append([row[name] for name in LAYER_ENTRIES])
    return (torch.tensor([model_values[name] for name in MODEL_ENTRIES], dtype=torch.int64),
            torch.tensor(layers, dtype=torch.int64))


def phase_names(dims: torch.Tensor) -> list[str]:
    """The names of a step's phases in the kernel's order (cuda/rwkv7_step.cu: build_program) for ``dims``
    (:func:`step_dims`): the rows of :meth:`PersistentStep.timeline`."""
    n_layer, k_major, merge = int(dims[0]), bool(dims[8]), bool(dims[11])
    layer = ["rkv+lora"] if merge else ["rkv", "lora"]
    layer += ["time mix", "output"]
    if k_major:
        layer += ["ffn key+value", "reduce"] if merge else ["ffn key", "ffn value", "reduce"]
    else:
        layer += ["ffn key", "ffn value"]
    return ["embed"] + layer * n_layer + ["head"]


class PersistentStep:
    """The compiled kernel and, per state pool, the step's program and workspace on the device."""

    name = "persistent batch-1 step (rwkv7_step)"

    def __init__(self, module) -> None:
        self._m = module
        if (self._m.entries(0), self._m.entries(1), self._m.entries(2)) != (len(MODEL_ENTRIES), len(LAYER_ENTRIES),
                                                                            DIMS):
            raise RuntimeError("cuda/rwkv7_step.cu's entries differ from infer/ops/persistent.py's")
        self.blocks_per_sm = env_int("RWKV_PERSISTENT_BLOCKS", 2)
        self.prefetch = env_flag("RWKV_PERSISTENT_PREFETCH", True)
        self.merge = env_flag("RWKV_PERSISTENT_MERGE", True)
        # model -> {state pool's tensors: (program, dims, workspace) or None}; a plan lives as long as its model (its
        # program holds the model's addresses)
        self._plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._no_timeline = torch.empty(0, dtype=torch.int64)

    def covers(self, model: "RWKV7", batch: PackedBatch, state: StatePool) -> bool:
        return batch.num_tokens == 1 and self._plan(model, state) is not None

    def _plan(self, model: "RWKV7", state: StatePool):
        plans = self._plans.setdefault(model, {})
        key = tuple((t.data_ptr(), t.shape, t.dtype) for t in (state.wkv, state.att_shift, state.ffn_shift))
        if key not in plans:
            reason = unsupported(model, state)
            if reason is not None:
                log.info("persistent step not used: %s", reason)
                plans[key] = None
            else:
                dims = step_dims(model, state, self.merge)
                ws = Workspace(model, self._m.workspace(dims, 0), self._m.workspace(dims, 1))
                program = self._m.build(dims, *step_entries(model, state, ws)).to(model.emb.device)
                plans[key] = (program, dims, ws)
        return plans[key]

    def logits(self, model: "RWKV7", batch: PackedBatch, state: StatePool) -> torch.Tensor:
        """[1, V] fp32 logits of the batch's one token; the slot's state is updated in place."""
        return self._launch(model, batch, state, self._no_timeline).logits.view(1, -1).clone()

    def timeline(self, model: "RWKV7", batch: PackedBatch, state: StatePool, blocks: int) -> torch.Tensor:
        """One step as :meth:`logits` (the slot's state is updated), returning when each block started and ended each
        phase: int64 [phases, 2, blocks] (ns of the device's global timer; rows named by :func:`phase_names`,
        columns of blocks past the grid -1). ``blocks``: at least the grid's (multiprocessors x blocks a
        multiprocessor)."""
        dims = self._plan(model, state)[1]
        out = torch.full((len(phase_names(dims)), 2, blocks), -1, dtype=torch.int64, device=model.emb.device)
        self._launch(model, batch, state, out)
        return out

    def _launch(self, model: "RWKV7", batch: PackedBatch, state: StatePool, timeline: torch.Tensor) -> Workspace:
        """One step of the plan for ``model`` on ``state``; returns the plan's workspace (its logits)."""
        program, dims, ws = self._plan(model, state)
        device = model.emb.device
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0  # 0: the emulation's
        self._m.launch(program, dims, batch.tokens, batch.slots, model.emb, ws.x, ws.logits, ws.sync, ws.deps,
                       int(self.prefetch), self.blocks_per_sm, timeline, stream)
        return ws


_step: BuildOnce[PersistentStep] = BuildOnce("persistent step kernel")


def self_test(step: PersistentStep, device: torch.device | None = None) -> str | None:
    """A tiny random model stepped by the kernel (its FFN value row-major, then K-major) against the readable forward
    on the same device (default: the current GPU): a reason string if they disagree beyond fp16 rounding (the fused
    launches then run instead)."""
    from infer.model import RWKV7
    from infer.ops.fused import KMajorLinear
    from infer.random_model import make_config, random_state_dict
    device = device or torch.device("cuda", torch.cuda.current_device())
    model = RWKV7.from_state_dict(random_state_dict(make_config(2, 128, 512), seed=2, dtype=torch.float16,
                                                    device=str(device)), device=str(device), dtype="fp16")
    worst = 0.0
    for k_major in (False, True):
        if k_major:
            for blk in model.blocks:
                blk.ffn_value = KMajorLinear(blk.ffn_value.weight, (None, None))
        pools = [model.new_state_pool(2) for _ in range(2)]
        for token in (5, 300, 17):
            expect = model.forward_reference(PackedBatch.from_rows([[token]], [1], device), pools[0])
            got = step.logits(model, PackedBatch.from_rows([[token]], [1], device), pools[1])
            scale = float(expect.abs().max()) + 1.0
            worst = max(worst, float((got - expect).abs().max()) / scale,
                        float((pools[0].wkv - pools[1].wkv).abs().max()))
    return None if worst <= 0.05 else f"self-test against the readable forward failed (relative max |diff| {worst:.3g})"


def load_persistent_step() -> PersistentStep | None:
    """The compiled and self-tested kernel when ``RWKV_PERSISTENT=1`` on a CUDA build of torch (None otherwise, or
    when it fails to build or its self-test: the fused launches run instead)."""
    if not env_flag("RWKV_PERSISTENT", False) or torch.version.hip is not None:
        return None
    return _step.load(lambda: PersistentStep(compile_kernels("rwkv7_step", SOURCES, SOURCES, "the persistent step")),
                      self_test)
