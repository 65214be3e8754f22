"""README.md as a front door: the two commands first, a size a reader takes in, every page it
links present. Quick on purpose (the README's blocks themselves run in the slow
tests/integration/test_docs_run.py and test_quickstart.py), so a row that outgrows the page
fails a quick run, not only CI."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 15 * 1024
    first = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == [
        "python3 scripts/dev.py demo",
        "python3 scripts/dev.py test",
    ]
    for doc in re.findall(r"\]\((docs/[a-z]+\.md|CHANGELOG\.md)\)", text):
        assert (README.parent / doc).is_file(), doc
