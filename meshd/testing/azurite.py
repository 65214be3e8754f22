"""Azurite, Azure's storage emulator (npm), for the storage helper's Azure Blob tests: found in
`<repo>/.venvs/azurite-<version>/`, or installed there with npm on first use (a marker file
written after npm succeeded marks it complete; an fcntl lock keeps two installs apart)."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

from meshd.testing.venvs import DEFAULT_ROOT

AZURITE_VERSION = "3.35.0"
MARKER = ".meshd-npm-complete"
INSTALL_TIMEOUT_S = 600.0


def find_or_install(root: Path = DEFAULT_ROOT) -> Path | None:
    """The `azurite-blob` executable, or None when there is no node/npm to install it with."""
    directory = root / f"azurite-{AZURITE_VERSION}"
    binary = directory / "node_modules" / ".bin" / "azurite-blob"
    if (directory / MARKER).exists() and binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        return None
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (directory / MARKER).exists() and binary.exists():
            return binary
        directory.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [npm, "install", "--prefix", str(directory), "--no-audit", "--no-fund", f"azurite@{AZURITE_VERSION}"],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0 or not binary.exists():
            return None
        (directory / MARKER).write_text(AZURITE_VERSION + "\n")
    return binary
