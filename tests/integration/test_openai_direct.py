"""A warm local copy's OpenAI answer streamed by meshd from its engine (api.openai_direct),
with real processes: etcd, meshd, `meshd llm-runtime` and an engine of our own
(meshd.testing.fake_llm: the prompt's words echoed, one SSE event a word, a usage when asked).

The engine's connection is kept between calls (one connection, call after call); a prompt
of several MiB (past any proxy's buffer) reaches the engine whole; the engine's queue, read
by the runtime, still reaches meshd and adds a copy when it stays deep."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.meshd import peer_pb2, peer_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.llm import LlmRuntimeArgs, add_llm_node

pytestmark = pytest.mark.slow  # real processes: etcd, meshd, the runtime and its engine

MODEL = "echo"
FAKE = f"{sys.executable} -m meshd.testing.fake_llm --port {{port}} --name {{name}} --token-interval-ms 2"


@pytest.fixture
def node(tmp_path: Path, etcd_server: Any) -> Iterator[Node]:
    mesh = LocalMesh(tmp_path / "mesh", service=f"openai-direct-{tmp_path.name}")
    mesh.etcd_url = etcd_server.url
    try:
        args = LlmRuntimeArgs(Path(sys.executable), engine_command=FAKE, engine_args=())
        n = add_llm_node(mesh, "d", args)
        with grpc.insecure_channel(n.target) as ch:
            info = mm.ModelInfo(type="llm", path=str(tmp_path))
            mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId=MODEL, modelInfo=info), timeout=30)
        yield n
    finally:
        mesh.stop()


def complete(node: Node, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(
        node.http_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        assert r.status == 200
        return bytes(r.read())


def events(stream: bytes) -> list[Any]:
    return [json.loads(line[6:]) for line in stream.split(b"\n") if line.startswith(b"data: {")]


def engine_port(model_id: str) -> int:
    """The port of the engine meshd's runtime started for `model_id` (fake_llm's --name)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"meshd.testing.fake_llm" in argv and argv[argv.index(b"--name") + 1] == model_id.encode():
                return int(argv[argv.index(b"--port") + 1])
    raise AssertionError(f"no engine runs for {model_id}")


def connections_to(pid: int, port: int) -> set[int]:
    """The socket inodes of `pid`'s established TCP connections to `port` (/proc, IPv4 and 6)."""
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], int(fields[9])
            if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port and inode in mine:
                found.add(inode)
    return found


def test_calls_after_the_first_reuse_one_kept_engine_connection(node: Node) -> None:
    first = complete(node, {"model": MODEL, "prompt": "a b c", "stream": True})  # loads the copy
    assert [e["choices"][0]["text"] for e in events(first)] == ["a", "b", "c"]
    port = engine_port(MODEL)
    kept = connections_to(node.meshd.proc.pid, port)
    assert len(kept) == 1, kept
    for i in range(5):
        streamed = complete(node, {"model": MODEL, "prompt": f"x{i} y{i}", "stream": True})
        assert [e["choices"][0]["text"] for e in events(streamed)] == [f"x{i}", f"y{i}"]
        assert streamed.endswith(b"data: [DONE]\n\n")
        whole = json.loads(complete(node, {"model": MODEL, "prompt": f"p{i}", "repeat": 2}))
        assert whole["choices"][0]["text"] == f"p{i} p{i}"
        assert connections_to(node.meshd.proc.pid, port) == kept  # the same connection, call after call


def test_a_prompt_of_several_mib_reaches_the_engine_whole(node: Node) -> None:
    words = [f"w{i}" for i in range(600_000)]  # about 4.5 MiB of JSON
    body = {
        "model": MODEL,
        "prompt": " ".join(words),
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    streamed = complete(node, body)
    got = events(streamed)
    assert [e["choices"][0]["text"] for e in got[:-1]] == ["w0", "w1", "w2"]
    assert got[-1]["usage"] == {"prompt_tokens": len(words), "completion_tokens": 3}  # every word came
    # And again, on the connection kept from it.
    after = events(complete(node, {"model": MODEL, "prompt": "after", "stream": True}))
    assert after[0]["choices"][0]["text"] == "after"


def loaded_on(node: Node) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{node.peer_port}") as ch:
        stats = peer_pb2_grpc.MeshPeerStub(ch).InstanceStats(peer_pb2.InstanceStatsRequest(), timeout=10)
    return set(stats.loadedModels)


@pytest.mark.parametrize("sent_to", ["holder", "other"])
def test_a_copy_is_added_when_the_engine_queue_stays_deep(tmp_path: Path, etcd_server: Any, sent_to: str) -> None:
    """An engine serving one call at a time with several waiting gets a second copy on the
    other instance, at a few calls a second (far below the requests per minute that add copies
    of other models), whether the calls come to the instance holding the copy (streamed
    straight from the engine: the runtime is asked where it listens again beside them, and its
    answer brings the engine's load) or to the other, which forwards them (the holder reads the
    load from its runtime's first answer; before, it did so only when routing by load)."""
    mesh = LocalMesh(tmp_path / "mesh", service=f"openai-deep-{tmp_path.name}")
    mesh.etcd_url = etcd_server.url
    stop = threading.Event()
    try:
        args = LlmRuntimeArgs(Path(sys.executable), engine_command=FAKE + " --max-running 1", engine_args=())
        # Routed by calls in flight (the local copy first), so only copy scaling can add one:
        # routing by load would load a copy for calls that find every copy busy.
        settings: dict[str, str | int] = {"rate_check_ms": 2000, "llm_routing": "inflight"}
        a, b = add_llm_node(mesh, "qa", args, settings), add_llm_node(mesh, "qb", args, settings)
        with grpc.insecure_channel(a.target) as ch:
            info = mm.ModelInfo(type="llm", path=str(tmp_path))
            mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId=MODEL, modelInfo=info), timeout=30)
        complete(a, {"model": MODEL, "prompt": "warm", "stream": True})  # the first copy
        holders = [n for n in (a, b) if MODEL in loaded_on(n)]
        assert len(holders) == 1
        target = holders[0] if sent_to == "holder" else next(n for n in (a, b) if n is not holders[0])
        errors: list[BaseException] = []

        def caller() -> None:
            while not stop.is_set():
                try:
                    complete(target, {"model": MODEL, "prompt": "t", "repeat": 50, "stream": True})  # ~0.1 s each
                except BaseException as e:  # reported by the test
                    errors.append(e)
                    return

        callers = [threading.Thread(target=caller, daemon=True) for _ in range(5)]
        for t in callers:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(MODEL in loaded_on(n) for n in (a, b)):
            time.sleep(0.5)
        stop.set()
        for t in callers:
            t.join(timeout=60)
        assert not errors, errors
        assert all(MODEL in loaded_on(n) for n in (a, b)), "no second copy while the engine's queue stayed deep"
    finally:
        stop.set()
        mesh.stop()
