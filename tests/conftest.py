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


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=None,
                     help="seed of the `rng` fixture (default: a fresh one per test, reported "
                          "with every failure)")


@pytest.fixture
def rng(request):
    """A ``numpy.random.Generator`` on a fresh seed (or ``--seed N``); a failing test reports
    the seed, so ``pytest --seed N <test id>`` reruns it on the same inputs."""
    import numpy as np

    seed = request.config.getoption("--seed")
    if seed is None:
        seed = int(np.random.SeedSequence().generate_state(1)[0])
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seeds = [value for key, value in item.user_properties if key == "seed"]
    if seeds and report.failed:
        report.sections.append(("random seed", f"rerun with: pytest --seed {seeds[0]} "
                                               f"'{item.nodeid}'"))
