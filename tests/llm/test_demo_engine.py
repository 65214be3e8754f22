"""`meshd demo --runtime llamacpp --engine-python P` with a venv that cannot serve the demo: one
clear message naming what is missing and how to add it, exit 2, nothing started. docs/llm.md's
venv (llama-cpp-python[server] alone) lacked gguf, which the demo writes its models with: the
demo started etcd, then failed with a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshd.testing.llm import ENGINE_HINT, engine_problem


def bare_venv(where: Path, packages: tuple[str, ...] = ()) -> Path:
    """A venv with no pip, holding only empty packages of these names (stand-ins: only found, never run)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    for name in packages:
        (Path(site) / name).mkdir(parents=True)
        (Path(site) / name / "__init__.py").write_text("")
    return python


@pytest.mark.parametrize(
    ("packages", "missing"),
    [((), "llama_cpp, uvicorn, gguf"), (("llama_cpp", "uvicorn"), "gguf")],  # the second: docs/llm.md's venv
)
def test_the_demo_says_what_the_engine_venv_lacks(tmp_path: Path, packages: tuple[str, ...], missing: str) -> None:
    python = bare_venv(tmp_path / "venv", packages)
    assert engine_problem(python) == f"{python}'s environment lacks {missing}; {ENGINE_HINT} into it"
    argv = [sys.executable, "-m", "meshd", "demo", "--runtime", "llamacpp", "--engine-python", str(python)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"lacks {missing}; {ENGINE_HINT} into it" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "etcd" not in proc.stdout  # nothing was started


def test_a_python_that_does_not_run_is_said_so(tmp_path: Path) -> None:
    assert (engine_problem(tmp_path / "nothing") or "").startswith(f"cannot run {tmp_path / 'nothing'}: ")
