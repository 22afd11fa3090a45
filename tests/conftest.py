"""Shared pytest fixtures (kept small)."""

from __future__ import annotations

import pytest


@pytest.fixture
def marker_line(request):
    """``marker_line("@bad-store")``: the 1-based line of the test file holding that marker.

    Error tests use it to check that ``err.loc.line`` points at the user's source line.
    """
    path = str(request.fspath)
    with open(path) as f:
        lines = f.read().splitlines()

    def find(marker: str) -> int:
        hits = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith("# " + marker)]
        assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times in {path}"
        return hits[0]

    return find
