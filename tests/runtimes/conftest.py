"""Start the demo runtime as a real child process and hand tests ready gRPC stubs."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as pb
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as pb_grpc
from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.runtimes.models import GeneratedModel, generate_models
from meshd.testing.procs import Child, Children, free_port, wait_until

READY_LINE = "meshd-demo runtime ready on"


@dataclass
class DemoRuntime:
    """One running demo runtime: management stubs, inference stubs (maybe on another endpoint)."""

    child: Child
    target: str
    serving_target: str
    channel: grpc.Channel
    serving_channel: grpc.Channel
    runtime: rt_grpc.ModelRuntimeStub = field(init=False)
    inference: pb_grpc.GRPCInferenceServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.runtime = rt_grpc.ModelRuntimeStub(self.channel)
        self.inference = pb_grpc.GRPCInferenceServiceStub(self.serving_channel)

    def raw_unary(self, method: str) -> Any:
        """A callable sending raw request bytes to inference.GRPCInferenceService/<method>."""
        return self.serving_channel.unary_unary(f"/inference.GRPCInferenceService/{method}")

    def load(self, model_id: str, path: Path | str, key: str = "") -> rt.LoadModelResponse:
        return self.runtime.loadModel(rt.LoadModelRequest(modelId=model_id, modelPath=str(path), modelKey=key))

    def loaded(self) -> list[str]:
        """What is really loaded, per RepositoryIndex."""
        return [m.name for m in self.inference.RepositoryIndex(pb.RepositoryIndexRequest()).models]

    def status(self) -> rt.RuntimeStatusResponse:
        return self.runtime.runtimeStatus(rt.RuntimeStatusRequest(), timeout=5)

    def close(self) -> None:
        self.channel.close()
        if self.serving_channel is not self.channel:
            self.serving_channel.close()


StartRuntime = Callable[..., DemoRuntime]


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="mdrt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_runtime(tmp_path: Path) -> Iterator[StartRuntime]:
    """start_runtime(*flags, socket=None, serving_port=False, wait_ready=True) -> DemoRuntime.

    Every runtime started here is stopped by PID when the test ends, pass or fail.
    wait_ready=True polls runtimeStatus until READY (which purges, as meshd would).
    """
    group = Children(tmp_path / "logs")
    runtimes: list[DemoRuntime] = []

    def start(
        *flags: str, socket: Path | None = None, serving_port: bool = False, wait_ready: bool = True
    ) -> DemoRuntime:
        argv = list(flags)
        if socket is not None:
            argv += ["--socket", str(socket)]
            target = f"unix:{socket}"
        else:
            port = free_port()
            argv += ["--port", str(port)]
            target = f"127.0.0.1:{port}"
        serving_target = target
        if serving_port:
            sport = free_port()
            argv += ["--serving-port", str(sport)]
            serving_target = f"127.0.0.1:{sport}"
        child = group.python(f"runtime-{len(group.items)}", "meshd.runtimes.demo", argv)

        def ready() -> bool:
            if not child.alive():
                raise AssertionError(f"runtime exited with {child.proc.returncode}:\n{child.log_tail()}")
            return READY_LINE in child.log_path.read_text(errors="replace")

        wait_until(ready, 20, "the demo runtime's ready line")
        channel = grpc.insecure_channel(target)
        serving_channel = grpc.insecure_channel(serving_target) if serving_target != target else channel
        runtime = DemoRuntime(child, target, serving_target, channel, serving_channel)
        runtimes.append(runtime)
        if wait_ready:
            wait_until(lambda: runtime.status().status == rt.RuntimeStatusResponse.READY, 20, "runtime READY")
        return runtime

    try:
        yield start
    finally:
        for runtime in runtimes:
            runtime.close()
        group.stop_all()


@pytest.fixture
def models(tmp_path: Path) -> list[GeneratedModel]:
    return generate_models(tmp_path / "models", 4, size_bytes=3 << 20)
