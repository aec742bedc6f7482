"""Stop-string detection over streamed text, with the least possible holdback.

Each stop string is matched with its own Knuth-Morris-Pratt automaton, one character at a
time, so strings of any length are found across token boundaries and inside a token, and
the text held back is exactly the longest suffix that could still become a stop string.
"""
from __future__ import annotations

from dataclasses import dataclass


def _failure_table(pattern: str) -> list[int]:
    table = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = table[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        table[i] = k
    return table


@dataclass
class StopResult:
    text: str        # text that may be shown now
    stopped: bool    # a stop string was found; ``text`` ends right before it
    stop: str | None = None  # which one


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]   # empty strings would match everywhere
        self._tables = [_failure_table(s) for s in self.stops]
        self._matched = [0] * len(self.stops)
        self._held = ""  # text received but not yet released: a possible start of a stop string

    def push(self, text: str) -> StopResult:
        """Feed newly decoded text; returns what can be released (and whether a stop was hit)."""
        if not self.stops:
            return StopResult(text, False)
        held = self._held + text
        base = len(self._held)
        for offset, ch in enumerate(text):
            for n, stop in enumerate(self.stops):
                k = self._matched[n]
                table = self._tables[n]
                while k and ch != stop[k]:
                    k = table[k - 1]
                if ch == stop[k]:
                    k += 1
                if k == len(stop):
                    end = base + offset + 1
                    self._held = ""
                    return StopResult(held[: end - len(stop)], True, stop)
                self._matched[n] = k
        keep = max(self._matched)
        self._held = held[len(held) - keep:] if keep else ""
        return StopResult(held[: len(held) - keep], False)

    def flush(self) -> str:
        """At the end of generation (no stop hit) the held-back text is released."""
        held, self._held = self._held, ""
        return held
