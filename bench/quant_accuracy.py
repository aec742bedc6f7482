"""Accuracy of each weight format's quantization math: logit error and top-1 agreement against fp16 weights.

For a random model of a real shape, every big matrix (the head and each block's receptance, key,
value, output, FFN key/value) is quantized with the exporters' math (``infer/quant/quantize.py``) and
dequantized back; the model then runs in fp32, so the numbers isolate the weight format from the
kernels and from activation rounding. A prompt of text tokens is fed teacher-forced and, at every
position, the logits are compared with the same model whose matrices are only rounded to fp16 (the
``fp16`` engine). Random weights give flatter next-token distributions than trained ones, so top-1
agreement here is a pessimistic proxy for greedy agreement on a real checkpoint. The 4-bit formats:
``uint4_g_rtn`` / ``uint4_g_hqq`` (zero points by round-to-nearest / HQQ, the GemLite export's
default), ``uint4_g_sym`` (symmetric round-to-nearest), ``uint4_g_gptq`` / ``uint4_g_gptq_zp`` (GPTQ,
symmetric / with zero points: ``export_quant_gemlite --gptq``).

    python bench/quant_accuracy.py --n-layer 12 --n-embd 768 --tokens 128

With ``--checkpoint`` the model is a trained one instead (``bench/train_tiny.py``: byte-level, trained on the
Python standard library); the text is then the held-out modules' bytes, and besides teacher-forced top-1
agreement it reports greedy agreement: the reference model continues prompts greedily, and each format's model,
fed the same tokens, is scored on how many of those greedy tokens it also picks:

    python bench/quant_accuracy.py --checkpoint test/data/tiny_trained_l4c128.pth --tokens 1024 \
        --out bench/results/quant_accuracy_trained_cpu.json

With ``--engines`` (a GPU) it compares the inference engines themselves instead: the same fp16 model
(random, or ``--checkpoint``'s with the exporters' defaults) loaded as each engine's checkpoint (W8A16 for
cutlass, GemLite's packed formats), run through the real kernels with fp16 activations, against the fp16 engine:

    python bench/quant_accuracy.py --engines cutlass,gemlite:A16W8_INT8,gemlite:A16W4_HQQ_INT \
        --n-layer 24 --n-embd 2048 --out bench/results/quant_accuracy_h200.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from infer.checkpoint import DictSource, infer_config  # noqa: E402
from infer.model import RWKV7  # noqa: E402
from infer.quant.gptq import calibrated_quantizer  # noqa: E402
from infer.quant.quantize import dequantize_uint4_groups, quantize_fp8, quantize_int8, quantize_uint4_groups  # noqa: E402
from infer.random_model import make_config, random_state_dict  # noqa: E402
from infer.tokenizer import load_world_tokenizer  # noqa: E402

TEXT = ("The lighthouse keeper climbed the stairs each evening, counting the steps as his father had "
        "taught him. Below, the sea threw itself against the rocks, and the lamp turned slowly, "
        "sweeping its light across the water. def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n\n研究表明，睡眠对记忆的巩固至关重要。 Les marées montent deux "
        "fois par jour, et le gardien note chaque changement dans son carnet. ") * 4


def dequantized(weight: torch.Tensor, fmt: str, group_size: int) -> torch.Tensor:
    """The matrix as the format stores it, converted back to fp32."""
    if fmt == "fp16":
        return weight.half().float()
    if fmt == "int8":
        q, scale = quantize_int8(weight)
        return q.float() * scale.float()[:, None]
    if fmt == "fp8_e4m3":
        q, scale = quantize_fp8(weight)
        return q.float() * scale.float()[:, None]
    if fmt in ("uint4_g_rtn", "uint4_g_hqq", "uint4_g_sym"):
        return dequantize_uint4_groups(*quantize_uint4_groups(weight, group_size, optimize=fmt.endswith("hqq"),
                                                              symmetric=fmt.endswith("sym")))
    raise ValueError(fmt)


def gptq_dequantized(model: RWKV7, base: dict[str, torch.Tensor], keys: list[str], fmt: str, group_size: int,
                     rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """GPTQ (``uint4_g_gptq`` symmetric, ``uint4_g_gptq_zp`` with zero points) calibrated on ``rows``."""
    quantize = calibrated_quantizer(model, keys, rows, group_size, symmetric=fmt == "uint4_g_gptq")
    return {key: dequantize_uint4_groups(*quantize(key, base[key])) for key in keys}


def run(model: RWKV7, tokens: list[int]) -> torch.Tensor:
    return model.prefill([tokens], [0], model.new_state_pool(1), all_logits=True)


GREEDY_PROMPT_BYTES = 64


def held_out_prompts(text: list[int], count: int) -> list[list[int]]:
    """``count`` prompts of GREEDY_PROMPT_BYTES tokens spread evenly over ``text``."""
    step = len(text) // (count + 1)
    return [text[(i + 1) * step:(i + 1) * step + GREEDY_PROMPT_BYTES] for i in range(count)]


def greedy_continuations(model: RWKV7, prompts: list[list[int]], length: int) -> list[list[int]]:
    """Each prompt followed by ``length`` tokens that ``model`` picks greedily."""
    pool = model.new_state_pool(len(prompts))
    slots = list(range(len(prompts)))
    logits = model.prefill(prompts, slots, pool)
    rows = [list(p) for p in prompts]
    for _ in range(length):
        picks = logits.argmax(dim=-1).tolist()
        for row, token in zip(rows, picks):
            row.append(token)
        logits = model.decode(picks, slots, pool)
    return rows


def greedy_agreement(model: RWKV7, rows: list[list[int]], prompt_len: int) -> float:
    """Percentage of the greedy tokens of ``rows`` (after the first ``prompt_len``) that ``model`` also
    picks when fed the same preceding tokens."""
    same = total = 0
    for row in rows:
        picks = run(model, row[:-1]).argmax(dim=-1)[prompt_len - 1:].cpu()
        target = torch.tensor(row[prompt_len:])
        same += int((picks == target).sum())
        total += len(target)
    return 100.0 * same / total


def compare(name: str, logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """Logit error and top-1 agreement of ``logits`` against ``reference`` (both [T, V])."""
    top2 = reference.topk(2, dim=-1)
    # positions where the reference's choice is clear (top-1 ahead of top-2 by >= 1 logit): random
    # weights give many near-ties, which trained models rarely have at their greedy choice
    confident = (top2.values[:, 0] - top2.values[:, 1]) >= 1.0
    diff = (logits - reference).abs()
    same = logits.argmax(dim=-1) == top2.indices[:, 0]
    agree_confident = same[confident].float().mean().item() if confident.any() else float("nan")
    return {"format": name, "max_abs_logit_err": round(diff.max().item(), 4),
            "mean_abs_logit_err": round(diff.mean().item(), 5),
            "max_err_rel_to_max_logit": round(diff.max().item() / reference.abs().max().item(), 4),
            "top1_agreement_pct": round(100 * same.float().mean().item(), 1),
            "top1_agreement_confident_pct": round(100 * agree_confident, 1), "confident_positions": int(confident.sum())}


def engine_rows(config, tokens: list[int], engines: list[str], trained: dict[str, torch.Tensor] | None = None,
                greedy_prompts: list[list[int]] = (), greedy_tokens: int = 0) -> list[dict]:
    """Each engine's model (the same fp16 weights, random or ``trained``, converted as its export tool would)
    against the fp16 engine, on the GPU through the kernels each engine serves with; with ``greedy_prompts``
    also greedy agreement (the fp16 engine's continuations)."""
    from bench.bench_decode import engine_weights, random_weights
    from infer.ops.fused import select_fused
    from infer.ops.wkv_cuda import select_wkv

    def load(engine: str) -> tuple[RWKV7, float]:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        if trained is None:
            weights = random_weights(config, engine)
        else:
            weights = engine_weights({k: v.half().cuda() for k, v in trained.items()}, config, engine, hqq=True)
        model = RWKV7.from_state_dict(weights, device="cuda", dtype="fp16", engine=engine.split(":")[0])
        weights_gb = (torch.cuda.memory_allocated() - before) / 1e9
        model.wkv = select_wkv(model.device, "auto", heads=model.config.n_head)
        select_fused(model, "auto")
        return model, weights_gb

    reference_model, reference_gb = load("fp16")
    reference = run(reference_model, tokens).float()
    greedy_rows = greedy_continuations(reference_model, list(greedy_prompts), greedy_tokens) if greedy_prompts else []
    del reference_model
    rows = [{"format": "fp16", "weights_gb": round(reference_gb, 2)}]
    for engine in engines:
        started = time.perf_counter()
        model, weights_gb = load(engine)
        row = compare(engine, run(model, tokens).float(), reference)
        if greedy_rows:
            row["greedy_agreement_pct"] = round(greedy_agreement(model, greedy_rows, GREEDY_PROMPT_BYTES), 2)
        del model
        row.update(weights_gb=round(weights_gb, 2), seconds=round(time.perf_counter() - started, 1))
        rows.append(row)
        print(row, flush=True)
    return rows


def trained_inputs(args) -> tuple:
    """--checkpoint: its config and fp32 weights, held-out text, greedy prompts (held_out_prompts) and GPTQ
    calibration rows (32 rows of 128 training bytes)."""
    from bench.train_tiny import corpus_bytes
    base = {k: v.float() for k, v in torch.load(args.checkpoint, map_location="cpu", weights_only=True).items()}
    config = infer_config(DictSource(dict(base)))
    if config.vocab_size != 256:
        raise SystemExit("--checkpoint takes a byte-level model (vocabulary 256; bench/train_tiny.py)")
    text = list(corpus_bytes(held_out=True))
    prompts = held_out_prompts(text, args.greedy_prompts)
    train = corpus_bytes(held_out=False)
    calibration = [list(train[i * len(train) // 32:][:128]) for i in range(32)]
    return config, base, text[: args.tokens], prompts, calibration


def random_inputs(args) -> tuple:
    """A random model of the asked shape (its weights only on the CPU path), the text's tokens, no greedy
    prompts, and GPTQ calibration rows: a random model's layer inputs are its tokens' embeddings, so no text
    is closer to its "training distribution" than 32 rows of 128 random tokens."""
    config = make_config(args.n_layer, args.n_embd, args.vocab)
    base = {} if args.engines else random_state_dict(config, seed=args.seed, dtype=torch.float32)
    gen = torch.Generator().manual_seed(args.seed + 1)
    calibration = torch.randint(0, config.vocab_size, (32, 128), generator=gen).tolist()
    # World token ids folded into a smaller --vocab (a random model's token ids carry no meaning anyway)
    text = [token % config.vocab_size for token in load_world_tokenizer().encode(TEXT)[: args.tokens]]
    return config, base, text, [], calibration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default="int8,fp8_e4m3,uint4_g_rtn,uint4_g_hqq,uint4_g_sym,uint4_g_gptq,uint4_g_gptq_zp")
    ap.add_argument("--engines", default="", help="GPU: compare these engines (cutlass, gemlite:FORMAT) with fp16")
    ap.add_argument("--checkpoint", default="", help="a trained byte-level checkpoint (bench/train_tiny.py) "
                                                     "instead of a random model")
    ap.add_argument("--greedy-prompts", type=int, default=8, help="with --checkpoint: prompts continued greedily")
    ap.add_argument("--greedy-tokens", type=int, default=128, help="with --checkpoint: greedy tokens per prompt")
    ap.add_argument("--out", default="bench/results/quant_accuracy_cpu.json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    config, base, tokens, prompts, calibration = (trained_inputs if args.checkpoint else random_inputs)(args)
    if args.engines:
        kind = "trained" if args.checkpoint else "random"
        result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": "cuda",
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": config.describe(),
                  "model": args.checkpoint or "random", "prompt_tokens": len(tokens), "group_size": 64,
                  "reference": f"the fp16 engine on the same {kind} weights, fp16 activations, same kernels",
                  "formats": engine_rows(config, tokens, args.engines.split(","), base if args.checkpoint else None,
                                         prompts, args.greedy_tokens)}
        write(result, args.out)
        return
    keys = config.linear_keys()

    def model_with(fmt: str) -> RWKV7:
        if fmt.startswith("uint4_g_gptq"):
            float_model = RWKV7.from_state_dict({k: v.clone() for k, v in base.items()}, device="cpu", dtype="fp32")
            sd = {**base, **gptq_dequantized(float_model, base, keys, fmt, args.group_size, calibration)}
        else:
            sd = {k: (dequantized(v, fmt, args.group_size) if k in keys else v.clone()) for k, v in base.items()}
        return RWKV7.from_state_dict(sd, device="cpu", dtype="fp32")

    reference_model = model_with("fp16")
    reference = run(reference_model, tokens)
    greedy_rows = greedy_continuations(reference_model, prompts, args.greedy_tokens) if prompts else []
    rows = []
    for fmt in args.formats.split(","):
        started = time.perf_counter()
        model = model_with(fmt)
        row = compare(fmt, run(model, tokens), reference)
        if greedy_rows:
            row["greedy_agreement_pct"] = round(greedy_agreement(model, greedy_rows, GREEDY_PROMPT_BYTES), 2)
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        print(row, flush=True)
    write({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": "cpu",
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "shape": config.describe(), "prompt_tokens": len(tokens), "group_size": args.group_size,
           "model": args.checkpoint or "random",
           **({"greedy": f"{len(prompts)} prompts of {GREEDY_PROMPT_BYTES} held-out bytes, "
                         f"{args.greedy_tokens} greedy tokens each"} if prompts else {}),
           "reference": f"same {'trained' if args.checkpoint else 'random'} model, matrices rounded to fp16, fp32 "
                        "activations", "formats": rows}, args.out)


def write(result: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'format':<22} {'max |dlogit|':>12} {'mean |dlogit|':>13} {'rel. max':>9} {'top-1 agree':>12} "
          f"{'agree, margin>=1':>17} {'weights GB':>10}")
    for r in result["formats"]:
        if "max_abs_logit_err" in r:
            print(f"{r['format']:<22} {r['max_abs_logit_err']:>12} {r['mean_abs_logit_err']:>13} "
                  f"{r['max_err_rel_to_max_logit']:>9} {r['top1_agreement_pct']:>11}% "
                  f"{r['top1_agreement_confident_pct']:>15}% ({r['confident_positions']} pos.) {r.get('weights_gb', '-'):>6}"
                  + (f"  greedy {r['greedy_agreement_pct']}%" if "greedy_agreement_pct" in r else ""))


if __name__ == "__main__":
    main()
