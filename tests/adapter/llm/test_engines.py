"""Engine command lines and restart backoff (pure)."""

from __future__ import annotations

import pytest

from meshd.adapter.llm.engines import (
    PRESETS,
    RestartPolicy,
    adapter_refusal,
    check_template,
    engine_argv,
    engine_module,
    restart_delay,
)


def test_presets_fill_in_path_name_host_and_port() -> None:
    argv = engine_argv(PRESETS["llamacpp"], "/v/bin/python", "/m/a b.gguf", "m-1", "127.0.0.1", 9001, ["--n_ctx", "64"])
    assert argv == [
        *("/v/bin/python", "-m", "llama_cpp.server", "--model", "/m/a b.gguf", "--model_alias", "m-1"),
        *("--host", "127.0.0.1", "--port", "9001", "--n_ctx", "64"),
    ]
    vllm = engine_argv(PRESETS["vllm"], "py", "/m", "n", "h", 1, [])
    assert vllm[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"] and "--served-model-name" in vllm
    for template in PRESETS.values():
        check_template(template)


@pytest.mark.parametrize(
    ("template", "words"),
    [("serve {path}", "{port}"), ("serve {port} {nope}", "bad engine command"), ("x {port} {", "bad engine command")],
)
def test_a_template_that_cannot_run_is_refused(template: str, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("{", r"\{").replace("}", r"\}")):
        check_template(template)


def test_restarts_back_off_doubling_and_give_up_when_they_keep_failing() -> None:
    policy = RestartPolicy(first_s=0.25, max_s=1.0, max_restarts=3, window_s=60)
    exits: list[int] = []
    delays = []
    for t in range(4):
        exits.append(t * 1000)
        delays.append(restart_delay(exits, t * 1000, policy))
    assert delays == [0.25, 0.5, 1.0, None]
    # Exits long ago do not count: a crash a day is restarted at once every time.
    assert restart_delay([0, 200_000], 200_000, policy) == 0.25


def test_the_module_an_engine_runs_is_known_to_check_its_venv() -> None:
    assert engine_module(PRESETS["llamacpp"]) == "llama_cpp"
    assert engine_module(PRESETS["vllm"]) == "vllm"
    assert engine_module("{python} -m mine.server --port {port}") == "mine"
    assert engine_module("/opt/engine --port {port}") is None  # runs no module of {python}
    assert engine_module("{python} serve.py {port}") is None


def test_only_engines_that_load_adapters_at_run_time_take_them() -> None:
    """llama.cpp's server has no run-time LoRA endpoint: an adapter there is refused, saying
    which engines take adapters (issue 45); vLLM and engines of the user's own are tried."""
    refusal = adapter_refusal("llamacpp")
    assert refusal is not None and "cannot load LoRA adapters at run time" in refusal and "vllm" in refusal
    assert adapter_refusal("sglang") is not None
    assert adapter_refusal("vllm") is None and adapter_refusal("custom") is None
