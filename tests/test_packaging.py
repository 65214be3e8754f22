"""What `pip install .` reads from pyproject.toml builds without a warning (issue 45: a
`project.license` table printed setuptools' deprecation box twice on every install)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
FIRST_SPDX_SETUPTOOLS = 77  # the first setuptools that takes project.license as an SPDX expression


def test_the_license_is_an_spdx_expression_and_the_build_takes_it() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    # pip's build isolation installs what build-system.requires says: one that takes the string
    # (an older one refuses it; a table is what warns).
    (setuptools,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    found = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert found and int(found.group(1)) >= FIRST_SPDX_SETUPTOOLS, setuptools
    # A license classifier beside an SPDX license is an error in setuptools >= 77.
    assert not [c for c in PYPROJECT["project"].get("classifiers", []) if c.startswith("License ::")]
