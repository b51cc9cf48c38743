"""The repository as files: a clone works on a case-insensitive file system (macOS's and Windows's default), where
two paths that differ only by case are one."""

from __future__ import annotations

import subprocess
import sys

from helpers.paths import REPO as ROOT


def _tracked() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [path for path in listed.decode().split("\0") if path]


def test_no_two_paths_differ_only_by_case():
    paths = set()
    for path in _tracked():  # each file and every folder above it
        parts = path.split("/")
        paths.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    by_folded: dict[str, set[str]] = {}
    for path in paths:
        by_folded.setdefault(path.casefold(), set()).add(path)
    assert [sorted(same) for same in by_folded.values() if len(same) > 1] == []


def test_the_original_import_works():
    """``from BagPipe import init_cache``, as the original system's scripts write it, in a fresh interpreter."""
    code = "from BagPipe import init_cache, TrainerCache; import bagpipe; assert init_cache is bagpipe.init_cache"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
