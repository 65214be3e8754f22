"""An HAProxy for tests and benchmarks of the native data plane, found or fetched.

In order: MESHD_HAPROXY, `haproxy` on PATH, a copy fetched earlier, or (on Debian and its
derivatives) one fetched now without installing anything: `apt-get download` of the
package and the libraries a bare image lacks, unpacked under `<repo>/.venvs/haproxy-<arch>/`
with a wrapper that points the loader at them. As root, an empty package index is filled
first (`apt-get update`). None when no way works (not Debian, no apt); the caller says why.
"""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from meshd.testing.venvs import DEFAULT_ROOT

PACKAGES = ("haproxy", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1")
MARKER = ".meshd-haproxy-complete"
TIMEOUT_S = 300.0


def child_of(meshd_pid: int) -> int | None:
    """The pid of the HAProxy a meshd process runs (its native data plane), or None."""
    try:
        for task in Path(f"/proc/{meshd_pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                if Path(f"/proc/{child}/comm").read_text().strip() == "haproxy":
                    return int(child)
    except OSError:  # the process or a child went meanwhile
        return None
    return None


def runs(executable: str) -> bool:
    try:
        done = subprocess.run([executable, "-v"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.startswith(b"HAProxy version")


def find_or_fetch(root: Path = DEFAULT_ROOT) -> str | None:
    given = os.environ.get("MESHD_HAPROXY")
    if given:
        return given if runs(given) else None
    found = shutil.which("haproxy")
    if found and runs(found):
        return found
    return fetch(root)


def fetch(root: Path = DEFAULT_ROOT) -> str | None:
    """The wrapper of an HAProxy unpacked from Debian packages (fetched on first use)."""
    home = root / f"haproxy-{platform.machine()}"
    wrapper = home / "bin" / "haproxy"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".haproxy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (home / MARKER).exists() and runs(str(wrapper)):
            return str(wrapper)
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            return None
        shutil.rmtree(home, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            if not _download(Path(tmp)):
                return None
            (home / "root").mkdir(parents=True)
            for deb in Path(tmp).glob("*.deb"):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(home / "root")], check=True, timeout=TIMEOUT_S)
        libs = home / "root" / "usr" / "lib" / f"{platform.machine()}-linux-gnu"
        binary = home / "root" / "usr" / "sbin" / "haproxy"
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        wrapper.write_text(
            f'#!/bin/sh\nLD_LIBRARY_PATH="{libs}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "{binary}" "$@"\n'
        )
        wrapper.chmod(0o755)
        if not runs(str(wrapper)):
            return None
        (home / MARKER).touch()
        return str(wrapper)


def _download(directory: Path) -> bool:
    def download() -> bool:
        done = subprocess.run(["apt-get", "download", *PACKAGES], cwd=directory, capture_output=True, timeout=TIMEOUT_S)
        return done.returncode == 0

    if download():
        return True
    if os.geteuid() != 0:
        return False
    subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=TIMEOUT_S)
    return download()
