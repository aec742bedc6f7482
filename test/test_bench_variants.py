"""The patches kept in bench/variants (rejected experiments, timing-only tools; see its README.md) stay usable: each is
listed in the README's table, each marked "tree" applies to the working tree (git apply --check), each of the others
to the tree of its commit (checked in a scratch index). Skipped outside a git checkout."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ROOT / "bench" / "variants"
ROW = re.compile(r"^\| (\S+\.patch) \| (\S+) \|", re.M)


def git(*args: str, index: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_INDEX_FILE": str(index)} if index is not None else None
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def listed() -> dict[str, str]:
    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    return dict(ROW.findall((VARIANTS / "README.md").read_text()))


def test_every_patch_is_listed(listed):
    assert sorted(listed) == sorted(p.name for p in VARIANTS.glob("*.patch"))


@pytest.mark.parametrize("patch", sorted(p.name for p in VARIANTS.glob("*.patch")))
def test_patch_applies_where_listed(listed, patch, tmp_path):
    base = listed.get(patch)
    if base is None:
        pytest.fail(f"{patch} is not listed in bench/variants/README.md")
    if base == "tree":
        done = git("apply", "--check", str(VARIANTS / patch))
        assert done.returncode == 0, f"{patch} no longer applies to the tree (regenerate it):\n{done.stderr}"
    else:
        if git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
            pytest.skip("a shallow clone: older commits are missing")
        assert git("cat-file", "-e", f"{base}^{{commit}}").returncode == 0, f"{patch}: no commit {base}"
        index = tmp_path / "index"
        assert git("read-tree", base, index=index).returncode == 0
        done = git("apply", "--cached", "--check", str(VARIANTS / patch), index=index)
        assert done.returncode == 0, f"{patch} does not apply to {base}:\n{done.stderr}"
