"""The demo runtime process: `python -m meshd.runtimes.demo [options]`.

A real, separate model-serving runtime for meshd's tests, demo and benchmarks. This
module owns the command line, the sockets and the process lifecycle (ready line on
stdout, graceful stop on SIGTERM/SIGINT with exit status 0); the servicers and model
state live in `demo_server`, the model file format in `models`.

The management endpoint (`--port` and/or `--socket`) serves `mmesh.ModelRuntime`; the
inference endpoint serves `inference.GRPCInferenceService` and is the same server unless
`--serving-port`/`--serving-socket` name a separate one. Several flags make the runtime
misbehave on purpose (slow loads, failed loads, size 0, slow startup) so meshd's handling
of those cases can be tested against a real process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from meshd.core.hostport import join as host_port
from meshd.runtimes.demo_server import InferenceService, RuntimeConfig, RuntimeState, add_runtime_servicer
from meshd.runtimes.echo import EchoService

log = logging.getLogger("meshd.runtimes.demo")

STOP_GRACE_S = 2.0


@dataclass
class Endpoint:
    """Where one gRPC server listens: a TCP port and/or a unix socket."""

    port: int | None = None
    socket: Path | None = None

    @property
    def given(self) -> bool:
        return self.port is not None or self.socket is not None


@dataclass
class Options:
    host: str = "127.0.0.1"
    management: Endpoint = field(default_factory=Endpoint)
    serving: Endpoint = field(default_factory=Endpoint)
    config: RuntimeConfig = field(default_factory=RuntimeConfig)
    max_message_bytes: int = 64 << 20
    use_uvloop: bool = True
    log_level: str = "INFO"


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"bad regular expression {text!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m meshd.runtimes.demo",
        description="meshd's reference ModelMesh runtime serving tiny JSON models (meshd.runtimes.models).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address for TCP ports (default 127.0.0.1)")
    p.add_argument("--port", type=_non_negative_int, help="management (mmesh.ModelRuntime) TCP port; 0 = any")
    p.add_argument("--socket", type=Path, help="management unix socket path")
    p.add_argument("--serving-port", type=_non_negative_int, help="inference TCP port (default: management server)")
    p.add_argument("--serving-socket", type=Path, help="inference unix socket path (default: management server)")
    p.add_argument("--capacity-bytes", type=_non_negative_int, default=256 << 20)
    p.add_argument("--max-loading-concurrency", type=_non_negative_int, default=2)
    p.add_argument("--loading-timeout-ms", type=_non_negative_int, default=30_000)
    p.add_argument("--default-model-size", type=_non_negative_int, default=1 << 20)
    p.add_argument(
        "--load-delay-ms", type=_non_negative_int, default=0, help='per-model override: modelKey {"load_delay_ms": N}'
    )
    p.add_argument("--startup-delay-ms", type=_non_negative_int, default=0, help="report STARTING until then")
    p.add_argument("--fail-load", type=_regex, metavar="REGEX", help="loadModel of matching ids fails with INTERNAL")
    p.add_argument("--zero-size", action="store_true", help="loadModel returns size 0 (caller must ask modelSize)")
    p.add_argument("--max-concurrency", type=_non_negative_int, default=0, help="LoadModelResponse.maxConcurrency")
    p.add_argument("--limit-model-concurrency", action="store_true", help="set limitModelConcurrency in runtimeStatus")
    p.add_argument("--inject-id", action="store_true", help="idInjectionPath [1] for ModelInfer and ModelMetadata")
    p.add_argument("--infer-delay-ms", type=_non_negative_int, default=0, help="added to every inference request")
    p.add_argument(
        "--disk-dir",
        type=Path,
        help="serve meshd.disk.DiskTier: the folder's entries are the models on this runtime's disk",
    )
    p.add_argument(
        "--disk-pull-ms-per-gib", type=_non_negative_int, default=8_000, help="with --disk-dir: what a pull costs"
    )
    p.add_argument("--max-message-bytes", type=_non_negative_int, default=64 << 20)
    p.add_argument("--no-uvloop", action="store_true", help="use the default asyncio event loop")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def parse_args(argv: Sequence[str] | None) -> Options:
    parser = build_parser()
    a = parser.parse_args(argv)
    management = Endpoint(a.port, a.socket)
    if not management.given:
        parser.error("give --port and/or --socket for the management endpoint")
    config = RuntimeConfig(
        capacity_bytes=a.capacity_bytes,
        max_loading_concurrency=a.max_loading_concurrency,
        loading_timeout_ms=a.loading_timeout_ms,
        default_model_size=a.default_model_size,
        load_delay_ms=a.load_delay_ms,
        startup_delay_ms=a.startup_delay_ms,
        fail_load=a.fail_load,
        zero_size=a.zero_size,
        max_concurrency=a.max_concurrency,
        limit_model_concurrency=a.limit_model_concurrency,
        inject_id=a.inject_id,
        infer_delay_ms=a.infer_delay_ms,
        disk_dir=a.disk_dir,
        disk_pull_ms_per_gib=a.disk_pull_ms_per_gib,
    )
    return Options(
        host=a.host,
        management=management,
        serving=Endpoint(a.serving_port, a.serving_socket),
        config=config,
        max_message_bytes=a.max_message_bytes,
        use_uvloop=not a.no_uvloop,
        log_level=a.log_level,
    )


def _bind(server: Any, host: str, endpoint: Endpoint) -> list[str]:
    """Bind a server to an endpoint; returns the bound addresses as SPEC endpoint strings."""
    bound: list[str] = []
    if endpoint.port is not None:
        target = host_port(host, endpoint.port)
        port = server.add_insecure_port(target)
        if port == 0:
            raise OSError(f"cannot listen on {target}")
        bound.append(f"port:{port}")
    if endpoint.socket is not None:
        server.add_insecure_port(f"unix:{endpoint.socket}")
        bound.append(f"unix:{endpoint.socket}")
    return bound


def _new_server(opts: Options) -> Any:
    return grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", opts.max_message_bytes),
            ("grpc.max_send_message_length", opts.max_message_bytes),
            # Fail loudly if the port is taken instead of silently sharing it with another process.
            ("grpc.so_reuseport", 0),
        ]
    )


def add_inference_service(server: Any, state: RuntimeState) -> None:
    """KServe V2 inference and the Echo test service, both answered from `state`."""
    server.add_generic_rpc_handlers((InferenceService(state).handler(), EchoService(state).handler()))


async def serve(opts: Options) -> int:
    state = RuntimeState(opts.config)
    management = _new_server(opts)
    add_runtime_servicer(management, state)
    servers = [management]
    if opts.serving.given:
        serving = _new_server(opts)
        add_inference_service(serving, state)
        servers.append(serving)
    else:
        add_inference_service(management, state)

    try:
        management_at = _bind(management, opts.host, opts.management)
        serving_at = _bind(servers[1], opts.host, opts.serving) if opts.serving.given else management_at
    except (OSError, RuntimeError) as e:
        log.error("%s", e)
        return 1

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for server in servers:
            await server.start()
        print(
            f"meshd-demo runtime ready on {' '.join(management_at)} (inference on {' '.join(serving_at)})", flush=True
        )
        await stop.wait()
        log.info("stopping")
    finally:
        await asyncio.gather(*(s.stop(STOP_GRACE_S) for s in servers))
        for endpoint in (opts.management, opts.serving):
            if endpoint.socket is not None:
                with contextlib.suppress(OSError):
                    os.unlink(endpoint.socket)
    return 0


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(
        level=opts.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s meshd-demo: %(message)s"
    )
    loop_factory = None
    if opts.use_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass  # the default loop is fine, just slower
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(serve(opts))


if __name__ == "__main__":
    raise SystemExit(main())
