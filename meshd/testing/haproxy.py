"""An HAProxy for tests and benchmarks of the native data plane, found, built or fetched.

In order: MESHD_HAPROXY; `haproxy` on PATH when it is one without HAProxy's trailers bug
(serving/native/haproxy_config.trailers_reset_bug: meshd gives an older one a connection per
request, at half the throughput); one built earlier or now from Debian 13's copy of the
HAProxy 3.0 LTS source (checked against its SHA-256; needs a C compiler, make and OpenSSL's
headers), under `<repo>/.venvs/haproxy-<version>-<arch>/`; an older `haproxy` on PATH; or (on
Debian and its derivatives) Debian's package fetched without installing anything: `apt-get
download` of the package and the libraries a bare image lacks, unpacked under
`<repo>/.venvs/haproxy-<arch>/` with a wrapper that points the loader at them. As root, an
empty package index is filled first (`apt-get update`). None when no way works; the caller
says why.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from meshd.serving.native.haproxy_config import trailers_reset_bug
from meshd.testing.venvs import DEFAULT_ROOT

PACKAGES = ("haproxy", "liblua5.3-0", "libopentracing-c-wrapper0", "libopentracing1")
MARKER = ".meshd-haproxy-complete"
TIMEOUT_S = 300.0
# HAProxy 3.0 LTS as Debian 13 ships it (the Docker image's), from Debian's archive.
SOURCE_VERSION = "3.0.11"
SOURCE_URL = f"https://deb.debian.org/debian/pool/main/h/haproxy/haproxy_{SOURCE_VERSION}.orig.tar.gz"
SOURCE_SHA256 = "a133e2d550c5fd9a849b5c7ab17bb945bcdad209ca140d41f45ebf31943ae783"
BUILD_TIMEOUT_S = 1200.0  # ~75 s on 2 cores


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


def version(executable: str) -> str | None:
    """`executable -v`'s first line when it is an HAProxy that runs, else None."""
    try:
        done = subprocess.run([executable, "-v"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.startswith(b"HAProxy version"):
        return None
    return done.stdout.decode(errors="replace").splitlines()[0]


def runs(executable: str) -> bool:
    return version(executable) is not None


def find_or_fetch(root: Path = DEFAULT_ROOT) -> str | None:
    given = os.environ.get("MESHD_HAPROXY")
    if given:
        return given if runs(given) else None
    on_path = shutil.which("haproxy")
    line = version(on_path) if on_path else None
    if on_path and line and not trailers_reset_bug(line):
        return on_path
    return build(root) or (on_path if line else None) or fetch(root)


def build(root: Path = DEFAULT_ROOT) -> str | None:
    """An HAProxy built from SOURCE_VERSION's source (once; later calls find it), or None where
    it cannot be built here (no compiler, make or OpenSSL headers, no archive, a failed build)."""
    home = root / f"haproxy-{SOURCE_VERSION}-{platform.machine()}"
    binary = home / "haproxy"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".haproxy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (home / MARKER).exists() and runs(str(binary)):
            return str(binary)
        if not (shutil.which("cc") and shutil.which("make") and Path("/usr/include/openssl/ssl.h").exists()):
            return None
        shutil.rmtree(home, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            archive = Path(tmp) / "haproxy.tar.gz"
            try:
                with urllib.request.urlopen(SOURCE_URL, timeout=TIMEOUT_S) as answer:
                    archive.write_bytes(answer.read())
            except OSError:
                return None
            if hashlib.sha256(archive.read_bytes()).hexdigest() != SOURCE_SHA256:
                return None
            with tarfile.open(archive) as tar:  # checked above; the filter where Python has it (3.11.4)
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, filter="data")
                else:
                    tar.extractall(tmp)
            source = Path(tmp) / f"haproxy-{SOURCE_VERSION}"
            make = ["make", f"-j{os.cpu_count() or 1}", "TARGET=linux-glibc", "USE_OPENSSL=1"]
            try:
                done = subprocess.run(make, cwd=source, capture_output=True, timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return None
            if done.returncode != 0:
                return None
            home.mkdir(parents=True)
            shutil.copy2(source / "haproxy", binary)
        if not runs(str(binary)):
            return None
        (home / MARKER).touch()
        return str(binary)


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
