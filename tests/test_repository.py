"""The repository itself: no leftovers of an unfinished merge in any tracked text file."""

import subprocess

from tests.conftest import ROOT

MARKERS = ("<<<<<<< ", ">>>>>>> ")


def test_no_merge_conflict_markers_are_committed():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    leftovers = []
    for name in tracked:
        try:
            lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        leftovers += [f"{name}:{number}" for number, line in enumerate(lines, 1) if line.startswith(MARKERS)]
    assert not leftovers, f"unresolved merge conflicts at {leftovers}"
