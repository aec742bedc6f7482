"""RWKV "World" tokenizer (vocab rwkv_vocab_v20230424) without the `rwkv` package.

Encoding is greedy longest-match over UTF-8 bytes, identical to the reference
TRIE_TOKENIZER: at each position take the longest vocabulary entry that is a
prefix of the remaining bytes. Token 0 is not in the vocabulary; it marks the
end of a document.
"""

from __future__ import annotations

import ast
import codecs
import functools
import os
from collections.abc import Iterable
from pathlib import Path

EOD_TOKEN = 0
VOCAB_PATH = Path(__file__).resolve().parent.parent / "third_party" / "rwkv_vocab_v20230424.txt"

# Ids 1..65529 are vocabulary entries; 0 is EOD.
_MAX_ID = 65529

# A trie node is (children, best): children maps the next byte to a child node;
# best is (token id, length in bytes) of the longest vocabulary entry that is a
# prefix of the node's path. Storing `best` on every node (inherited from the
# parent when the node itself is not a token) lets the encode loop do a single
# dict lookup and tuple unpack per byte, with no "is this a token?" branch.
_Node = tuple[dict[int, "_Node"], tuple[int, int]]


def read_vocab(path: str | os.PathLike[str] = VOCAB_PATH) -> dict[int, bytes]:
    """Parse a World vocab file (`<id> <python literal> <byte length>` per line) into id -> bytes."""
    vocab: dict[int, bytes] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line:
                continue
            # The literal may itself contain spaces, so split on the first and last one.
            first, last = line.find(" "), line.rfind(" ")
            if first < 0 or first == last:
                raise ValueError(f"{path}:{lineno}: expected '<id> <literal> <length>'")
            try:
                idx = int(line[:first])
                length = int(line[last + 1 :])
                # literal_eval only accepts literals, so a hostile vocab file cannot run code.
                value = ast.literal_eval(line[first + 1 : last])
            except (ValueError, TypeError, SyntaxError, RecursionError) as e:
                raise ValueError(f"{path}:{lineno}: cannot parse line: {e}") from None
            if isinstance(value, str):
                value = value.encode("utf-8")
            if not isinstance(value, bytes) or not value:
                raise ValueError(f"{path}:{lineno}: token must be a non-empty str or bytes literal")
            if len(value) != length:
                raise ValueError(f"{path}:{lineno}: token is {len(value)} bytes, length field says {length}")
            if not 1 <= idx <= _MAX_ID:
                raise ValueError(f"{path}:{lineno}: id {idx} outside 1..{_MAX_ID}")
            if idx in vocab:
                raise ValueError(f"{path}:{lineno}: duplicate id {idx}")
            vocab[idx] = value
    if len(vocab) != _MAX_ID:
        raise ValueError(f"{path}: expected {_MAX_ID} tokens, found {len(vocab)}")
    return vocab


class WorldTokenizer:
    """Greedy longest-match byte tokenizer for the RWKV World vocabulary."""

    EOD_TOKEN = EOD_TOKEN

    def __init__(self, path: str | os.PathLike[str] = VOCAB_PATH) -> None:
        vocab = read_vocab(path)
        token_to_id = {v: k for k, v in vocab.items()}
        if len(token_to_id) != len(vocab):
            raise ValueError(f"{path}: vocabulary contains duplicate tokens")
        missing = [b for b in range(256) if bytes((b,)) not in token_to_id]
        if missing:
            # Without every single byte, some inputs would have no tokenization.
            raise ValueError(f"{path}: single-byte tokens missing for bytes {missing}")

        # Token 0 decodes to nothing so EOD can sit inside a decoded stream.
        self._id_to_bytes: dict[int, bytes] = {EOD_TOKEN: b"", **vocab}
        self._max_len = max(map(len, token_to_id))
        self._roots = self._build_trie(token_to_id)

    @staticmethod
    def _build_trie(token_to_id: dict[bytes, int]) -> list[_Node]:
        """Build the trie over all token prefixes; return the 256 first-byte nodes."""
        prefixes = {t[:j] for t in token_to_id for j in range(1, len(t))}
        prefixes.update(token_to_id)
        root: dict[int, _Node] = {}
        nodes: dict[bytes, tuple[dict[int, _Node], tuple[int, int] | None]] = {b"": (root, None)}
        # Parents (shorter prefixes) are created before children, so `best` can be inherited.
        for p in sorted(prefixes, key=len):
            parent_children, parent_best = nodes[p[:-1]]
            tid = token_to_id.get(p)
            node = ({}, (tid, len(p)) if tid is not None else parent_best)
            nodes[p] = node
            parent_children[p[-1]] = node
        # A list indexed by the first byte is cheaper than a dict lookup on the hot path.
        return [root[b] for b in range(256)]

    @property
    def vocab_size(self) -> int:
        """Number of meaningful ids (0..vocab_size-1), including EOD."""
        return _MAX_ID + 1

    def encode(self, text: str) -> list[int]:
        """Tokenize `text` (UTF-8 encoded first)."""
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Tokenize raw bytes by greedy longest match."""
        src = bytes(data)
        roots = self._roots
        window = self._max_len
        out: list[int] = []
        append = out.append
        i = 0
        n = len(src)
        while i < n:
            # Every byte is a token, so the first step always succeeds and `best` is set.
            children, best = roots[src[i]]
            # Iterating a bounded slice is faster than indexing src[j] with a counter;
            # no token is longer than `window`, so the walk never needs more bytes.
            for c in src[i + 1 : i + window]:
                node = children.get(c)
                if node is None:
                    break
                children, best = node
            append(best[0])
            i += best[1]
        return out

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenate the bytes of `ids`; EOD (0) contributes nothing."""
        try:
            return b"".join(map(self._id_to_bytes.__getitem__, ids))
        except KeyError as e:
            raise ValueError(
                f"token id {e.args[0]!r} is not in the vocabulary (valid ids are 0..{_MAX_ID})"
            ) from None

    @functools.cached_property
    def token_texts(self) -> dict[int, str]:
        """Text of every id whose bytes are complete, valid UTF-8 (most of them; EOD is "")."""
        texts = {}
        for token_id, data in self._id_to_bytes.items():
            try:
                texts[token_id] = data.decode("utf-8")
            except UnicodeDecodeError:
                pass
        return texts

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """Decode `ids` to text; invalid UTF-8 is handled per `errors` (as in bytes.decode)."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)


class IncrementalDecoder:
    """Streaming detokenizer that never splits a UTF-8 character across outputs.

    The concatenation of all `push` results and the final `flush` equals
    `tokenizer.decode(all_ids)` with errors="replace": bytes of an incomplete
    character at the end are held back until they complete or can no longer
    complete, in which case they become U+FFFD just as a whole-stream decode would.
    """

    def __init__(self, tokenizer: WorldTokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts = tokenizer.token_texts
        # The stdlib incremental UTF-8 decoder buffers only an incomplete trailing
        # sequence and replaces invalid bytes exactly like bytes.decode(errors="replace").
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if not self._decoder.buffer:  # nothing pending: a token of whole characters is its own text
            text = self._texts.get(token_id)
            if text is not None:
                return text
        return self._decoder.decode(self._tokenizer.decode_bytes((token_id,)))

    def flush(self) -> str:
        """Emit any held-back bytes (as U+FFFD) and reset for a new stream."""
        return self._decoder.decode(b"", final=True)


@functools.cache
def load_world_tokenizer() -> WorldTokenizer:
    """Return the shared tokenizer for the vocab shipped in third_party/ (loaded once)."""
    return WorldTokenizer(VOCAB_PATH)
