"""OpenAI messages -> RWKV chat text (spec §3.3), and splitting a thinking reply into reasoning and answer.

Layout: ``System: …`` first, then ``User: …`` / ``Assistant: …`` turns joined by a blank line,
then the generation cue. Unlike the peer server we keep each message's interior indentation
and blank lines (code and Markdown would otherwise be mangled); only line endings are
normalized and the message is trimmed at both ends. A blank line inside a message therefore
looks like RWKV's turn separator to the model; that is the trade-off the fork also made, and
the turn stops below only fire on a following ``User:``, so a reply may contain blank lines.

Sessions continue a stored state instead of re-sending the history: the state ends where the
assistant's visible reply ends, and the next turn is the new messages rendered the same way,
after ``TURN_SEPARATOR`` (``"\n\nUser: …\n\nAssistant: <think>\n</think>\n"``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from infer.api.schemas import ChatMessage, ContentPart

# The model ends its turn by starting the next user turn; the longer form comes first so a
# reply never ends with the separator's first newline.
TURN_STOPS = ("\n\nUser:", "\nUser:")
CUE_FAST = "\n\nAssistant: <think>\n</think>\n"   # empty, closed think block: answer directly
CUE_THINK = "\n\nAssistant: <think"               # the model writes ">", its reasoning, "</think>", the answer
THINK_END = "</think>"
TURN_SEPARATOR = "\n\n"                           # between a stored reply and the next turn
CUE_SHARED = "\n\nAssistant:"                      # what the cue has in common with a rendered reply

_SYSTEM_ROLES = ("system", "developer")
_TURN_LABELS = {"user": "User", "assistant": "Assistant"}  # tool / function turns are not rendered


def message_text(content: str | Sequence[str | ContentPart] | None) -> str:
    """Text of a message: strings and ``text`` parts; images and other parts are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        parts = [content]
    else:
        parts = [p if isinstance(p, str) else (p.text or "") for p in content
                 if isinstance(p, str) or p.type == "text"]
    return "".join(parts).replace("\r\n", "\n").replace("\r", "\n").strip()


@dataclass(frozen=True)
class RenderedChat:
    text: str
    # Character offsets where a later prompt of the same conversation (history re-sent) is likely
    # to diverge from this one: the end of the system block, and the end of "Assistant:" before
    # every assistant message and before the cue (the next turn has the reply where the cue has its
    # think block). Prefix-cache hints.
    boundaries: tuple[int, ...] = ()


def render_chat(messages: Sequence[ChatMessage], system: str | None = None, extra_user: str | None = None,
                enable_think: bool = False) -> str:
    """The prompt for ``messages``; returns "" when no message has any text."""
    return render_chat_parts(messages, system, extra_user, enable_think).text


def render_chat_parts(messages: Sequence[ChatMessage], system: str | None = None, extra_user: str | None = None,
                      enable_think: bool = False) -> RenderedChat:
    """``render_chat`` with the prefix boundaries of the result."""
    system_parts = [message_text(system)] if system else []
    system_parts += [message_text(m.content) for m in messages if m.role in _SYSTEM_ROLES]
    system_text = "\n".join(p for p in system_parts if p)
    turns = [(_TURN_LABELS[m.role], text) for m in messages
             if m.role in _TURN_LABELS and (text := message_text(m.content))]
    if extra_user and (text := message_text(extra_user)):
        turns.append(("User", text))
    if not turns and not system_text:
        return RenderedChat("")
    text, boundaries = (f"System: {system_text}", [len("System: ") + len(system_text)]) if system_text else ("", [])
    for label, message in turns:
        text += ("\n\n" if text else "") + f"{label}:"
        if label == "Assistant":
            boundaries.append(len(text))
        text += f" {message}"
    boundaries.append(len(text) + len(CUE_SHARED))
    return RenderedChat(text + (CUE_THINK if enable_think else CUE_FAST), tuple(boundaries))


class ThinkSplitter:
    """Incrementally split what follows ``CUE_THINK`` into (reasoning, answer).

    The leading ``>`` that closes the opening tag is dropped, the reasoning and the answer are
    trimmed of surrounding whitespace, and ``</think>`` itself is not returned. Feeding text in
    any pieces gives the same concatenated result as feeding it at once, so streaming and
    non-streaming responses agree. A reply that never closes the block is all reasoning.
    """

    def __init__(self) -> None:
        self._opened = False     # the leading ">" has been handled
        self._answering = False  # past </think>
        self._held = ""          # text that may be whitespace to trim or the start of </think>
        self._started = False    # the current section has shown a non-space character

    def push(self, text: str) -> tuple[str, str]:
        held = self._held + text
        if not self._opened:
            if not held:
                return "", ""
            self._opened = True
            held = held[1:] if held.startswith(">") else held
        if self._answering:
            self._held = ""
            return "", self._lead(held)
        end = held.find(THINK_END)
        if end >= 0:
            reasoning = self._lead(held[:end].rstrip())
            self._answering, self._started = True, False
            self._held = ""
            return reasoning, self._lead(held[end + len(THINK_END):])
        partial = next((k for k in range(min(len(THINK_END) - 1, len(held)), 0, -1)
                        if THINK_END.startswith(held[-k:])), 0)
        body = held[:len(held) - partial]
        kept = len(body.rstrip())
        self._held = held[kept:]
        return self._lead(body[:kept]), ""

    def flush(self) -> tuple[str, str]:
        """The row ended: release what was held back (an unfinished ``</think>`` is reasoning text)."""
        held, self._held = self._held, ""
        if self._answering or not self._opened:
            return "", ""
        return self._lead(held.rstrip()), ""

    def _lead(self, text: str) -> str:
        """Drop whitespace at the start of a section."""
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text
