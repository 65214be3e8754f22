"""Throwaway virtualenvs for running third-party clients (tritonclient, MLServer, ...) in tests.

Such clients pin their own dependencies (tritonclient wants protobuf < 7), so they never go
into meshd's venv: each gets its own, built on first use and kept for later runs under
`<repo>/.venvs/<name>-<hash>/` in a checkout, else (meshd installed: never inside site-packages)
under `$XDG_CACHE_HOME/meshd/venvs` (`~/.cache/meshd/venvs`); the hash covers the requirements
and the Python version.
A marker file, written only after pip succeeded, marks a venv complete; a venv without it
(an interrupted install) is removed and built again. An fcntl lock around the build keeps
two processes (pytest-xdist workers, two test runs) from building the same venv at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

MARKER = ".meshd-venv-complete"


def default_root(above_package: Path, env: Mapping[str, str]) -> Path:
    """Where venvs go: `.venvs` of the checkout holding the package, or (an installed meshd,
    whose folder above the package is site-packages) the user's cache."""
    if (above_package / "pyproject.toml").is_file() and (above_package / "meshd").is_dir():
        return above_package / ".venvs"
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "meshd" / "venvs"


DEFAULT_ROOT = default_root(Path(__file__).resolve().parents[2], os.environ)
INSTALL_TIMEOUT_S = 900.0
_ERROR_TAIL_LINES = 30


def venv_dir(
    name: str, requirements: Sequence[str], root: Path = DEFAULT_ROOT, pip_options: Sequence[str] = ()
) -> Path:
    """Where the venv for `name` with `requirements` lives (whether built or not)."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad venv name {name!r}")
    spec: dict[str, object] = {"python": list(sys.version_info[:2]), "requirements": list(requirements)}
    if pip_options:  # only when given, so the venvs built before this option keep their names
        spec["pip_options"] = list(pip_options)
    key = json.dumps(spec)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return root / f"{name}-{digest}"


def venv_python(directory: Path) -> Path:
    return directory / "bin" / "python"


def ensure_venv(
    name: str,
    requirements: Sequence[str],
    *,
    root: Path = DEFAULT_ROOT,
    timeout_s: float = INSTALL_TIMEOUT_S,
    pip_options: Sequence[str] = (),
) -> Path:
    """The python executable of a venv holding `requirements`, built first if needed.

    `pip_options` go to `pip install` before the requirements (e.g. `--no-deps`, for a wheel
    whose declared dependencies are not needed for what the venv is used for).

    RuntimeError (with the tail of pip's stderr) if the venv cannot be built; the half-built
    venv is left unmarked, so the next call starts again from scratch.
    """
    directory = venv_dir(name, requirements, root, pip_options)
    python = venv_python(directory)
    if _complete(directory):
        return python
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _complete(directory):  # another process built it while we waited
            return python
        if directory.exists():
            shutil.rmtree(directory)
        _run([sys.executable, "-m", "venv", str(directory)], "create the venv", directory, timeout_s)
        if requirements:
            pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input"]
            _run([*pip, *pip_options, *requirements], f"pip install {' '.join(requirements)}", directory, timeout_s)
        (directory / MARKER).write_text(json.dumps({"requirements": list(requirements)}) + "\n", encoding="utf-8")
    return python


def _complete(directory: Path) -> bool:
    return (directory / MARKER).is_file() and venv_python(directory).exists()


def _run(argv: list[str], what: str, directory: Path, timeout_s: float) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{directory.name}: could not {what}: timed out after {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        output = proc.stderr.strip() or proc.stdout.strip()
        tail = "\n".join(output.splitlines()[-_ERROR_TAIL_LINES:])
        raise RuntimeError(f"{directory.name}: could not {what} (exit {proc.returncode}):\n{tail}")
