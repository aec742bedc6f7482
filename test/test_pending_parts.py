"""bench/h200_pending.sh's parts: each part its header lists is a label of its case statement, each label is listed,
and no label appears twice (bash runs the first of two, silently)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "h200_pending.sh"


def test_listed_parts_are_the_case_labels():
    text = SCRIPT.read_text()
    labels = Counter(re.findall(r"^([a-z0-9][a-z0-9.-]*)\)", text, re.M))
    listed = set(re.findall(r"^#\s+\. bench/gpu_env\.sh && bash bench/h200_pending\.sh ([a-z0-9.-]+)", text, re.M))
    assert not [label for label, n in labels.items() if n > 1], "a part label appears twice"
    assert listed - set(labels) == set(), "listed parts without a case"
    assert set(labels) - listed == set(), "parts not listed at the top"
