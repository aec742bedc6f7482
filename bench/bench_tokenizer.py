"""Benchmark infer.tokenizer.WorldTokenizer against the official rwkv TRIE_TOKENIZER.

Builds a ~1 MB mixed multilingual + source-code corpus deterministically (no
downloads), checks both tokenizers agree, then times encode and decode (best of
several runs) and writes bench/results/tokenizer.json.

Usage: python bench/bench_tokenizer.py [--runs N] [--size BYTES]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Run as a plain script from anywhere: make `infer` importable.
sys.path.insert(0, str(REPO))

from infer.tokenizer import WorldTokenizer  # noqa: E402

RESULTS = REPO / "bench" / "results" / "tokenizer.json"
CORPUS_SEED = 20240424

# Seed text per language; sentences are re-sampled from their words/characters so
# the corpus is not one paragraph repeated verbatim.
PROSE = {
    "en": "the model reads a long document and writes a short answer while the server keeps "
    "a small recurrent state for every request so memory does not grow with context length "
    "researchers compare speed quality and cost on many tasks including code math and chat",
    "fr": "le modèle lit un long document et écrit une réponse courte pendant que le serveur "
    "garde un petit état pour chaque requête afin que la mémoire ne grandisse pas",
    "de": "das Modell liest ein langes Dokument und schreibt eine kurze Antwort während der "
    "Server für jede Anfrage einen kleinen Zustand behält größer wird der Speicher nicht",
    "ru": "модель читает длинный документ и пишет короткий ответ пока сервер хранит небольшое "
    "состояние для каждого запроса поэтому память не растёт вместе с длиной контекста",
    "ar": "يقرأ النموذج مستندا طويلا ويكتب إجابة قصيرة بينما يحتفظ الخادم بحالة صغيرة لكل طلب "
    "حتى لا تنمو الذاكرة مع طول السياق",
}
# Scripts without spaces: sample characters instead of words.
CHARS = {
    "zh": "模型读取一篇很长的文档并写出简短的回答服务器为每个请求保存一个小的循环状态因此内存不会随着上下文长度增长研究人员比较速度质量和成本",
    "ja": "モデルは長い文書を読み短い答えを書きますサーバーは各リクエストごとに小さな状態を保持するためメモリは文脈の長さとともに増えません",
}
KOREAN = "모델은 긴 문서를 읽고 짧은 답을 씁니다 서버는 요청마다 작은 상태를 유지하므로 메모리가 늘어나지 않습니다"
EMOJI = ["🙂", "👍🏽", "🔥", "✨", "❤️", "👨‍👩‍👧‍👦", "🇯🇵", "🇺🇸", "🏳️‍🌈", "😂", "🚀"]
PUNCT_EN = [".", ".", ".", "?", "!", ",", ";", ":"]

CODE_TEMPLATES = [
    "def {a}({b}, {c}=None):\n    \"\"\"Return the {a} of {b}.\"\"\"\n    if {c} is None:\n"
    "        {c} = {n}\n    for i in range({b}):\n        {c} += i * {m}\n    return {c}\n\n",
    "class {A}:\n\tdef __init__(self, {b}):\n\t\tself.{b} = {b}\n\t\tself._{c} = [{n}, {m}]\n\n"
    "\tdef {a}(self) -> int:\n\t\treturn len(self._{c})\n\n",
    "static int {a}(const char *{b}, size_t {c}) {{\r\n    int total = {n};\r\n"
    "    for (size_t i = 0; i < {c}; ++i) {{\r\n        total += {b}[i] ^ 0x{m:x};\r\n    }}\r\n"
    "    return total;\r\n}}\r\n\r\n",
    '{{"{a}": {n}, "{b}": [{m}, {n}, "{c}"], "nested": {{"{A}": true, "x": null}}}}\n',
    "<div class=\"{a}\">\n  <span id=\"{b}-{n}\">{A}</span>\n</div>\n",
]
IDENT = ["value", "count", "buffer", "state", "token", "index", "result", "config", "layer", "head", "scale"]


def _prose(rng: random.Random, words: list[str]) -> str:
    n = rng.randint(6, 24)
    s = " ".join(rng.choice(words) for _ in range(n))
    return s[0].upper() + s[1:] + rng.choice(PUNCT_EN) + " "


def _chars(rng: random.Random, chars: str) -> str:
    return "".join(rng.choice(chars) for _ in range(rng.randint(10, 40))) + rng.choice("。、！？")


def _code(rng: random.Random) -> str:
    names = rng.sample(IDENT, 3)
    return rng.choice(CODE_TEMPLATES).format(
        a=names[0] + "_" + rng.choice(IDENT),
        b=names[1],
        c=names[2],
        A=names[0].capitalize() + names[1].capitalize(),
        n=rng.randint(0, 100000),
        m=rng.randint(1, 4095),
    )


def make_corpus(size: int, seed: int = CORPUS_SEED) -> str:
    """Deterministic mixed corpus of at least `size` UTF-8 bytes."""
    rng = random.Random(seed)
    prose_words = {k: v.split() for k, v in PROSE.items()}
    korean_words = KOREAN.split()
    pieces: list[str] = []
    total = 0
    while total < size:
        r = rng.random()
        if r < 0.35:
            piece = _prose(rng, prose_words["en"])
        elif r < 0.45:
            piece = _prose(rng, prose_words[rng.choice(["fr", "de", "ru", "ar"])])
        elif r < 0.60:
            piece = _chars(rng, CHARS[rng.choice(["zh", "ja"])])
        elif r < 0.65:
            piece = " ".join(rng.choice(korean_words) for _ in range(rng.randint(4, 12))) + ". "
        elif r < 0.85:
            piece = _code(rng)
        elif r < 0.90:
            piece = "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4))) + " "
        else:
            piece = rng.choice(["\n\n", "\n", "\r\n", "\n\n\n\n", " " * rng.randint(2, 16), "\t\t"])
        pieces.append(piece)
        total += len(piece.encode("utf-8"))
    return "".join(pieces)


def best_time(fn: Callable[[], object], runs: int) -> float:
    """Minimum wall time over `runs` calls: the least noisy estimate of the cost."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--size", type=int, default=1_000_000, help="corpus size in UTF-8 bytes")
    args = ap.parse_args()

    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    text = make_corpus(args.size)
    n_bytes = len(text.encode("utf-8"))

    t0 = time.perf_counter()
    ours = WorldTokenizer()
    ours_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    official = TRIE_TOKENIZER(str(Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"))
    official_load = time.perf_counter() - t0

    ids = ours.encode(text)
    if ids != official.encode(text) or ours.decode(ids) != text or official.decode(ids) != text:
        raise SystemExit("tokenizers disagree on the benchmark corpus")
    n_tokens = len(ids)

    impls = {
        "ours": (ours.encode, ours.decode),
        "official": (official.encode, official.decode),
    }
    results: dict[str, dict[str, float]] = {}
    for name, (enc, dec) in impls.items():
        enc_s = best_time(lambda: enc(text), args.runs)
        dec_s = best_time(lambda: dec(ids), args.runs)
        results[name] = {
            "encode_s": enc_s,
            "encode_MBps": n_bytes / enc_s / 1e6,
            "encode_tokens_per_s": n_tokens / enc_s,
            "decode_s": dec_s,
            "decode_MBps": n_bytes / dec_s / 1e6,
            "decode_tokens_per_s": n_tokens / dec_s,
        }
    results["ours"]["load_s"] = ours_load
    results["official"]["load_s"] = official_load
    speedup = {
        op: results["official"][f"{op}_s"] / results["ours"][f"{op}_s"] for op in ("encode", "decode")
    }

    print(f"corpus: {n_bytes} bytes, {len(text)} chars, {n_tokens} tokens; best of {args.runs} runs")
    print(f"{'impl':<10}{'op':<8}{'MB/s':>10}{'tokens/s':>14}")
    for name in impls:
        for op in ("encode", "decode"):
            r = results[name]
            print(f"{name:<10}{op:<8}{r[f'{op}_MBps']:>10.2f}{r[f'{op}_tokens_per_s']:>14,.0f}")
    print(f"speedup (official time / ours): encode {speedup['encode']:.2f}x, decode {speedup['decode']:.2f}x")
    print(f"load: ours {ours_load:.2f} s, official {official_load:.2f} s")

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "rwkv": importlib.metadata.version("rwkv"),
        "cpu": cpu_model(),
        "platform": platform.platform(),
        "corpus": {"bytes": n_bytes, "chars": len(text), "tokens": n_tokens, "seed": CORPUS_SEED},
        "runs": args.runs,
        "MB": "1e6 bytes of UTF-8 text",
        "results": results,
        "speedup": speedup,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
