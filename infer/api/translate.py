"""Text side of ``/translate/v1/batch-translate``: prompts, language names, a script-based guess for
``auto``, and the placeholders Immersive Translate puts in texts (``{0}``, ``<b0></b0>``).

Prompt (spec §3.1): ``"{Source}: {text}\\n\\n{Target}:"``; the model continues with the
translation. Unknown language codes are used verbatim as the label.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

LANGUAGE_NAMES = {
    "zh": "Chinese", "zh-cn": "Chinese", "zh-hans": "Chinese", "zh-sg": "Chinese",
    "zh-tw": "Traditional Chinese", "zh-hk": "Traditional Chinese", "zh-hant": "Traditional Chinese",
    "en": "English", "ja": "Japanese", "ko": "Korean", "fr": "French", "de": "German", "es": "Spanish",
    "ru": "Russian", "pt": "Portuguese", "pt-br": "Portuguese", "pt-pt": "Portuguese", "it": "Italian",
    "nl": "Dutch", "pl": "Polish", "tr": "Turkish", "ar": "Arabic", "fa": "Persian", "he": "Hebrew",
    "hi": "Hindi", "bn": "Bengali", "ur": "Urdu", "vi": "Vietnamese", "th": "Thai", "id": "Indonesian",
    "ms": "Malay", "fil": "Filipino", "uk": "Ukrainian", "be": "Belarusian", "bg": "Bulgarian",
    "cs": "Czech", "sk": "Slovak", "sl": "Slovenian", "hr": "Croatian", "sr": "Serbian", "ro": "Romanian",
    "hu": "Hungarian", "el": "Greek", "sv": "Swedish", "da": "Danish", "no": "Norwegian", "nb": "Norwegian",
    "fi": "Finnish", "et": "Estonian", "lv": "Latvian", "lt": "Lithuanian", "ca": "Catalan",
    "eu": "Basque", "gl": "Galician", "la": "Latin", "eo": "Esperanto", "sw": "Swahili", "ta": "Tamil",
    "te": "Telugu", "mr": "Marathi", "km": "Khmer", "lo": "Lao", "my": "Burmese", "mn": "Mongolian",
    "kk": "Kazakh", "uz": "Uzbek", "az": "Azerbaijani", "ka": "Georgian", "hy": "Armenian",
}

# First script found decides; Latin text (and anything else) is reported as English.
_SCRIPTS = [
    ("ja", re.compile(r"[\u3040-\u30ff]")),            # kana before Han: Japanese uses both
    ("ko", re.compile(r"[\uac00-\ud7af\u1100-\u11ff]")),
    ("zh-CN", re.compile(r"[\u4e00-\u9fff\u3400-\u4dbf]")),
    ("ru", re.compile(r"[\u0400-\u04ff]")),
    ("ar", re.compile(r"[\u0600-\u06ff]")),
    ("he", re.compile(r"[\u0590-\u05ff]")),
    ("el", re.compile(r"[\u0370-\u03ff]")),
    ("th", re.compile(r"[\u0e00-\u0e7f]")),
    ("hi", re.compile(r"[\u0900-\u097f]")),
]

_BUILTIN_PLACEHOLDERS = r"\{\d+\}|</?[A-Za-z]+\d+>"


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code.strip().lower(), code.strip())


def detect_language(text: str) -> str:
    return next((code for code, pattern in _SCRIPTS if pattern.search(text)), "en")


def translate_prompt(text: str, source: str, target: str) -> str:
    return f"{language_name(source)}: {text}\n\n{language_name(target)}:"


def stop_strings(source: str, target: str) -> list[str]:
    """The model starts a new pair after its translation; stop there (end of document also stops)."""
    return [f"\n\n{language_name(source)}:", f"\n\n{language_name(target)}:"]


class Placeholders:
    """Markers that must come back verbatim: built-in ``{N}`` / ``<tagN>`` forms plus client-given literals."""

    def __init__(self, extra: Iterable[str] = ()):
        literals = sorted(set(extra), key=len, reverse=True)
        self._pattern = re.compile("|".join([re.escape(s) for s in literals] + [_BUILTIN_PLACEHOLDERS]))

    def find(self, text: str) -> list[str]:
        return self._pattern.findall(text)

    def intact(self, source: str, translation: str) -> bool:
        return Counter(self.find(source)) == Counter(self.find(translation))

    def split(self, text: str) -> list[tuple[str, bool]]:
        """``text`` as (piece, is_marker) in order."""
        pieces, pos = [], 0
        for m in self._pattern.finditer(text):
            if m.start() > pos:
                pieces.append((text[pos:m.start()], False))
            pieces.append((m.group(), True))
            pos = m.end()
        if pos < len(text):
            pieces.append((text[pos:], False))
        return pieces


def keep_spacing(original: str, translated: str) -> str:
    """A translated fragment with the original's surrounding whitespace (it sits between markers)."""
    core = original.strip()
    lead = original[:len(original) - len(original.lstrip())]
    trail = original[len(lead) + len(core):]
    return lead + translated.strip() + trail
