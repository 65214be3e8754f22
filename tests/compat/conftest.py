"""The `mm` container's meshd comes from a plain `pip install` of this checkout (no extras, not
editable), as a pip user following docs/upstream.md gets it: the controller's defaults must
work from that, not only from the dev venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 800


@pytest.fixture(scope="session")
def plain_meshd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `bin` folder of a venv made for this session holding a plain install of meshd."""
    venv = tmp_path_factory.mktemp("plain-install") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    done = subprocess.run(
        [*pip, "install", "--quiet", str(ROOT)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    listed = subprocess.run([*pip, "list"], capture_output=True, text=True, timeout=60, check=True).stdout
    assert "grpcio-tools" not in listed and "pytest" not in listed, "a plain install, not the dev one"
    return venv / "bin"
