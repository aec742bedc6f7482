"""Train a tiny byte-level RWKV-7 on the CPU, for accuracy checks that need a trained model.

No checkpoint can be downloaded here, and random weights give flat next-token distributions: the
top-1 token of a random model flips under any rounding, so agreement figures measured on one say
little about a trained model. This script trains a small model (default L4 x C128, vocabulary = the
256 byte values) on the Python standard library's source (the interpreter's own ``Lib/``; a few
modules are held out for evaluation, see ``HELD_OUT``) and writes it in the official checkpoint
layout, so the loader, the exporters and ``bench/quant_accuracy.py --checkpoint`` take it as they
take a released model.

It trains through the model's own readable forward (``RWKV7.forward_reference``): the model is
assembled from the checkpoint tensors at every step (the conversions are differentiable), and the
WKV recurrence is a differentiable step loop (``TrainingWKV``) instead of the in-place inference one.

    python bench/train_tiny.py --minutes 12 --out test/data/tiny_trained_l4c128.pth
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import infer.ops.linear  # noqa: E402
from infer.batch import PackedBatch  # noqa: E402
from infer.model import RWKV7  # noqa: E402
from infer.random_model import make_config, random_state_dict, save_checkpoint  # noqa: E402

# Modules kept out of training: the evaluation text (bench/quant_accuracy.py --checkpoint reads them).
HELD_OUT = ("textwrap.py", "fractions.py", "shlex.py", "colorsys.py", "bisect.py")


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules, sorted (the corpus is the same on every run)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in lib.glob("*.py") if p.is_file())


def corpus_bytes(held_out: bool) -> bytes:
    """Training text (every module but the held-out ones) or evaluation text (only those)."""
    files = [p for p in stdlib_files() if (p.name in HELD_OUT) == held_out]
    return b"\n".join(p.read_bytes() for p in files)


class TrainingWKV:
    """The WKV-7 recurrence as a differentiable step loop over equal-length rows (``infer.ops.wkv``'s
    math; the pool's states are read at the start and written back, detached, at the end)."""

    name = "torch, differentiable (training)"

    def __call__(self, state, batch, r, w, k, v, a, b):
        _, H, N, _ = state.shape
        B, T = batch.num_rows, batch.lens[0]
        if any(n != T for n in batch.lens):
            raise ValueError("TrainingWKV takes rows of one length")
        r, w, k, v, a, b = (t.float().view(B, T, H, N) for t in (r, w, k, v, a, b))
        s = state[batch.slots].float()  # [B, H, N(value), N(key)]
        ys = []
        for t in range(T):
            sa = s @ a[:, t, :, :, None]                                   # [B, H, N, 1], the old state
            s = s * w[:, t, :, None, :] + sa * b[:, t, :, None, :] + v[:, t, :, :, None] * k[:, t, :, None, :]
            ys.append((s @ r[:, t, :, :, None]).squeeze(-1))
        with torch.no_grad():
            state[batch.slots] = s.detach().to(state.dtype)
        return torch.stack(ys, 1).reshape(B * T, H * N)


def logits_of(params: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """Every position's logits [B*T, V] for ``rows`` [B, T] from a zero state, with gradients."""
    model = RWKV7.from_state_dict(dict(params), device="cpu", dtype="fp32")
    model.wkv = TrainingWKV()
    B, T = rows.shape
    batch = PackedBatch.from_rows(rows.tolist(), list(range(B)), "cpu")
    return RWKV7.forward_reference.__wrapped__(model, batch, model.new_state_pool(B), all_logits=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--minutes", type=float, default=12.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", default="", help="start from this checkpoint instead of random weights")
    ap.add_argument("--out", default="test/data/tiny_trained_l4c128.pth")
    args = ap.parse_args()
    logging.getLogger("infer").setLevel(logging.WARNING)  # a model is assembled per step
    # One matrix product per linear: training needs no batch invariance, and the 16-row blocks that give
    # it cost a thousand small products per step
    infer.ops.linear.cpu_row_blocks = lambda x: [x]
    torch.manual_seed(args.seed)

    data = torch.frombuffer(bytearray(corpus_bytes(held_out=False)), dtype=torch.uint8).long()
    held = torch.frombuffer(bytearray(corpus_bytes(held_out=True)), dtype=torch.uint8).long()
    config = make_config(args.n_layer, args.n_embd, vocab_size=256)
    start = torch.load(args.resume, weights_only=True) if args.resume else random_state_dict(config, args.seed)
    params = {k: v.float().requires_grad_(True) for k, v in start.items()}
    opt = torch.optim.AdamW(params.values(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"corpus {len(data):,} bytes, held out {len(held):,}; {config.describe()}; "
          f"{sum(p.numel() for p in params.values()):,} parameters", flush=True)

    def sample(text: torch.Tensor) -> torch.Tensor:
        at = torch.randint(0, len(text) - args.seq - 1, (args.batch,), generator=gen)
        return torch.stack([text[i:i + args.seq + 1] for i in at.tolist()])

    budget, started, history = args.minutes * 60, time.monotonic(), []
    step = 0
    while step < args.max_steps and time.monotonic() - started < budget:
        frac = (time.monotonic() - started) / budget
        for group in opt.param_groups:  # warm-up, then cosine to a tenth
            group["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        rows = sample(data)
        loss = F.cross_entropy(logits_of(params, rows[:, :-1]), rows[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            with torch.no_grad():
                rows = sample(held)
                held_loss = F.cross_entropy(logits_of(params, rows[:, :-1]), rows[:, 1:].reshape(-1)).item()
            history.append({"step": step, "seconds": round(time.monotonic() - started, 1),
                            "train_loss": round(loss.item(), 4), "held_out_loss": round(held_loss, 4)})
            print(history[-1], flush=True)

    out = Path(args.out)
    save_checkpoint({k: v.detach().to(torch.bfloat16) for k, v in params.items()}, out)
    meta = {"shape": config.describe(), "steps": step, "resumed_from": args.resume or None, "batch": args.batch, "seq": args.seq, "lr": args.lr,
            "seed": args.seed, "corpus": f"python {sys.version.split()[0]} stdlib top-level modules",
            "held_out": list(HELD_OUT), "history": history}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) after {step} steps")


if __name__ == "__main__":
    main()
