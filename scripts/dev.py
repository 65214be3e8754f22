#!/usr/bin/env python3
"""Bootstrap and run: needs only Python 3.11+ and pip (no make, no Docker).

    python3 scripts/dev.py demo [demo flags]   # set up .venv, run `meshd demo`
    python3 scripts/dev.py test [pytest args]  # set up .venv, lint, type-check, run every test
    python3 scripts/dev.py quick               # the same without the slow cluster/fault tests
    python3 scripts/dev.py bench [flags]       # bench/proxy_overhead.py
    python3 scripts/dev.py protos              # regenerate meshd/_proto

The virtual environment is created in .venv and reinstalled when pyproject.toml or constraints.txt changes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
STAMP = VENV / ".installed"
LINTED = ("meshd", "tests", "bench", "sim", "scripts")


def run(*argv: str | Path) -> None:
    print("+", " ".join(str(a) for a in argv), flush=True)
    done = subprocess.run([str(a) for a in argv], cwd=ROOT)
    if done.returncode != 0:
        sys.exit(done.returncode)


def ensure_venv() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - this runs under whatever python3 the user has
        sys.exit(f"meshd needs Python 3.11 or newer (this is {sys.version.split()[0]})")
    inputs = (ROOT / "pyproject.toml", ROOT / "constraints.txt")
    if STAMP.exists() and all(STAMP.stat().st_mtime >= f.stat().st_mtime for f in inputs):
        return
    if not (BIN / "python").exists():
        print(f"creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    run(BIN / "python", "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    run(BIN / "python", "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "-e", ".[dev]")
    STAMP.touch()


def main(argv: list[str]) -> None:
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__)
        return
    command, rest = argv[0], argv[1:]
    ensure_venv()
    py = BIN / "python"
    if command == "demo":
        run(BIN / "meshd", "demo", *rest)
    elif command in {"test", "quick"}:
        run(py, "-m", "ruff", "check", *[d for d in LINTED if (ROOT / d).is_dir()])
        run(py, "-m", "mypy", "meshd", "sim", "bench")
        marks = ["-m", "not slow"] if command == "quick" else []
        run(py, "-m", "pytest", *marks, *rest)
    elif command == "bench":
        run(py, "bench/proxy_overhead.py", *rest)
    elif command == "protos":
        run(py, "scripts/gen_protos.py", *rest)
    else:
        sys.exit(f"unknown command {command!r}; see `python3 scripts/dev.py --help`")


if __name__ == "__main__":
    os.chdir(ROOT)
    main(sys.argv[1:])
