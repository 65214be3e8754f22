"""modelmesh-serving's controller defaults work from a plain `pip install` of meshd (no extras):
its `MM_METRICS=prometheus:port=2112;scheme=https` with no TLS secret needs a self-signed
certificate, which needs `cryptography`, now a core dependency. The venv is new each run
(meshd installed from this checkout, non-editable), so it holds exactly what pip resolves."""

from __future__ import annotations

import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from meshd.testing.procs import Children, free_ports, port_open, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_controllers_https_metrics_from_a_plain_install(tmp_path: Path) -> None:
    venv = tmp_path / "plain"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run([*pip, str(ROOT)], capture_output=True, text=True, timeout=800, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    extras = subprocess.run([*pip[:3], "list"], capture_output=True, text=True, timeout=60).stdout
    assert "grpcio-tools" not in extras and "pytest" not in extras, "a plain install, not the dev one"
    runtime_port, grpc_port, peer_port, http_port, metrics_port = free_ports(5)
    meshd = str(venv / "bin" / "meshd")
    with Children(tmp_path / "logs") as procs:
        runtime = procs.start("runtime", [meshd, "runtime", "--port", str(runtime_port)])
        wait_until(lambda: port_open(runtime_port) or not runtime.alive(), 60, "the runtime")
        env = {
            "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
            "MM_METRICS": f"prometheus:port={metrics_port};scheme=https",  # the controller's default
            "MM_SVC_GRPC_PORT": str(grpc_port),
            "MESHD_PEER_PORT": str(peer_port),
            "MESHD_HTTP_PORT": str(http_port),
            "MM_PROBE_PORT": "disabled",
            "MM_PRESTOP_WAIT_PORT": "disabled",
            "MESHD_DATA_DIR": str(tmp_path / "data"),
        }
        served = procs.start("meshd", [meshd, "serve", "--runtime-port", str(runtime_port)], env)
        wait_until(lambda: port_open(metrics_port) or not served.alive(), 60, "meshd's metrics port")
        assert served.alive(), served.log_tail()
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        url = f"https://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, context=insecure, timeout=10) as r:
            assert b"modelmesh_" in r.read()
        assert "self-signed certificate" in served.log_path.read_text(), served.log_tail()
