"""`meshd adapter`: the process. Flags (and upstream adapters' environment names), the SPI
server, the supervisor and the reconcile loop.

    meshd adapter --server mlserver --server-grpc 127.0.0.1:8001 --repository /models/_repo \\
        --port 8085 [--launch -- mlserver start ...]

meshd then runs with `--runtime-port 8085 --serving-port 8001`: management through the
adapter, inference straight to the model server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.adapter import gpu, layout, running, sizing, stored
from meshd.adapter.layout import Layout, MLServerLayout, TritonLayout
from meshd.adapter.server import (
    DEFAULT_LOADING_TIMEOUT_MS,
    DEFAULT_MODEL_SIZE_BYTES,
    Adapter,
    AdapterConfig,
    ModelServer,
)
from meshd.adapter.supervisor import Supervisor, SupervisorConfig
from meshd.core.hostport import join as host_port
from meshd.observability.logs import setup_logging
from meshd.process.child import resolve

log = logging.getLogger("meshd.adapter")

LAYOUTS: dict[str, type[MLServerLayout] | type[TritonLayout]] = {"mlserver": MLServerLayout, "triton": TritonLayout}
MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_MEMORY_BYTES = 1 << 30  # host memory when neither the flag nor the environment says


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value:
            try:
                return int(value)
            except ValueError:
                raise SystemExit(f"meshd adapter: {name} must be an integer (got {value!r})") from None
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshd adapter",
        description="A ModelRuntime (SPI) server for a KServe V2 model server with the repository extension.",
    )
    p.add_argument("--server", choices=sorted(LAYOUTS), required=True, help="which model server (repository layout)")
    p.add_argument("--server-grpc", required=True, metavar="HOST:PORT", help="the model server's gRPC endpoint")
    p.add_argument("--repository", type=Path, required=True, help="the model server's model repository (owned)")
    p.add_argument("--model-root", type=Path, help="relative model paths are under this folder")
    stored.add_root_model_dir(p)
    p.add_argument("--host", default="127.0.0.1", help="address of the SPI port")
    p.add_argument("--port", type=int, help="SPI (mmesh.ModelRuntime) TCP port")
    p.add_argument("--socket", type=Path, help="SPI unix socket")
    p.add_argument(
        "--memory-bytes",
        type=int,
        help="model server memory (env MODEL_SERVER_MEM_REQ_BYTES or CONTAINER_MEM_REQ_BYTES; default 1 GiB)",
    )
    p.add_argument(
        "--gpu-capacity",
        choices=["auto", "off"],
        help="triton: size the cache from the smallest visible GPU's memory when NVML finds one "
        "(needs nvidia-ml-py; env MESHD_ADAPTER_GPU_CAPACITY; default auto)",
    )
    p.add_argument("--memory-overhead-bytes", type=int, help="what the server needs itself (env MEM_BUFFER_BYTES)")
    p.add_argument(
        "--gpu-memory-overhead-bytes",
        type=int,
        help="triton on a GPU: what comes off the device's memory before models (CUDA context, the "
        "server's pools, other users of the device; env MESHD_ADAPTER_GPU_OVERHEAD_BYTES; default 1 GiB)",
    )
    p.add_argument("--default-model-size", type=int, help="size of a model of unknown size (env DEFAULT_MODELSIZE)")
    p.add_argument("--size-multiplier", type=float, help="loaded size / disk size (env MODELSIZE_MULTIPLIER)")
    p.add_argument("--loading-concurrency", type=int, help="loads at a time (env LOADING_CONCURRENCY)")
    p.add_argument("--loading-timeout-ms", type=int, help="load timeout (env LOADTIME_TIMEOUT)")
    p.add_argument(
        "--max-concurrency", type=int, help="requests per copy, 0 = unlimited (env LIMIT_PER_MODEL_CONCURRENCY)"
    )
    p.add_argument("--reconcile-interval-s", type=float, default=5.0, help="compare with the server's index this often")
    p.add_argument("--pid-file", type=Path, help="write the launched model server's PID here")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", help="log lines: text or json (env MESHD_LOG_FORMAT, default text)")
    p.add_argument("launch", nargs=argparse.REMAINDER, help="-- COMMAND...: start and supervise the model server")
    return p


def gpu_memory(a: argparse.Namespace, env: Mapping[str, str], nvml: object | None = None) -> int | None:
    """The GPU memory to size the cache from: Triton only, unless turned off; None: no GPU."""
    choice = a.gpu_capacity or env.get("MESHD_ADAPTER_GPU_CAPACITY") or "auto"
    if choice not in ("auto", "off"):
        raise SystemExit(f"meshd adapter: MESHD_ADAPTER_GPU_CAPACITY must be auto or off (got {choice!r})")
    if a.server != "triton" or choice == "off":
        return None
    return gpu.memory_per_model_bytes(env, nvml)


def config_from(a: argparse.Namespace, env: Mapping[str, str], gpu_bytes: int | None = None) -> AdapterConfig:
    def pick(flag: int | None, *names: str, default: int) -> int:
        if flag is not None:
            return flag
        value = _env_int(env, *names)
        return default if value is None else value

    memory = a.memory_bytes
    if memory is None:
        memory = _env_int(env, "MODEL_SERVER_MEM_REQ_BYTES", "CONTAINER_MEM_REQ_BYTES")
    overhead = pick(a.memory_overhead_bytes, "MEM_BUFFER_BYTES", default=sizing.DEFAULT_OVERHEAD_BYTES)
    gpu_overhead = pick(
        a.gpu_memory_overhead_bytes, "MESHD_ADAPTER_GPU_OVERHEAD_BYTES", default=sizing.DEFAULT_GPU_OVERHEAD_BYTES
    )
    multiplier = a.size_multiplier
    if multiplier is None:
        multiplier = float(env.get("MODELSIZE_MULTIPLIER") or sizing.DEFAULT_MULTIPLIER)
    if multiplier <= 0:
        raise SystemExit("meshd adapter: the size multiplier must be > 0")
    return AdapterConfig(
        repository=a.repository,
        model_root=a.model_root,
        capacity_bytes=sizing.capacity_with_gpu(memory, gpu_bytes, overhead, DEFAULT_MEMORY_BYTES, gpu_overhead),
        default_model_size=pick(a.default_model_size, "DEFAULT_MODELSIZE", default=DEFAULT_MODEL_SIZE_BYTES),
        size_multiplier=multiplier,
        max_loading_concurrency=max(1, pick(a.loading_concurrency, "LOADING_CONCURRENCY", default=1)),
        loading_timeout_ms=pick(a.loading_timeout_ms, "LOADTIME_TIMEOUT", default=DEFAULT_LOADING_TIMEOUT_MS),
        max_concurrency=max(0, pick(a.max_concurrency, "LIMIT_PER_MODEL_CONCURRENCY", default=0)),
        version=f"meshd-adapter/{a.server}",
    )


def storage_problem(repository: Path, root: Path | None) -> str | None:
    """The repository is cleared at start: inside the model folder only under a name the
    storage helper leaves alone (upstream's `_mlserver_models`, `_triton_models`)."""
    if root is None:
        return None
    repo, top = repository.resolve(), root.resolve()
    if repo == top or top.is_relative_to(repo):
        return f"the repository {repository} would hold the pulled models' folder {root}"
    if repo.is_relative_to(top) and not repo.relative_to(top).parts[0].startswith("_"):
        return f"a repository inside {root} must be named _<something> (as {root / '_mlserver_models'})"
    return None


def launch_command(a: argparse.Namespace) -> list[str] | None:
    """The model server's command after `--`, or None when the adapter only watches one."""
    return list(a.launch[1:] if a.launch[:1] == ["--"] else a.launch) or None


async def serve(a: argparse.Namespace, config: AdapterConfig) -> int:
    config.repository.mkdir(parents=True, exist_ok=True)
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    channel = grpc.aio.insecure_channel(a.server_grpc, options=options)
    model_layout: Layout = LAYOUTS[a.server]()
    storage = await stored.open_storage(stored.storage_root(a, os.environ))
    adapter = Adapter(config, model_layout, ModelServer(channel), storage)
    command = launch_command(a)
    env = dict(os.environ)
    if a.server == "mlserver":
        env["MLSERVER_LOAD_MODELS_AT_STARTUP"] = "false"  # meshd decides what loads, not the folder
    await asyncio.to_thread(layout.clear, config.repository)  # nothing left from an earlier run
    supervisor = Supervisor(
        adapter.server.live,
        adapter.restore,
        command,
        env,
        SupervisorConfig(),
        a.pid_file,
        ready=adapter.server.ready,
    )
    adapter.supervisor = supervisor

    server = grpc.aio.server(options=options)
    rt_grpc.add_ModelRuntimeServicer_to_server(adapter, server)
    stored.serve_disk_tier(server, storage)
    bound = []
    if a.port is not None:
        port = server.add_insecure_port(host_port(a.host, a.port))
        bound.append(host_port(a.host, port))
    if a.socket is not None:
        server.add_insecure_port(f"unix:{a.socket}")
        bound.append(f"unix:{a.socket}")
    await server.start()
    tasks = [asyncio.create_task(supervisor.run()), asyncio.create_task(_reconcile_loop(adapter, a))]
    print(f"meshd adapter ({a.server}) ready on {' '.join(bound)}; model server {a.server_grpc}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if storage is not None:  # running pulls end now, as failed loads, rather than hold the exit
        await storage.close()
    await server.stop(grace=2.0)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    await channel.close()
    return 0


async def _reconcile_loop(adapter: Adapter, a: argparse.Namespace) -> None:
    while True:
        await asyncio.sleep(a.reconcile_interval_s)
        try:
            await adapter.reconcile()
        except grpc.aio.AioRpcError as e:
            log.debug("reconcile skipped: %s", e.details())
        except Exception:
            log.exception("reconcile failed")


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.port is None and a.socket is None:
        print("meshd adapter: give --port and/or --socket for the SPI endpoint", file=sys.stderr)
        return 2
    log_format = running.log_format("meshd adapter", a.log_format, os.environ)
    if log_format is None:
        return 2
    setup_logging(a.log_level, log_format)
    config = config_from(a, os.environ, gpu_memory(a, os.environ))
    problem = layout.overlap_problem(config.repository, config.model_root) or storage_problem(
        config.repository, stored.storage_root(a, os.environ)
    )
    if problem:
        print(f"meshd adapter: {problem}", file=sys.stderr)
        return 2
    command = launch_command(a)
    if command:
        try:
            resolve(command[0])  # else the supervisor's task died and the adapter ran on without a server
        except FileNotFoundError:
            print(f"meshd adapter: the model server command {command[0]!r} is not an executable", file=sys.stderr)
            return 2
    return running.run("meshd adapter", serve(a, config))


if __name__ == "__main__":
    sys.exit(main())
