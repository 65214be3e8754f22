"""README.md's second instance serving the first one's models and its
own (the quickstart and second-instance blocks, with a check of both ways). Every shell block
of the README, run in order as written: test_docs_run.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.testing.procs import free_port

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"<!-- quickstart -->\s*```bash\n(.*?)```\s*<!-- /quickstart -->", re.S)


def quickstart() -> str:
    found = BLOCK.search(README.read_text())
    assert found, "README.md has no <!-- quickstart --> block"
    return found.group(1)


SECOND = re.compile(r"<!-- second-instance -->\s*```bash\n(.*?)```\s*<!-- /second-instance -->", re.S)


def test_a_second_instance_on_the_host_as_written(tmp_path: Path) -> None:
    """The README's second-instance step, as written, after the quickstart's first instance
    (its ports swapped for free ones on its own command line, so the second meshd sees none of
    them): the two serve each other's models."""
    found = SECOND.search(README.read_text())
    assert found, "README.md has no <!-- second-instance --> block"
    first_lines = [line for line in quickstart().splitlines() if not line.startswith("kill ")]
    first = "\n".join(first_lines) + "\n"
    grpc_port, http_port = free_port(), free_port()
    own = {
        "MM_SVC_GRPC_PORT": grpc_port,
        "MESHD_HTTP_PORT": http_port,
        "MESHD_PEER_PORT": free_port(),
        "MM_METRICS": f"prometheus:port={free_port()}",
        "MM_PROBE_PORT": free_port(),
        "MM_PRESTOP_WAIT_PORT": free_port(),
    }
    prefix = " ".join(f"{k}='{v}'" for k, v in own.items())
    first = first.replace("meshd serve ", f"{prefix} meshd serve ", 1)
    first = re.sub(r"\b8085\b", str(free_port()), first)
    first = re.sub(r"\b8091\b", str(http_port), first)
    second = re.sub(r"\b8086\b", str(free_port()), found.group(1))
    # Then each instance serves a model through the other: model-0001 is registered through the
    # second instance and asked of the first; model-0000 (the first's) is asked of the second.
    check = """
second_http=$(grep -o 'ready: .*' second.log | grep -o 'http port [0-9]*' | grep -o '[0-9]*')
second_grpc=$(grep -o 'ready: .*' second.log | grep -o 'grpc port [0-9]*' | grep -o '[0-9]*')
echo "second: grpc $second_grpc http $second_http"
curl -sf localhost:$second_http/v2/models/model-0000/infer -H 'Content-Type: application/json' \\
  -d '{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'; echo
MESHD_ADDRESS=localhost:$second_grpc meshd models register model-0001 --type demo --path "$PWD/models/model-0001.json"
curl -sf localhost:HTTP/v2/models/model-0001/infer -H 'Content-Type: application/json' \\
  -d '{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","data":[1,2,3,4]}]}'; echo
meshd instances list
kill %4 %3 %2 %1; wait || true
""".replace("HTTP", str(http_port))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "MESHD_ADDRESS": f"localhost:{grpc_port}",
    }
    for key in (*own, "KV_STORE", "MESHD_PORTS", "MESHD_JOIN", "MESHD_INSTANCE_ID"):
        env.pop(key, None)
    proc = subprocess.Popen(
        ["bash", "-e", "-c", first + second + check],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # both meshd, both runtimes
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, out
    assert '"model_name":"model-0000"' in out and '"model_name":"model-0001"' in out, out
    assert re.search(r"ready: grpc port \d+, peer port \d+, http port \d+, metrics port \d+, probe port \d+", out), out
    listed = out.rsplit("INSTANCE", 1)[-1] if "INSTANCE" in out else out
    assert len(re.findall(r"^\S+-\d+\s|^\S+\s", listed, re.M)) >= 2, out
