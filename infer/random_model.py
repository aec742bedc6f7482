"""Random RWKV-7 checkpoints of any shape, for tests, benchmarks and the built-in demo model.

The weights imitate the value ranges of trained models rather than the RWKV-LM training
init: that init zeroes the output projections, so earlier tokens would not change the
logits and a broken state path would go unnoticed. Here every path carries signal.

    python -m infer.random_model OUT.pth --n-layer 12 --n-embd 768 [--vocab 65536] [--seed 0]
    python -m infer.random_model /tmp/rwkv7-7.2b-random-fp16.pth --n-layer 32 --n-embd 4096 --dtype fp16 --device cuda

``--device cuda`` draws the numbers on the GPU (seconds for a 7B shape instead of minutes on the
CPU; a different random stream than the CPU's for the same seed).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

import torch

from infer.checkpoint import ModelConfig

log = logging.getLogger(__name__)

DEMO_SHAPE = {"n_layer": 4, "n_embd": 256, "vocab_size": 65536}
DEMO_SEED = 20261130


def lora_rank(n_embd: int, factor: float) -> int:
    """The trainer's default LoRA rank: max(32, round(factor * sqrt(C) / 32) * 32)."""
    return max(32, round(factor * math.sqrt(n_embd) / 32) * 32)


# LoRA ranks (w, a, v, g) of the released models, which differ from the trainer's formula at
# some widths (performance-limits.md Table L1).
RELEASED_LORA_RANKS = {768: (64, 64, 32, 128), 1024: (64, 64, 32, 160), 2048: (96, 96, 64, 256),
                       2560: (96, 96, 64, 320), 4096: (128, 128, 96, 480)}


def make_config(n_layer: int, n_embd: int, vocab_size: int = 65536, head_size: int = 64) -> ModelConfig:
    ranks = RELEASED_LORA_RANKS.get(n_embd) or tuple(lora_rank(n_embd, f) for f in (2.5, 2.5, 1.7, 5))
    return ModelConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_embd // head_size, head_size=head_size,
                       vocab_size=vocab_size, ffn_dim=4 * n_embd, rank_w=ranks[0], rank_a=ranks[1],
                       rank_v=ranks[2], rank_g=ranks[3])


def random_state_dict(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      device: str = "cpu") -> dict[str, torch.Tensor]:
    """A checkpoint dict with official key names and shapes (layer 0 without v0/v1/v2)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    C, V, F_, H, N = config.n_embd, config.vocab_size, config.ffn_dim, config.n_head, config.head_size

    def normal(*shape: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std + mean).to(dtype)

    def uniform(*shape: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen, device=device) * (hi - lo) + lo).to(dtype)

    sd: dict[str, torch.Tensor] = {
        "emb.weight": normal(V, C),
        "blocks.0.ln0.weight": normal(C, std=0.1, mean=1.0), "blocks.0.ln0.bias": normal(C, std=0.1),
    }
    for i in range(config.n_layer):
        p = f"blocks.{i}."
        for ln in ("ln1", "ln2"):
            sd[f"{p}{ln}.weight"] = normal(C, std=0.1, mean=1.0)
            sd[f"{p}{ln}.bias"] = normal(C, std=0.1)
        a = p + "att."
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[a + name] = uniform(1, 1, C)
        sd[a + "w0"] = uniform(1, 1, C, lo=-6.0, hi=3.0)    # decay bias spans about [-6, 3] in released models
        sd[a + "w1"] = normal(C, config.rank_w, std=C ** -0.5)
        sd[a + "w2"] = normal(config.rank_w, C, std=config.rank_w ** -0.5)
        sd[a + "a0"] = normal(1, 1, C, std=0.5)
        sd[a + "a1"] = normal(C, config.rank_a, std=C ** -0.5)
        sd[a + "a2"] = normal(config.rank_a, C, std=config.rank_a ** -0.5)
        if i > 0:
            sd[a + "v0"] = normal(1, 1, C, std=0.5)
            sd[a + "v1"] = normal(C, config.rank_v, std=C ** -0.5)
            sd[a + "v2"] = normal(config.rank_v, C, std=config.rank_v ** -0.5)
        sd[a + "g1"] = normal(C, config.rank_g, std=C ** -0.5)
        sd[a + "g2"] = normal(config.rank_g, C, std=config.rank_g ** -0.5)
        sd[a + "k_k"] = uniform(1, 1, C, lo=0.5, hi=1.2)
        sd[a + "k_a"] = uniform(1, 1, C, lo=0.5, hi=1.5)
        sd[a + "r_k"] = normal(H, N, std=0.3)
        for proj in ("receptance", "key", "value"):
            sd[f"{a}{proj}.weight"] = normal(C, C, std=C ** -0.5)
        sd[a + "output.weight"] = normal(C, C, std=0.5 * C ** -0.5)  # non-zero: the time mix must matter
        sd[a + "ln_x.weight"] = normal(C, std=0.1, mean=1.0)
        sd[a + "ln_x.bias"] = normal(C, std=0.1)
        sd[p + "ffn.x_k"] = uniform(1, 1, C)
        sd[p + "ffn.key.weight"] = normal(F_, C, std=C ** -0.5)
        sd[p + "ffn.value.weight"] = normal(C, F_, std=0.5 * F_ ** -0.5)
    sd["ln_out.weight"] = normal(C, std=0.1, mean=1.0)
    sd["ln_out.bias"] = normal(C, std=0.1)
    sd["head.weight"] = normal(V, C, std=3.0 * C ** -0.5)
    return sd


def save_checkpoint(sd: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write ``.pth`` (torch.save) or ``.safetensors`` by extension, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp))
    else:
        torch.save(sd, tmp)
    os.replace(tmp, path)


def data_dir() -> Path:
    """Where the server keeps generated files (demo model, state database)."""
    root = os.environ.get("RWKV_SERVER_HOME") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "rwkv7-server")
    return Path(root)


def ensure_demo_model() -> Path:
    """The built-in demo model: random weights generated deterministically on first use, then cached."""
    shape = DEMO_SHAPE
    path = data_dir() / f"demo-L{shape['n_layer']}-C{shape['n_embd']}-seed{DEMO_SEED}.pth"
    if not path.exists():
        log.info("generating the demo model at %s (first start only)", path)
        config = make_config(shape["n_layer"], shape["n_embd"], shape["vocab_size"])
        save_checkpoint(random_state_dict(config, seed=DEMO_SEED), path)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output file: .pth or .safetensors")
    ap.add_argument("--n-layer", type=int, required=True)
    ap.add_argument("--n-embd", type=int, required=True, help="width C, a multiple of the head size 64")
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                    help="storage dtype (official releases use bf16)")
    ap.add_argument("--device", default="cpu", help="where to draw the random numbers (cpu, cuda); the file is "
                                                    "the same format either way")
    args = ap.parse_args(argv)
    if args.n_embd % 64:
        ap.error("--n-embd must be a multiple of 64")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    config = make_config(args.n_layer, args.n_embd, args.vocab)
    sd = random_state_dict(config, seed=args.seed, dtype=dtype, device=args.device)
    if torch.device(args.device).type != "cpu":
        sd = {k: sd[k].cpu() for k in list(sd)}  # saved as CPU storages: loads anywhere, memory-mappable
    save_checkpoint(sd, args.out)
    print(f"wrote {args.out}: {config.describe()}")


if __name__ == "__main__":
    main()
