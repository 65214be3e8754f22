"""Every shell block shipped in the README and docs is run by a test, as written and in order
(meshd.testing.docs), or its fence says why not: a page that gains a ```bash block no test runs
fails here, so "the docs don't run as written" cannot come back unseen."""

from __future__ import annotations

from pathlib import Path

from meshd.testing.docs import fences, shell_blocks

ROOT = Path(__file__).resolve().parent.parent
# Each page with shell blocks to run -> the test that runs them all, in order.
RUN_BY = {
    "README.md": "tests/integration/test_docs_run.py",
    "docs/kserve.md": "tests/integration/test_docs_kserve.py",
    "docs/llm.md": "tests/llm/test_docs_llm.py",
    "docs/native.md": "tests/integration/test_docs_native.py",
    "docs/runtimes.md": "tests/integration/test_docs_runtimes.py",
    "docs/simulator.md": "tests/sim/test_docs_simulator.py",
    "docs/storage.md": "tests/storage/test_docs_storage.py",
}


def shipped() -> list[Path]:
    return [*sorted(ROOT.glob("*.md")), *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_page_with_shell_blocks_is_run_by_a_test() -> None:
    pages = {p.relative_to(ROOT).as_posix() for p in shipped() if shell_blocks(p.read_text(encoding="utf-8"))}
    assert pages == set(RUN_BY), "a page with shell blocks needs a test that runs them (or a block says why not)"
    for page, test in RUN_BY.items():
        source = (ROOT / test).read_text(encoding="utf-8")
        assert "run_blocks(" in source and Path(page).name in source, f"{test} does not run {page}"
        assert test in (ROOT / page).read_text(encoding="utf-8"), f"{page} does not say {test} runs it"


def test_every_fence_names_its_language() -> None:
    """A fence with no language could be shell no test runs: each says ```bash, ```text, ..."""
    unnamed = [
        f"{p.relative_to(ROOT)}:{f.line}"
        for p in shipped()
        for f in fences(p.read_text(encoding="utf-8"))
        if not f.language
    ]
    assert not unnamed, unnamed
