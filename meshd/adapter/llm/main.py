"""`meshd llm-runtime`: the process. One gRPC port serves the SPI and inference:

    meshd llm-runtime --engine llamacpp --engine-python /venvs/llama/bin/python --port 8085 \\
        --memory-bytes 4000000000 [-- --n_ctx 2048]

meshd then runs with `--runtime-port 8085`; words after `--` go to every engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from meshd._proto.inference import grpc_predict_v2_pb2_grpc as pb_grpc
from meshd._proto.meshd import llm_pb2_grpc
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.adapter import gpu, running, sizing, stored
from meshd.adapter.llm.calls import OpenAICalls, TextInference
from meshd.adapter.llm.engines import PACKAGES, PRESETS, RestartPolicy, check_template, engine_module
from meshd.adapter.llm.runtime import Engines, LlmConfig, LlmRuntime
from meshd.core.hostport import join as host_port
from meshd.observability.logs import setup_logging

log = logging.getLogger("meshd.llm")

MAX_MESSAGE_BYTES = 64 << 20
# What an engine needs from its environment for what meshd asks of it.
ENGINE_ENV = {"vllm": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}}  # /v1/load_lora_adapter


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshd llm-runtime",
        description="A ModelRuntime (SPI) for OpenAI-compatible LLM engines: one supervised engine process "
        "per loaded model; OpenAI calls and KServe text completions go to it.",
    )
    which = p.add_argument_group("the engine (one of these is required)").add_mutually_exclusive_group(required=True)
    which.add_argument("--engine", choices=sorted(PRESETS), help="which engine (its server's command line)")
    which.add_argument(
        "--engine-command",
        help="any other OpenAI-compatible engine: a command template with {python} {path} {name} {host} {port}",
    )
    p.add_argument(
        "--engine-python",
        default=sys.executable,
        help="{python}: the interpreter of the engine's venv, checked at start-up for the engine's module "
        "(default: meshd's own Python, %(default)s)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address of the SPI port (default 127.0.0.1; engines listen on 127.0.0.1)"
    )
    p.add_argument("--port", type=int, help="SPI and inference TCP port (this or --socket, or both; no default)")
    p.add_argument("--socket", type=Path, help="SPI and inference unix socket")
    p.add_argument(
        "--memory-bytes",
        type=int,
        help="the engines' memory budget: the cache's capacity "
        "(env MODEL_SERVER_MEM_REQ_BYTES or CONTAINER_MEM_REQ_BYTES; default half the host's memory)",
    )
    p.add_argument(
        "--gpu-capacity",
        choices=["on", "off"],
        help="on: engines run on a GPU; the capacity is the smallest visible GPU's memory (less the driver's "
        "reservation and --gpu-memory-overhead-bytes) and an engine's size the GPU memory of its processes, "
        "read through NVML (needs nvidia-ml-py; env MESHD_LLM_GPU_CAPACITY; default off: host memory)",
    )
    p.add_argument(
        "--gpu-memory-overhead-bytes",
        type=int,
        help="with --gpu-capacity on: what comes off the GPU's memory besides the engines "
        "(env MESHD_ADAPTER_GPU_OVERHEAD_BYTES; default 1 GiB)",
    )
    p.add_argument(
        "--default-model-size",
        type=int,
        help="size of a model before its engine runs (env DEFAULT_MODELSIZE; default 512 MiB)",
    )
    p.add_argument(
        "--loading-concurrency", type=int, default=1, help="engines starting at a time (default %(default)s)"
    )
    p.add_argument(
        "--loading-timeout-ms", type=int, default=120_000, help="an engine's start-up limit (default %(default)s)"
    )
    p.add_argument(
        "--adapter-slots",
        type=int,
        default=4,
        help="LoRA adapters an engine takes at a time (default %(default)s; give vLLM --max-loras N)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="an engine exiting more often than this within --restart-window-s is given up (default %(default)s)",
    )
    p.add_argument(
        "--restart-window-s", type=float, default=120.0, help="... within this many seconds (default %(default)g)"
    )
    p.add_argument("--model-root", type=Path, help="relative model paths are under this folder (default: the cwd)")
    stored.add_root_model_dir(p)
    p.add_argument(
        "--workdir", type=Path, default=Path(".meshd-llm"), help="engine logs go under it (default %(default)s)"
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the runtime's own log lines (default %(default)s; engines log under --workdir)",
    )
    p.add_argument("--log-format", help="log lines: text or json (env MESHD_LOG_FORMAT, default text)")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="-- ARGS...: passed to every engine")
    return p


MODULE_CHECK_TIMEOUT_S = 60.0
_FIND = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"


def module_problem(python: str, module: str) -> str | None:
    """What stops `python -m module` from running (None: the module is there). Found, not
    imported: importing an engine takes seconds."""
    try:
        proc = subprocess.run(
            [python, "-c", _FIND, module], capture_output=True, text=True, timeout=MODULE_CHECK_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not be run ({e})"
    if proc.returncode == 3:
        return f"has no module {module!r}"
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return f"could not look for module {module!r} (exit {proc.returncode}: {tail})"
    return None


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def config_from(a: argparse.Namespace, env: Mapping[str, str]) -> LlmConfig:
    """SystemExit with one line for a mistake."""
    if bool(a.engine) == bool(a.engine_command):
        raise SystemExit("meshd llm-runtime: give --engine or --engine-command (one of them)")
    template = a.engine_command or PRESETS[a.engine]
    try:
        check_template(template)
    except ValueError as e:
        raise SystemExit(f"meshd llm-runtime: {e}") from None
    if not os.access(a.engine_python, os.X_OK):
        raise SystemExit(f"meshd llm-runtime: --engine-python {a.engine_python!r} is not an executable")
    module = engine_module(template)
    if module is not None:
        problem = module_problem(a.engine_python, module)
        if problem is not None:
            install = PACKAGES.get(a.engine or "")
            hint = f"pip install '{install}' into it, or " if install else ""
            raise SystemExit(
                f"meshd llm-runtime: --engine-python {a.engine_python} {problem}, which the "
                f"{a.engine + ' engine' if a.engine else 'engine command'} runs: "
                f"{hint}point --engine-python at the engine's venv"
            )

    def number(flag: int | None, *names: str, default: int) -> int:
        if flag is not None:
            return flag
        for name in names:
            if env.get(name):
                try:
                    return int(env[name])
                except ValueError:
                    raise SystemExit(f"meshd llm-runtime: {name} must be an integer (got {env[name]!r})") from None
        return default

    extra = list(a.engine_args[1:] if a.engine_args[:1] == ["--"] else a.engine_args)
    capacity = number(
        a.memory_bytes, "MODEL_SERVER_MEM_REQ_BYTES", "CONTAINER_MEM_REQ_BYTES", default=_host_memory() // 2
    )
    nvml = None
    choice = a.gpu_capacity or env.get("MESHD_LLM_GPU_CAPACITY") or "off"
    if choice not in ("on", "off"):
        raise SystemExit(f"meshd llm-runtime: MESHD_LLM_GPU_CAPACITY must be on or off (got {choice!r})")
    if choice == "on":
        nvml = gpu.load_nvml()
        on_gpu = gpu.memory_per_model_bytes(env, nvml) if nvml is not None else None
        if on_gpu is None:
            raise SystemExit(
                "meshd llm-runtime: --gpu-capacity on, but NVML lists no visible GPU "
                "(nvidia-ml-py installed? a driver? CUDA_VISIBLE_DEVICES?)"
            )
        overhead = number(
            a.gpu_memory_overhead_bytes, "MESHD_ADAPTER_GPU_OVERHEAD_BYTES", default=sizing.DEFAULT_GPU_OVERHEAD_BYTES
        )
        capacity = sizing.capacity(on_gpu, overhead)
    return LlmConfig(
        engine=a.engine or "custom",
        template=template,
        python=a.engine_python,
        extra_args=tuple(extra),
        workdir=a.workdir,
        model_root=a.model_root,
        capacity_bytes=capacity,
        default_model_size=number(a.default_model_size, "DEFAULT_MODELSIZE", default=512 << 20),
        max_loading_concurrency=max(1, a.loading_concurrency),
        loading_timeout_ms=a.loading_timeout_ms,
        adapter_slots=max(0, a.adapter_slots),
        env=ENGINE_ENV.get(a.engine or "", {}),
        restart=RestartPolicy(max_restarts=max(0, a.max_restarts), window_s=a.restart_window_s),
        version=f"meshd-llm-runtime/{a.engine or 'custom'}",
        gpu=nvml,
    )


async def serve(a: argparse.Namespace, config: LlmConfig) -> int:
    storage = await stored.open_storage(stored.storage_root(a, os.environ))
    engines = Engines(config, storage)
    await engines.start()
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    server = grpc.aio.server(options=options)
    rt_grpc.add_ModelRuntimeServicer_to_server(LlmRuntime(engines), server)
    llm_pb2_grpc.add_OpenAIServicer_to_server(OpenAICalls(engines), server)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(TextInference(engines), server)
    stored.serve_disk_tier(server, storage)
    bound = []
    if a.port is not None:
        port = server.add_insecure_port(host_port(a.host, a.port))
        bound.append(host_port(a.host, port))
    if a.socket is not None:
        server.add_insecure_port(f"unix:{a.socket}")
        bound.append(f"unix:{a.socket}")
    await server.start()
    print(
        f"meshd llm-runtime ({config.engine}) ready on {' '.join(bound)}; capacity {config.capacity_bytes} bytes",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: engines are stopped first")
    if storage is not None:  # running pulls end now, as failed loads, rather than hold the exit
        await storage.close()
    await server.stop(grace=2.0)
    await engines.close()
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.port is None and a.socket is None:
        print("meshd llm-runtime: give --port and/or --socket", file=sys.stderr)
        return 2
    log_format = running.log_format("meshd llm-runtime", a.log_format, os.environ)
    if log_format is None:
        return 2
    try:
        config = config_from(a, os.environ)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    setup_logging(a.log_level, log_format)
    return running.run("meshd llm-runtime", serve(a, config))


if __name__ == "__main__":
    sys.exit(main())
