"""What a native proxy costs at its floor, next to meshd's native data plane (issue 18).

    python bench/native_floor.py [--duration S] [--repeat N] [--smoke]

The native data plane's CPU goals are ratios of the proxy's CPU per request to the runtime's
(100 B: at most 0.3; 1 MiB: at most 0.5). This asks how low a proxy can go at all, by running
the same warm echo request (concurrency 8) through, in front of one reference runtime:

    haproxy-bare    HAProxy with one frontend and one backend, no rules: HAProxy's floor
    meshd-rules     HAProxy with meshd's native configuration (serving/native/haproxy_config)
                    and its maps naming the model, per-call log off (metrics and log off)
    meshd           the same with the per-call log meshd reads for its metrics (the default)
    nginx           nginx `grpc_pass` with upstream keep-alive, no rules (when nginx is on PATH)

No meshd and no etcd run: the proxies talk to the runtime straight, so what is measured is
the proxy alone. CPU per request comes from /proc utime+stime over the measured window, as in
bench/proxy_overhead.py (whose load generator this uses); medians over --repeat runs, the
targets in a different order in each. Every child is stopped by PID on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from _shared import asyncio_run, command_line, log, sigterm_as_interrupt  # noqa: E402
from proxy_overhead import BIG_PAYLOAD, CLIENT_MAX_MESSAGE, INFER, MODEL_ID, TINY_PAYLOAD, drive  # noqa: E402

from meshd._proto.mmesh import model_runtime_pb2 as rt  # noqa: E402
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc  # noqa: E402
from meshd.runtimes.models import make_echo_request, write_echo_model  # noqa: E402
from meshd.serving.native.haproxy_config import PLAIN, Layout, render  # noqa: E402
from meshd.testing import haproxy  # noqa: E402
from meshd.testing.procs import Child, Children, free_port, port_open, wait_until  # noqa: E402

CONCURRENCY = 8
GOALS = {TINY_PAYLOAD: 0.3, BIG_PAYLOAD: 0.5}  # issue 18: proxy CPU / runtime CPU per request
LABELS = {TINY_PAYLOAD: "100 B", BIG_PAYLOAD: "1 MiB"}  # the whole request: tensor plus framing


def bare_haproxy(listen: int, runtime: int) -> str:
    return "\n".join(
        [
            "global",
            "  nbthread 1",
            "  tune.bufsize 65536",  # as meshd's configuration: the 1 MiB case is cheaper with it
            "defaults",
            "  mode http",
            "  timeout connect 1s",
            "  timeout client 1d",
            "  timeout server 1d",
            "frontend grpc",
            f"  bind 127.0.0.1:{listen} proto h2",
            "  default_backend be",
            "backend be",
            f"  server rt 127.0.0.1:{runtime} proto h2",
            "",
        ]
    )


def nginx_conf(listen: int, runtime: int, workdir: Path) -> str:
    return f"""worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx.err;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_max_body_size 64m;
  client_body_buffer_size 2m;
  http2_max_concurrent_streams 1000;
  keepalive_requests 100000000;
  upstream rt {{ server 127.0.0.1:{runtime}; keepalive 32; keepalive_requests 100000000; }}
  server {{
    listen 127.0.0.1:{listen} http2;
    location / {{ grpc_pass grpc://rt; grpc_buffer_size 1m; }}
  }}
}}
"""


def meshd_layout(listen: int, runtime: int, workdir: Path, log_socket: str | None) -> Layout:
    """meshd's native layout with maps that send the echo model to the runtime."""
    maps = {name: workdir / f"{name}.map" for name in ("methods", "local", "peers", "vmodels")}
    maps["methods"].write_text(f"{INFER} {PLAIN}\n")
    maps["local"].write_text(f"{MODEL_ID} 1\n")
    maps["peers"].write_text("")
    maps["vmodels"].write_text("")
    return Layout(
        listen=f"127.0.0.1:{listen}",
        python=f"127.0.0.1:{free_port()}",  # never used: every request is carried natively
        runtime=f"127.0.0.1:{runtime}",
        api_socket=str(workdir / "api.sock"),
        methods_map=str(maps["methods"]),
        local_map=str(maps["local"]),
        peers_map=str(maps["peers"]),
        vmodels_map=str(maps["vmodels"]),
        log_socket=log_socket,
    )


@contextlib.contextmanager
def log_sink(path: Path) -> Iterator[str]:
    """A unix datagram socket read (and dropped) as fast as HAProxy writes, as meshd reads it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    stop = threading.Event()

    def drain() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                sock.recv(4096)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield str(path)
    finally:
        stop.set()
        reader.join()
        sock.close()


def start_proxy(children: Children, name: str, argv: list[str], port: int) -> tuple[Child, tuple[int, ...]]:
    child = children.start(name, argv)

    def up() -> bool:
        if not child.alive():
            raise RuntimeError(f"{name} exited with {child.proc.returncode}:\n{child.log_tail()}")
        return port_open(port)

    wait_until(up, 15.0, f"{name} on port {port}")
    # nginx serves from a worker process: count the master and its workers.
    kids = Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split()
    return child, (child.pid, *(int(k) for k in kids))


async def measure(
    port: int, payload: int, pids: dict[str, int | tuple[int, ...]], duration_s: float
) -> tuple[float, int]:
    """proxy CPU / runtime CPU per request, and the errors in the window."""
    options = [("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE)]
    request = make_echo_request(MODEL_ID, payload).SerializeToString()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        m = await drive(channel, request, (("mm-model-id", MODEL_ID),), CONCURRENCY, 0.5, duration_s, pids)
    return m.cpu_s["proxy"] / m.cpu_s["runtime"], m.errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3.0, help="measured seconds per case (default 3)")
    p.add_argument("--repeat", type=int, default=3, help="runs; medians are reported (default 3)")
    p.add_argument("--smoke", action="store_true", help="the shortest run that covers every case")
    args = p.parse_args(argv)
    if not args.duration > 0 or args.repeat < 1:  # NaN too
        p.error("--duration must be > 0 and --repeat >= 1")
    duration, repeat = (0.3, 1) if args.smoke else (args.duration, args.repeat)
    sigterm_as_interrupt()
    found = haproxy.find_or_fetch()
    if found is None:
        print("no HAProxy found or fetched (meshd.testing.haproxy): nothing to measure", file=sys.stderr)
        return 1
    nginx = shutil.which("nginx")
    log(command_line("native_floor.py", argv))
    workdir = Path(tempfile.mkdtemp(prefix="meshd-native-floor-"))
    children = Children(workdir / "logs")
    ratios: dict[tuple[str, int], list[float]] = {}
    errors: dict[str, int] = {}
    try:
        runtime_port = free_port()
        runtime = children.python(
            "runtime", "meshd.runtimes.demo", ["--port", str(runtime_port), "--capacity-bytes", str(1 << 30)]
        )
        wait_until(lambda: port_open(runtime_port), 30.0, "the reference runtime")
        model = write_echo_model(workdir / f"{MODEL_ID}.json")
        with grpc.insecure_channel(f"127.0.0.1:{runtime_port}") as ch:
            load = rt.LoadModelRequest(modelId=MODEL_ID, modelType="demo", modelPath=str(model))
            rt_grpc.ModelRuntimeStub(ch).loadModel(load, timeout=30)
        with log_sink(workdir / "calls.sock") as sink:
            port = free_port()
            configs = {
                "haproxy-bare": bare_haproxy(port, runtime_port),
                "meshd-rules": render(meshd_layout(port, runtime_port, workdir, None)),
                "meshd": render(meshd_layout(port, runtime_port, workdir, sink)),
            }
            if nginx is not None:
                configs["nginx"] = nginx_conf(port, runtime_port, workdir)
            for run in range(repeat):
                names = list(configs)
                for name in names[run % len(names) :] + names[: run % len(names)]:
                    path = workdir / f"{name}.conf"
                    path.write_text(configs[name])
                    if name == "nginx":
                        assert nginx is not None
                        cmd = [nginx, "-c", str(path), "-g", "daemon off;"]
                    else:
                        cmd = [found, "-f", str(path)]
                    child, pids = start_proxy(children, f"{name}-{run}", cmd, port)
                    try:
                        for payload in GOALS:
                            roles: dict[str, int | tuple[int, ...]] = {"proxy": pids, "runtime": runtime.pid}
                            ratio, failed = asyncio_run(measure(port, payload, roles, duration))
                            ratios.setdefault((name, payload), []).append(ratio)
                            errors[name] = errors.get(name, 0) + failed
                            log(f"run {run + 1}/{repeat} {name} {LABELS[payload]}: proxy/runtime CPU {ratio:.3f}")
                    finally:
                        child.stop()
        print()
        print(f"proxy CPU / runtime CPU per request, concurrency {CONCURRENCY}, median of {repeat}")
        print(f"{'proxy':<14} {' '.join(f'{LABELS[size]:>8}' for size in GOALS)} {'errors':>7}")
        for name in configs:
            cells = [f"{statistics.median(ratios[(name, size)]):8.3f}" for size in GOALS]
            print(f"{name:<14} {' '.join(cells)} {errors[name]:7d}")
        print(f"{'goal':<14} {GOALS[TINY_PAYLOAD]:8.3f} {GOALS[BIG_PAYLOAD]:8.3f}")
        if nginx is None:
            print("(nginx not on PATH: its row left out)")
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
