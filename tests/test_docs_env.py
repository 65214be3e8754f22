"""Every environment name the README and docs mention is a setting meshd takes (in the help of
`meshd serve`, the adapters or the operator CLI) or one meshd names on purpose: upstream's
settings it ignores with a warning, and the few its tests and model files read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from meshd.config import UPSTREAM_IGNORED

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"\b((?:MM|MESHD)_[A-Z0-9_]*[A-Z0-9])\b")
HELPS = (
    ["serve", "--help"],
    ["adapter", "--help"],
    ["llm-runtime", "--help"],
    ["pull", "--help"],
    ["models", "--help"],
    ["models", "register", "--help"],
    ["instances", "--help"],
)
# Read by the test harness and by the Triton model files meshd writes, not by a meshd command.
NOT_SETTINGS = {"MESHD_NETFAULTS_REPORT", "MESHD_TRITON_SITE"}


def mentioned() -> dict[str, str]:
    found: dict[str, str] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in NAME.findall(doc.read_text(encoding="utf-8")):
            found.setdefault(name, doc.name)
    return found


def test_every_environment_name_in_the_docs_is_a_setting() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    helps = "".join(
        subprocess.run([sys.executable, "-m", "meshd", *cmd], capture_output=True, text=True, env=env).stdout
        for cmd in HELPS
    )
    assert "MM_SVC_GRPC_PORT" in helps and "MESHD_JOIN" in helps and "MESHD_PORTS" in helps
    unknown = {
        name: doc
        for name, doc in mentioned().items()
        if name not in helps and name not in UPSTREAM_IGNORED and name not in NOT_SETTINGS
    }
    assert not unknown, f"named in the docs, taken by no meshd command: {unknown}"
