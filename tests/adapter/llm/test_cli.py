"""`meshd llm-runtime`'s command line: what --help says, and the mistakes it refuses at start-up
rather than at the first request (issue 45)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshd.adapter.llm.main import build_parser, main, module_problem


def test_help_gives_the_defaults_and_says_an_engine_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in (
        "engines starting at a time (default 1)",
        "start-up limit (default 120000)",
        "(default 5)",
        "seconds (default 120)",
        "(default .meshd-llm)",
        "default: meshd's own Python",
        "the runtime's own log lines (default INFO",
        "one of these is required",
    ):
        assert words in text, words
    assert "(--engine {llamacpp,sglang,vllm} | --engine-command ENGINE_COMMAND)" in text


def test_no_engine_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--port", "1"])
    assert done.value.code == 2
    assert "one of the arguments --engine --engine-command is required" in capsys.readouterr().err


def test_an_engine_python_without_the_engines_module_is_refused_at_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """meshd's own Python has no llama_cpp: said at once, with what to do, before serving."""
    assert main(["--engine", "llamacpp", "--port", "1", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--engine-python {sys.executable} has no module 'llama_cpp'" in err, err
    assert "pip install 'llama-cpp-python[server]'" in err and "point --engine-python at the engine's venv" in err
    assert module_problem(sys.executable, "json") is None
    assert "could not be run" in (module_problem(str(tmp_path / "no-python"), "json") or "")


def test_gpu_capacity_on_without_a_visible_gpu_is_refused_at_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-none")  # whatever NVML finds here, none is visible
    argv = ["--engine-command", "x {port}", "--port", "1", "--workdir", str(tmp_path), "--gpu-capacity", "on"]
    assert main(argv) == 2
    assert "--gpu-capacity on, but NVML lists no visible GPU" in capsys.readouterr().err
    monkeypatch.setenv("MESHD_LLM_GPU_CAPACITY", "maybe")
    assert main(argv[:-2]) == 2
    assert "MESHD_LLM_GPU_CAPACITY must be on or off (got 'maybe')" in capsys.readouterr().err
