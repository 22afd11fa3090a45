"""The library's docs pages cannot go stale: every parameter of every public entry point is
named (in backticks) on its page under ``docs/library/``, and the pages are linked from
``docs/kernels.md`` and the README. (Their examples run in ``tests/test_docs.py``.)"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from kiln.kernels import attention, gemm

ROOT = Path(__file__).resolve().parents[1]
PAGES = {
    "prefill.md": (attention.prefill, attention.compile_prefill),
    "decode.md": (attention.decode, attention.decode_attention, attention.mla_decode,
                  attention.compile_mla_decode),
    "combine.md": (attention.combine, attention.compile_combine),
    "matmul.md": (gemm.matmul, gemm.grouped_matmul, gemm.matmul_config, gemm.compile_matmul,
                  gemm.compile_grouped_matmul),
}


def undocumented(text: str, fn) -> list[str]:
    """``fn``'s name and parameters (``**kwargs`` excepted) that ``text`` never names in
    backticks, alone or as the start of a code span (``name=...``, ``name(...``)."""
    names = [fn.__name__] + [p.name for p in inspect.signature(fn).parameters.values()
                             if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return [n for n in names if not re.search(rf"`{re.escape(n)}\b", text)]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_argument_of_an_entry_point_is_on_its_page(page):
    text = (ROOT / "docs" / "library" / page).read_text()
    missing = {fn.__name__: undocumented(text, fn) for fn in PAGES[page]}
    assert not any(missing.values()), f"docs/library/{page} never names {missing}"


def test_the_check_sees_a_missing_argument():
    def entry(q, *, brand_new_option=None, **config):
        """A stand-in entry point."""

    assert undocumented("`entry(q)`: `q` the queries", entry) == ["brand_new_option"]
    assert undocumented("`entry` `q` `brand_new_option=1`", entry) == []


@pytest.mark.parametrize("index", ["docs/kernels.md", "README.md"])
def test_the_pages_are_linked(index):
    text = (ROOT / index).read_text()
    prefix = "library/" if index.startswith("docs/") else "docs/library/"
    assert [p for p in PAGES if f"({prefix}{p}" not in text] == []
