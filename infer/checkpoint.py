"""Reading BlinkDL RWKV-7 "x070" checkpoints: file formats, validation, model shape.

A checkpoint is a flat ``{name: tensor}`` dict (``.pth`` written by ``torch.save`` or
``.safetensors`` with the same names). Everything here is found by key name and tensor
shape, never by key order, because the order differs between official releases.
Tensors are opened lazily (mmap / safetensors) so loading never holds a second full copy
of the weights in host memory.
"""
from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

SUPPORTED_HEAD_SIZE = 64
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)
# The projection matrices of a block, stored as nn.Linear [out, in]; with the head they are the
# matrices a quantized checkpoint stores quantized.
PROJECTIONS = ("att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight",
               "ffn.key.weight", "ffn.value.weight")

# Weight layouts. The export tools (infer/quant) write 0-d int32 marker tensors that name the layout;
# W8A16 files exported by rwkv_lightning carry no marker and are recognised by their head's scale.
LAYOUT_FLOAT, LAYOUT_W8A16, LAYOUT_GEMLITE = "float", "w8a16", "gemlite"
# W8A16: the matrix as int8 [out, in] (symmetric per output channel) plus name + ".scale", fp16 [out].
W8A16_MARKER, W8A16_VERSION = "__w8a16_version__", 1
SCALE_SUFFIX = ".scale"
# GemLite 0.6.x packed layers: every entry of a GemLiteLinearTriton state dict as "<matrix>.gemlite.<entry>".
GEMLITE_FORMAT_KEY = "__gemlite_format__"          # a GEMLITE_FORMATS code
GEMLITE_GROUP_SIZE_KEY = "__gemlite_group_size__"  # the group size for W4, else 0
GEMLITE_VERSION_KEY, GEMLITE_VERSION = "__gemlite_checkpoint_version__", 2
GEMLITE_FORMATS = {"A16W8_FP8": 0, "A16W8_INT8": 1, "A16W4_HQQ_INT": 2}
GEMLITE_INFIX = ".gemlite."
GEMLITE_ENTRIES = ("W_q", "scales", "metadata", "orig_shape")
GEMLITE_OPTIONAL_ENTRIES = ("zeros", "meta_scale")  # written only by some 0.6.x releases / formats


class CheckpointError(ValueError):
    """A checkpoint could not be used; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of an RWKV-7 model, read from the tensor shapes of a checkpoint."""

    n_layer: int
    n_embd: int
    n_head: int
    head_size: int
    vocab_size: int
    ffn_dim: int
    rank_w: int  # decay LoRA
    rank_a: int  # in-context learning-rate LoRA
    rank_v: int  # value-residual LoRA
    rank_g: int  # output-gate LoRA

    def describe(self) -> str:
        return (f"L{self.n_layer} C{self.n_embd} H{self.n_head}x{self.head_size} V{self.vocab_size} "
                f"F{self.ffn_dim} lora w{self.rank_w}/a{self.rank_a}/v{self.rank_v}/g{self.rank_g}")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every key of a plain x070 checkpoint with its stored shape (layer-0 v0/v1/v2 optional)."""
        C, V, F, H, N = self.n_embd, self.vocab_size, self.ffn_dim, self.n_head, self.head_size
        vec = (1, 1, C)
        shapes: dict[str, tuple[int, ...]] = {
            "emb.weight": (V, C),
            "blocks.0.ln0.weight": (C,), "blocks.0.ln0.bias": (C,),
            "ln_out.weight": (C,), "ln_out.bias": (C,),
            "head.weight": (V, C),
        }
        for i in range(self.n_layer):
            b = f"blocks.{i}."
            for ln in ("ln1", "ln2"):
                shapes[f"{b}{ln}.weight"] = (C,)
                shapes[f"{b}{ln}.bias"] = (C,)
            a = b + "att."
            for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"):
                shapes[a + name] = vec
            shapes[a + "w1"], shapes[a + "w2"] = (C, self.rank_w), (self.rank_w, C)
            shapes[a + "a1"], shapes[a + "a2"] = (C, self.rank_a), (self.rank_a, C)
            shapes[a + "v1"], shapes[a + "v2"] = (C, self.rank_v), (self.rank_v, C)
            shapes[a + "g1"], shapes[a + "g2"] = (C, self.rank_g), (self.rank_g, C)
            shapes[a + "r_k"] = (H, N)
            for proj in ("receptance", "key", "value", "output"):
                shapes[f"{a}{proj}.weight"] = (C, C)
            shapes[a + "ln_x.weight"], shapes[a + "ln_x.bias"] = (C,), (C,)
            shapes[b + "ffn.x_k"] = vec
            shapes[b + "ffn.key.weight"] = (F, C)
            shapes[b + "ffn.value.weight"] = (C, F)
        return shapes

    def linear_keys(self) -> list[str]:
        """The matrices a quantized checkpoint stores quantized: the head and six per block."""
        return ["head.weight"] + [f"blocks.{i}.{p}" for i in range(self.n_layer) for p in PROJECTIONS]


OPTIONAL_KEYS = frozenset({"blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"})


class TensorSource(Protocol):
    """Lazy read access to the tensors of one checkpoint file."""

    path: str

    def keys(self) -> list[str]: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def dtype(self, key: str) -> torch.dtype: ...
    def get(self, key: str) -> torch.Tensor: ...
    def first_row(self, key: str) -> torch.Tensor: ...  # tensor[:1], without reading the rest
    def release(self, key: str) -> None: ...


class DictSource:
    """A checkpoint already in memory (``.pth`` via mmap, or tensors made by the random-model script)."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: str = "<memory>"):
        self.path = path
        self._tensors = tensors

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def get(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def first_row(self, key: str) -> torch.Tensor:
        return self._tensors[key][:1]

    def release(self, key: str) -> None:
        # Drop our reference so a converted tensor's source can be freed as loading proceeds.
        self._tensors.pop(key, None)


class SafetensorsSource:
    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
            self._keys = list(self._file.keys())
            self._meta = {k: self._file.get_slice(k) for k in self._keys}
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable .safetensors file ({e})") from None

    def keys(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._meta[key].get_shape())

    def dtype(self, key: str) -> torch.dtype:
        names = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                 "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32,
                 "I64": torch.int64}
        return names.get(self._meta[key].get_dtype(), torch.uint8)

    def get(self, key: str) -> torch.Tensor:
        return self._file.get_tensor(key)

    def first_row(self, key: str) -> torch.Tensor:
        return self._meta[key][0:1]

    def release(self, key: str) -> None:
        pass


def resolve_path(path: str) -> str:
    """Accept the path with or without its ``.pth`` / ``.safetensors`` extension."""
    candidates = [path, path + ".pth", path + ".safetensors"]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a directory; give the path of a .pth or .safetensors file")
    raise CheckpointError(f"checkpoint not found: tried {', '.join(candidates)}")


def open_checkpoint(path: str) -> TensorSource:
    """Open a checkpoint lazily; raises CheckpointError with a clear message for bad files."""
    path = resolve_path(path)
    with open(path, "rb") as f:
        head = f.read(9)
    # safetensors: 8-byte little-endian header length, then a JSON header.
    if path.endswith(".safetensors") or (not zipfile.is_zipfile(path) and head[8:9] == b"{"):
        return SafetensorsSource(path)
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as first_error:
        try:  # legacy (non-zip) torch.save files cannot be memory-mapped
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:
            raise CheckpointError(f"{path}: not a PyTorch checkpoint ({first_error.__class__.__name__}: "
                                  f"{str(first_error).splitlines()[0][:200]})") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: not a checkpoint: expected a dict of tensor names to tensors, "
                              f"got {type(obj).__name__}")
    return DictSource(obj, path)


def _reject_other_variants(src: TensorSource) -> None:
    keys = src.keys()
    path = src.path

    def having(pattern: str) -> list[str]:
        rx = re.compile(pattern)
        return [k for k in keys if rx.search(k)]

    if found := having(r"^model\.layers\.|^model\.embeddings|\.attn\.(r_proj|k_proj|w_lora)"):
        raise CheckpointError(f"{path}: Hugging Face / flash-linear-attention RWKV-7 layout (e.g. {found[0]!r}) "
                              "is not supported; use the original BlinkDL .pth checkpoint")
    if found := having(r"\.att\.x_x$|\.attn\.x_x$"):
        raise CheckpointError(f"{path}: legacy fused token-shift key {found[0]!r} (pre-release RWKV-7 layout) "
                              "is not supported")
    if found := having(r"\.ffn\.(s_emb|s_emb_x|s0|s1|s2)(\.|$)"):
        raise CheckpointError(f"{path}: DeepEmbed RWKV-7 variant (\"v7a\", key {found[0]!r}) is not supported; "
                              "only plain x070 checkpoints are")
    if found := having(r"\.att\.(time_decay|time_first|time_mix_|time_maa)"):
        raise CheckpointError(f"{path}: this is an RWKV-4/5/6 checkpoint (key {found[0]!r}); only RWKV-7 x070 "
                              "is supported")
    if "emb.weight" not in keys and "blocks.0.att.r_k" not in keys:
        raise CheckpointError(f"{path}: not an RWKV-7 checkpoint (no 'emb.weight' or 'blocks.0.att.r_k'; "
                              f"first keys: {keys[:5]})")


def weight_layout(src: TensorSource) -> str:
    """How the checkpoint stores its matrices: LAYOUT_FLOAT, LAYOUT_W8A16 or LAYOUT_GEMLITE."""
    keys = set(src.keys())
    if GEMLITE_FORMAT_KEY in keys:
        return LAYOUT_GEMLITE
    if W8A16_MARKER in keys or "head.weight" + SCALE_SUFFIX in keys:
        return LAYOUT_W8A16
    return LAYOUT_FLOAT


def _matrix_shape(src: TensorSource, name: str, layout: str) -> tuple[int, ...]:
    """The [out, in] of a projection matrix; a packed GemLite layer records it in its orig_shape entry."""
    if layout == LAYOUT_GEMLITE:
        return tuple(int(d) for d in src.get(name + GEMLITE_INFIX + "orig_shape").tolist())
    return src.shape(name)


def infer_config(src: TensorSource) -> ModelConfig:
    """Read the model shape from tensor shapes and check every key against it (in any weight layout)."""
    _reject_other_variants(src)
    path = src.path
    keys = set(src.keys())
    layout = weight_layout(src)
    ffn_key = "blocks.0.ffn.key.weight" + (GEMLITE_INFIX + "orig_shape" if layout == LAYOUT_GEMLITE else "")
    for key in ("emb.weight", "blocks.0.att.r_k", "blocks.0.att.w1", "blocks.0.att.a1", "blocks.0.att.g1", ffn_key):
        if key not in keys:
            raise CheckpointError(f"{path}: missing key {key!r}")
    emb = src.shape("emb.weight")
    r_k = src.shape("blocks.0.att.r_k")
    if len(emb) != 2 or len(r_k) != 2:
        raise CheckpointError(f"{path}: misshapen key(s): 'emb.weight' {emb} (want [V, C]), "
                              f"'blocks.0.att.r_k' {r_k} (want [H, 64])")
    vocab, n_embd = emb
    n_head, head_size = r_k
    if head_size != SUPPORTED_HEAD_SIZE:
        raise CheckpointError(f"{path}: head size {head_size} is not supported (only {SUPPORTED_HEAD_SIZE}); "
                              f"'blocks.0.att.r_k' has shape {r_k}")
    if n_head * head_size != n_embd:
        raise CheckpointError(f"{path}: 'blocks.0.att.r_k' {r_k} does not match the width {n_embd} of "
                              "'emb.weight'")
    block_ids = {int(m.group(1)) for k in keys if (m := re.match(r"blocks\.(\d+)\.", k))}
    n_layer = max(block_ids) + 1 if block_ids else 0
    v1 = "blocks.1.att.v1" if "blocks.1.att.v1" in keys else "blocks.0.att.v1"
    rank_v = src.shape(v1)[-1] if v1 in keys else src.shape("blocks.0.att.a1")[-1]
    config = ModelConfig(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, head_size=head_size, vocab_size=vocab,
        ffn_dim=_matrix_shape(src, "blocks.0.ffn.key.weight", layout)[0],
        rank_w=src.shape("blocks.0.att.w1")[-1], rank_a=src.shape("blocks.0.att.a1")[-1],
        rank_v=rank_v, rank_g=src.shape("blocks.0.att.g1")[-1],
    )
    specs = _expected_tensors(config, layout)
    present = [(k, spec) for k, spec in specs.items() if k in keys]
    missing = [k for k, spec in specs.items() if k not in keys and not spec.optional]
    misshapen = [f"{k} {list(src.shape(k))} (want {list(spec.shape)})" for k, spec in present
                 if spec.shape is not None and _squeezed(src.shape(k)) != _squeezed(spec.shape)]
    unexpected = sorted(keys - set(specs))
    non_float = [f"{k} ({src.dtype(k)})" for k, spec in present
                 if spec.dtypes == FLOAT_DTYPES and src.dtype(k) not in FLOAT_DTYPES]
    wrong_dtype = [f"{k} ({src.dtype(k)}, want {'/'.join(str(d).removeprefix('torch.') for d in spec.dtypes)})"
                   for k, spec in present
                   if spec.dtypes not in (None, FLOAT_DTYPES) and src.dtype(k) not in spec.dtypes]
    problems = []
    if missing:
        problems.append(f"missing key(s): {_names(missing)}")
    if misshapen:
        problems.append(f"misshapen key(s): {_names(misshapen)}")
    if unexpected:
        kind = "plain RWKV-7 x070" if layout == LAYOUT_FLOAT else f"an RWKV-7 x070 checkpoint in the {layout} layout"
        problems.append(f"unexpected key(s) (not {kind}): {_names(unexpected)}")
    if non_float:
        problems.append(f"non-float tensor(s): {_names(non_float)} (accepted: fp16, bf16, fp32)")
    if wrong_dtype:
        problems.append(f"tensor(s) of the wrong dtype: {_names(wrong_dtype)}")
    if not problems:  # values are read only from well-formed markers
        problems += _marker_problems(src, config, layout)
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    return config


@dataclass(frozen=True)
class _Expected:
    shape: tuple[int, ...] | None           # None: not checked (packed GemLite entries)
    dtypes: tuple[torch.dtype, ...] | None  # None: any
    optional: bool = False


def _expected_tensors(config: ModelConfig, layout: str) -> dict[str, _Expected]:
    """Every key a checkpoint of this shape and layout may hold."""
    specs = {k: _Expected(shape, FLOAT_DTYPES, k in OPTIONAL_KEYS) for k, shape in config.expected_shapes().items()}
    if layout == LAYOUT_W8A16:
        for name in config.linear_keys():
            out_in = specs[name].shape
            specs[name] = _Expected(out_in, (torch.int8,))
            specs[name + SCALE_SUFFIX] = _Expected(out_in[:1], FLOAT_DTYPES)
        specs[W8A16_MARKER] = _Expected((), INT_DTYPES, optional=True)  # absent in rwkv_lightning's exports
    elif layout == LAYOUT_GEMLITE:
        for name in config.linear_keys():
            del specs[name]
            for entry in GEMLITE_ENTRIES + GEMLITE_OPTIONAL_ENTRIES:
                specs[name + GEMLITE_INFIX + entry] = _Expected(None, None, entry in GEMLITE_OPTIONAL_ENTRIES)
            specs[name + GEMLITE_INFIX + "orig_shape"] = _Expected((2,), INT_DTYPES)
        for key in (GEMLITE_FORMAT_KEY, GEMLITE_GROUP_SIZE_KEY, GEMLITE_VERSION_KEY):
            specs[key] = _Expected((), INT_DTYPES)
    return specs


def _marker_problems(src: TensorSource, config: ModelConfig, layout: str) -> list[str]:
    """Checks on the values of a quantized checkpoint's markers and packed shapes."""
    keys = set(src.keys())
    problems = []
    if layout == LAYOUT_W8A16 and W8A16_MARKER in keys and (v := int(src.get(W8A16_MARKER))) != W8A16_VERSION:
        problems.append(f"W8A16 format version {v} (this server reads version {W8A16_VERSION})")
    if layout == LAYOUT_GEMLITE:
        if (v := int(src.get(GEMLITE_VERSION_KEY))) != GEMLITE_VERSION:
            problems.append(f"GemLite checkpoint version {v} (this server reads version {GEMLITE_VERSION}; "
                            "export it again with python -m infer.quant.export_quant_gemlite)")
        if (code := int(src.get(GEMLITE_FORMAT_KEY))) not in GEMLITE_FORMATS.values():
            problems.append(f"unknown GemLite format code {code} (known: "
                            + ", ".join(f"{c}={n}" for n, c in GEMLITE_FORMATS.items()) + ")")
        expected = config.expected_shapes()
        wrong = [f"{name} {list(got)} (want {list(expected[name])})" for name in config.linear_keys()
                 if (got := _matrix_shape(src, name, layout)) != expected[name]]
        if wrong:
            problems.append(f"packed matrix(es) of the wrong shape: {_names(wrong)}")
    return problems


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    # [1,1,C] vectors are stored with or without their leading unit dims by different tools.
    return tuple(d for d in shape if d != 1) or (1,)


def _names(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def iter_tensors(src: TensorSource, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield tensors one at a time, releasing the source's reference after each is consumed."""
    for key in keys:
        tensor = src.get(key)
        yield key, tensor
        src.release(key)
