"""docs/simulator.md's shell blocks, run as a reader runs them (meshd.testing.docs): in order,
as written, in one shell session in the repository, each with a time limit; the figures the page
quotes are the ones they print (the simulator is deterministic for a seed)."""

from __future__ import annotations

import sys
from pathlib import Path

from meshd.testing.docs import reader_env, run_blocks, shell_blocks

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "simulator.md"
LIMIT_S = 60.0  # per block: each takes under a second of CPU
PRINTED_AND_QUOTED = (
    ("| load | median | 150 | 424 | 61% | 64/55/63 | 0 |", "| load | median | 150 | 424 | 61% | 64/55/63 |"),
    ("| inflight | median | 150 | 569 | 34% | 70/60/50 | 0 |", "| inflight | median | 150 | 569 | 34% | 70/60/50 |"),
    (
        "| load | 3 | 150 | 338 | 61% | 70/57/53 | 0 |",
        "| 424 / 468 / 338 | 63% / 52% / 61% | 59/55/66, 64/53/63, 70/57/53 |",
    ),
    (
        "| load | 1 | 2660 | 15951 | 45% | 373/200/27 | 2 (at 20, 60 s) |",
        "| load | 2660 / 1724 / 644 | 15951 / 14816 / 12496 | 45% / 48% / 47% | 373/200/27 |",
    ),
    (
        "| inflight | 3 | 771 | 12496 | 39% | 388/212 | 1 (at 20 s) |",
        "| inflight | 3175 / 2525 / 771 | 15951 / 14816 / 12496 | 34% / 36% / 39% | 371/190/39 |",
    ),
)


def test_the_simulator_page_runs_as_written_and_its_figures_are_printed(tmp_path: Path) -> None:
    text = PAGE.read_text()
    blocks = shell_blocks(text)
    (ran,) = run_blocks(blocks, REPO, reader_env(tmp_path / "home", Path(sys.executable).parent), LIMIT_S)
    # The runs' rows (printed) as the page quotes them.
    for printed, quoted in PRINTED_AND_QUOTED:
        assert printed in ran.output, printed
        assert quoted in text, quoted
