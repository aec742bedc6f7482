"""Tests for infer.tokenizer against the official rwkv TRIE_TOKENIZER (test-only oracle)."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from pathlib import Path

import pytest

from infer.tokenizer import (
    EOD_TOKEN,
    VOCAB_PATH,
    IncrementalDecoder,
    WorldTokenizer,
    load_world_tokenizer,
    read_vocab,
)

REPO = Path(__file__).resolve().parent.parent
VOCAB_MD5 = "dd1946a66e1721abeac49f9c75a1e844"

PYTHON_SRC = '''import os

class Foo:
\tdef bar(self, x):
\t\tif x:
\t\t\treturn {"a": [1, 2, 3]}
\t\treturn None

    def spaced(self):  # four-space indent mixed with tabs
        for i in range(10):
            yield i ** 2
'''

C_SRC = (
    "#include <stdio.h>\r\n"
    "int main(int argc, char **argv) {\r\n"
    "\tfor (int i = 0; i < argc; ++i) {\r\n"
    '\t\tprintf("%s\\n", argv[i]);\r\n'
    "\t}\r\n"
    "\treturn 0;\r\n"
    "}\r\n"
)

CORPUS: dict[str, str] = {
    "empty": "",
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it? "
    "Dr. Smith's e-mail is smith@example.com; price: $1,299.99 (20% off)!",
    "chinese": "人工智能正在改变世界。我们今天讨论的是一种新的循环神经网络架构，它在长文本上表现出色。",
    "japanese": "日本語のテキストです。東京は日本の首都であり、カタカナとひらがなが混ざっています。",
    "korean": "안녕하세요. 서울은 대한민국의 수도입니다. 한국어 토크나이저 테스트입니다.",
    "arabic": "مرحبا بالعالم. هذه جملة باللغة العربية لاختبار المحلل اللغوي.",
    "russian": "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "mixed_scripts": "Ελληνικά, हिन्दी, ไทย, עברית, Tiếng Việt, ñandú, Straße, café, naïve, Å",
    "emoji": "🙂😀👍🏽 ❤️ ✨🔥 family: 👨‍👩‍👧‍👦 couple: 👩‍❤️‍👨 flags: 🇯🇵🇺🇸🇫🇷🏳️‍🌈 keycap: 1️⃣",
    "combining": "e\u0301 a\u0308 Z\u0351\u0352\u0353 \ufeffBOM \u200bzero-width \u00a0nbsp",
    "python_code": PYTHON_SRC,
    "c_code_crlf": C_SRC,
    "spaces": "a" + " " * 1 + "b" + " " * 2 + "c" + " " * 7 + "d" + " " * 33 + "e" + " " * 200,
    "newlines": "x\n" + "\n" * 50 + "y\n\n\nz" + "\n" * 3,
    "crlf": "line one\r\nline two\r\n\r\n\r\nline three\r",
    "tabs_mixed_ws": "\t \t\n \n\t\t\t\v\f end",
    "control_chars": "".join(chr(c) for c in range(32)) + "\x7f\x00\x00",
    "numbers": "0 1 12 123 1234 12345 3.14159265358979 -42 1e-9 0xDEADBEEF 2024-01-31",
    "chat": "User: hi\n\nAssistant: Hello! How can I help you today?\n\nUser: 写一首诗\n\nAssistant:",
    "long_repeated_english": "hello world, " * 5000,
    "long_single_char": "a" * 20000,
    "long_chinese": "你好世界" * 3000,
    "long_spaces": " " * 5000,
    "long_equals": "=" * 3000 + "\n" + "-" * 3000,
    "surrogate_range_neighbours": "\ud7ff\ue000\uffff\U00010000\U0010ffff",
}

INVALID_UTF8: list[bytes] = [
    b"\x80",
    b"\xff",
    b"\xfe\xff",
    b"\xc0\xaf",  # overlong "/"
    b"\xe0\x80\xaf",  # overlong
    b"\xed\xa0\x80",  # encoded surrogate
    b"\xf4\x90\x80\x80",  # above U+10FFFF
    b"\xe4\xbd",  # truncated 3-byte char
    b"\xf0\x9f\x99",  # truncated emoji
    b"abc\x80def\xc3",
    b"\xc3\x28\xa0\xa1\xe2\x28\xa1\xe2\x82\x28",
    "你好".encode() + b"\xe4" + "世界".encode(),
]


def _random_unicode(rng: random.Random, length: int) -> str:
    """Random text drawn from several script ranges, never a surrogate."""
    ranges = [
        (0x20, 0x7E),
        (0x00, 0x1F),
        (0xA0, 0x24F),
        (0x370, 0x3FF),
        (0x400, 0x4FF),
        (0x590, 0x6FF),
        (0x900, 0x97F),
        (0xE00, 0xE7F),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0xE000, 0xFFFD),
        (0x1F300, 0x1FAFF),
        (0x10000, 0x10FFFF),
    ]
    out = []
    for _ in range(length):
        lo, hi = rng.choice(ranges)
        cp = rng.randint(lo, hi)
        if 0xD800 <= cp <= 0xDFFF:
            cp = 0x20
        out.append(chr(cp))
    return "".join(out)


def _random_byte_soup(rng: random.Random, tok: WorldTokenizer, length: int) -> bytes:
    """Random bytes mixed with whole token byte strings (to exercise long matches)."""
    parts = []
    while sum(map(len, parts)) < length:
        if rng.random() < 0.5:
            parts.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 6))))
        else:
            parts.append(tok.decode_bytes([rng.randint(1, 65529)]))
    return b"".join(parts)


@pytest.fixture(scope="module")
def tok() -> WorldTokenizer:
    return load_world_tokenizer()


@pytest.fixture(scope="module")
def official():
    rwkv = pytest.importorskip("rwkv")
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    return TRIE_TOKENIZER(str(Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt"))


@pytest.fixture(scope="module")
def partial_utf8_ids(tok: WorldTokenizer) -> list[int]:
    """Ids whose bytes are not valid UTF-8 on their own (lone bytes, split characters)."""
    ids = []
    for i in range(1, tok.vocab_size):
        try:
            tok.decode_bytes([i]).decode("utf-8")
        except UnicodeDecodeError:
            ids.append(i)
    return ids


# --- known values -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("The Eiffel tower is in the city of", [6699, 304, 25740, 109, 39990, 4600, 4596, 22590, 30449, 4706]),
        ("\n\n", [261]),
        ("User: hi\n\nAssistant:", [24281, 59, 4571, 261, 5585, 41693, 59]),
        ("🙂", [3319, 2417]),
        ("", []),
    ],
)
def test_known_examples(tok: WorldTokenizer, text: str, ids: list[int]) -> None:
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_constants(tok: WorldTokenizer) -> None:
    assert EOD_TOKEN == WorldTokenizer.EOD_TOKEN == 0
    assert tok.vocab_size == 65530
    assert tok.decode_bytes([EOD_TOKEN]) == b""
    assert tok.decode([5585, EOD_TOKEN, 59]) == tok.decode([5585, 59])


def test_loader_is_cached() -> None:
    assert load_world_tokenizer() is load_world_tokenizer()


def test_server_does_not_import_rwkv() -> None:
    code = "import sys, infer.tokenizer as t; t.load_world_tokenizer(); assert 'rwkv' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# --- agreement with the official tokenizer --------------------------------------


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_matches_official(tok: WorldTokenizer, official, name: str) -> None:
    text = CORPUS[name]
    ids = tok.encode(text)
    assert ids == official.encode(text)
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert tok.decode(ids) == text


def test_whole_corpus_concatenated(tok: WorldTokenizer, official) -> None:
    text = "\n".join(CORPUS[k] for k in sorted(CORPUS))
    ids = tok.encode(text)
    assert ids == official.encode(text)
    assert tok.decode(ids) == text


def test_every_single_byte(tok: WorldTokenizer, official) -> None:
    for b in range(256):
        data = bytes((b,))
        ids = tok.encode_bytes(data)
        assert ids == official.encodeBytes(data)
        assert len(ids) == 1
        assert tok.decode_bytes(ids) == data
    data = bytes(range(256)) + bytes(range(255, -1, -1))
    assert tok.encode_bytes(data) == official.encodeBytes(data)
    assert tok.decode_bytes(tok.encode_bytes(data)) == data


@pytest.mark.parametrize("data", INVALID_UTF8, ids=lambda d: d.hex())
def test_invalid_utf8(tok: WorldTokenizer, official, data: bytes) -> None:
    ids = tok.encode_bytes(data)
    assert ids == official.encodeBytes(data)
    assert tok.decode_bytes(ids) == data
    assert tok.decode(ids) == data.decode("utf-8", errors="replace")


def test_encode_bytes_accepts_bytearray(tok: WorldTokenizer) -> None:
    data = "hello 世界".encode()
    assert tok.encode_bytes(bytearray(data)) == tok.encode_bytes(data)


def test_random_byte_soup(tok: WorldTokenizer, official) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        data = _random_byte_soup(rng, tok, rng.randint(0, 300))
        ids = tok.encode_bytes(data)
        assert ids == official.encodeBytes(data)
        assert tok.decode_bytes(ids) == data


def test_random_unicode(tok: WorldTokenizer, official) -> None:
    rng = random.Random(5678)
    for _ in range(1000):
        text = _random_unicode(rng, rng.randint(0, 120))
        ids = tok.encode(text)
        assert ids == official.encode(text)
        assert tok.decode(ids) == text


def test_random_token_concatenations(tok: WorldTokenizer, official) -> None:
    # Text made of whole vocabulary entries hits long trie paths and near-miss prefixes.
    rng = random.Random(91011)
    for _ in range(300):
        data = tok.decode_bytes(rng.randint(1, 65529) for _ in range(rng.randint(1, 40)))
        assert tok.encode_bytes(data) == official.encodeBytes(data)


# --- vocabulary file ---------------------------------------------------------


def test_vocab_file_md5() -> None:
    data = VOCAB_PATH.read_bytes()
    assert hashlib.md5(data).hexdigest() == VOCAB_MD5
    assert b"\r" not in data


def test_vocab_matches_official_file(official) -> None:
    vocab = read_vocab(VOCAB_PATH)
    assert len(vocab) == 65529
    assert sorted(vocab) == list(range(1, 65530))
    assert vocab == official.idx2token


def test_tokenizer_bytes_match_vocab(tok: WorldTokenizer) -> None:
    vocab = read_vocab(VOCAB_PATH)
    for i, b in vocab.items():
        assert tok.decode_bytes([i]) == b


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("1 'a' 2\n", "length field"),
        ("1 __import__('os').system('false') 1\n", "cannot parse"),
        ("1 'a'\n", "expected"),
        ("0 'a' 1\n", "outside"),
        ("1 'a' 1\n1 'b' 1\n1 'c' 1\n", "duplicate id"),
        ("1 123 3\n", "str or bytes"),
        ("1 'a' 1\n", "expected 65529 tokens"),
    ],
)
def test_read_vocab_rejects_bad_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "vocab.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_vocab(path)


# --- decode errors -----------------------------------------------------------


@pytest.mark.parametrize("bad", [65530, -1, 10**9])
def test_decode_rejects_unknown_ids(tok: WorldTokenizer, bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        tok.decode_bytes([1, bad])
    with pytest.raises(ValueError, match=str(bad)):
        tok.decode([bad])
    with pytest.raises(ValueError, match=str(bad)):
        IncrementalDecoder(tok).push(bad)


def test_decode_errors_argument(tok: WorldTokenizer) -> None:
    ids = tok.encode_bytes(b"ok\xff")
    assert tok.decode(ids) == "ok\ufffd"
    assert tok.decode(ids, errors="ignore") == "ok"
    with pytest.raises(UnicodeDecodeError):
        tok.decode(ids, errors="strict")


# --- incremental decoding ---------------------------------------------------------


def _stream(tok: WorldTokenizer, ids: list[int]) -> list[str]:
    dec = IncrementalDecoder(tok)
    return [dec.push(i) for i in ids] + [dec.flush()]


def test_incremental_random_sequences(tok: WorldTokenizer, partial_utf8_ids: list[int]) -> None:
    rng = random.Random(4242)
    byte_ids = tok.encode_bytes(bytes(range(256)))
    for _ in range(2000):
        ids = []
        for _ in range(rng.randint(0, 30)):
            r = rng.random()
            if r < 0.4:
                ids.append(rng.choice(partial_utf8_ids))
            elif r < 0.6:
                ids.append(rng.choice(byte_ids))
            elif r < 0.65:
                ids.append(EOD_TOKEN)
            else:
                ids.append(rng.randint(0, 65529))
        expected = tok.decode_bytes(ids).decode("utf-8", errors="replace")
        assert "".join(_stream(tok, ids)) == expected


def test_incremental_valid_stream_never_replaces(tok: WorldTokenizer) -> None:
    rng = random.Random(777)
    texts = [CORPUS[k] for k in sorted(CORPUS)]
    texts += [_random_unicode(rng, rng.randint(1, 80)).replace("\ufffd", "?") for _ in range(300)]
    for text in texts:
        data = text.encode("utf-8")
        # Both the real tokenization and one token per byte (worst case for splitting).
        per_byte = [tok.encode_bytes(data[i : i + 1])[0] for i in range(len(data))]
        for ids in (tok.encode(text), per_byte):
            dec = IncrementalDecoder(tok)
            emitted = ""
            pushed = b""
            for i in ids:
                piece = dec.push(i)
                assert "\ufffd" not in piece
                emitted += piece
                pushed += tok.decode_bytes([i])
                # Only an incomplete trailing character (at most 3 bytes) may be held back.
                held = pushed[len(emitted.encode("utf-8")) :]
                assert pushed.startswith(emitted.encode("utf-8"))
                assert len(held) <= 3
                if held:
                    with pytest.raises(UnicodeDecodeError, match="unexpected end of data"):
                        held.decode("utf-8")
            assert dec.flush() == ""
            assert emitted == text


def test_incremental_flush_incomplete_tail(tok: WorldTokenizer) -> None:
    dec = IncrementalDecoder(tok)
    first, second = tok.encode("🙂")
    assert dec.push(first) == ""
    assert dec.flush() == tok.decode_bytes([first]).decode("utf-8", errors="replace") == "\ufffd"
    # After a flush the decoder starts a fresh stream.
    assert dec.push(tok.encode("a")[0]) == "a"
    assert dec.flush() == ""
    assert _stream(tok, [first, second]) == ["", "🙂", ""]


def test_incremental_invalid_continuation(tok: WorldTokenizer) -> None:
    # 0xE4 starts a 3-byte character; "A" cannot continue it, so it becomes U+FFFD at once.
    ids = tok.encode_bytes(b"\xe4") + tok.encode_bytes(b"A")
    dec = IncrementalDecoder(tok)
    assert dec.push(ids[0]) == ""
    assert dec.push(ids[1]) == "\ufffdA"
    assert dec.flush() == ""
