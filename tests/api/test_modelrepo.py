"""The model repository directory reader: names, types from each descriptor, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.api.modelrepo import (
    ModelDirectory,
    check_name,
    model_info,
    type_from_mlserver_settings,
    type_from_triton_config,
)
from meshd.core.errors import FailedPrecondition, InvalidArgument, NotFound
from meshd.decisions.ids import ModelInfo


def folder(root: Path, name: str, files: dict[str, str] | None = None) -> Path:
    d = root / name
    d.mkdir(parents=True)
    for fname, text in (files or {}).items():
        (d / fname).write_text(text)
    return d


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../x", "/etc", "a\\b", "", "x\x00y"])
def test_names_that_are_not_one_folder_are_refused(name: str) -> None:
    with pytest.raises(InvalidArgument):
        check_name(name)


@pytest.mark.parametrize("name", ["m1", "my.model-2", "..a", "a..b", "ünï"])
def test_plain_names_pass(name: str) -> None:
    assert check_name(name) == name


def test_a_name_longer_than_a_folder_name_is_invalid_not_an_os_error(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    repo = ModelDirectory(tmp_path / "repo", default_type="demo")
    with pytest.raises(InvalidArgument, match="longer than a folder name"):
        repo.find("m" * 256)
    with pytest.raises(NotFound):
        repo.find("m" * 255)


def test_escaping_names_are_refused_before_the_disk_is_read(tmp_path: Path) -> None:
    (tmp_path / "secret").mkdir()
    repo = ModelDirectory(tmp_path / "repo", default_type="demo")
    with pytest.raises(InvalidArgument):
        repo.find("../secret")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('name: "m"\nplatform: "onnxruntime_onnx"\n', "onnx"),
        ('platform: "pytorch_libtorch"', "pytorch"),
        ('platform: "tensorflow_savedmodel"', "tensorflow"),
        ('backend: "onnxruntime"\nmax_batch_size: 8', "onnx"),
        ('backend: "python"', "python"),
        ('backend: "fil"', "fil"),  # unknown: the backend's own name
        ('platform: "tensorrt_plan"\nbackend: "python"', "tensorrt"),  # platform wins
        ('input [\n  {\n    name: "x"\n  }\n]\n', None),
        ('ensemble_scheduling {\n  step [ { backend: "python" } ]\n}', None),  # only top-level fields
    ],
)
def test_type_from_triton_config(text: str, expected: str | None) -> None:
    assert type_from_triton_config(text) == expected


def test_type_from_mlserver_settings() -> None:
    assert type_from_mlserver_settings('{"implementation": "mlserver_sklearn.SKLearnModel"}', "s") == "sklearn"
    assert type_from_mlserver_settings('{"implementation": "my.Runtime"}', "s") == "my.Runtime"
    assert type_from_mlserver_settings('{"name": "m"}', "s") is None
    with pytest.raises(FailedPrecondition, match="not valid JSON"):
        type_from_mlserver_settings("{", "s")
    with pytest.raises(FailedPrecondition, match="implementation"):
        type_from_mlserver_settings('{"implementation": 3}', "s")


def test_meshd_file_gives_type_key_and_path(tmp_path: Path) -> None:
    d = tmp_path / "m"
    meta = {"type": "demo", "key": {"meshd": {"min_copies": 2}}, "path": "weights.json"}
    info = model_info(d, {"meshd-model.json": json.dumps(meta), "config.pbtxt": 'platform: "onnxruntime_onnx"'})
    assert info == ModelInfo("demo", str(d / "weights.json"), '{"meshd":{"min_copies":2}}')
    assert model_info(d, {"meshd-model.json": '{"key": "k"}'}, default_type="x") == ModelInfo("x", str(d), "k")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "JSON object"),
        ('{"type": 3}', "'type' must be a string"),
        ('{"tpye": "demo"}', "unknown field"),
        ('{"type": "demo", "key": 5}', "'key' must be a string"),
        ('{"type": "demo", "key": {"meshd": {"min_copies": "two"}}}', "modelInfo.key"),
        ("nope", "not valid JSON"),
    ],
)
def test_bad_meshd_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(FailedPrecondition, match=message):
        model_info(tmp_path / "m", {"meshd-model.json": text})


def test_type_precedence_and_default(tmp_path: Path) -> None:
    d = tmp_path / "m"
    both = {"config.pbtxt": 'backend: "python"', "model-settings.json": '{"implementation": "x.Y"}'}
    assert model_info(d, both).type == "python"
    assert model_info(d, {"model-settings.json": '{"implementation": "x.Y"}'}).type == "x.Y"
    assert model_info(d, {}, default_type="demo") == ModelInfo("demo", str(d))
    with pytest.raises(FailedPrecondition, match="cannot tell the type"):
        model_info(d, {})


def test_directory_lists_and_finds_model_folders(tmp_path: Path) -> None:
    folder(tmp_path, "b", {"model.json": "{}"})
    folder(tmp_path, "a", {"config.pbtxt": 'platform: "onnxruntime_onnx"'})
    folder(tmp_path, ".hidden")
    (tmp_path / "loose-file.json").write_text("{}")
    repo = ModelDirectory(tmp_path, default_type="demo")
    assert repo.names() == ["a", "b"]
    assert repo.find("a") == ModelInfo("onnx", str((tmp_path / "a").absolute()))
    assert repo.find("b").type == "demo"
    for missing in ("c", "loose-file.json", ".hidden"):
        with pytest.raises(NotFound, match="neither registered nor in the model repository"):
            repo.find(missing)
    assert ModelDirectory(tmp_path / "absent").names() == []


def test_unreadable_descriptor_is_a_failed_precondition(tmp_path: Path) -> None:
    d = folder(tmp_path, "m")
    (d / "meshd-model.json").write_bytes(b"\xff\xfe")
    with pytest.raises(FailedPrecondition, match="not UTF-8"):
        ModelDirectory(tmp_path).find("m")
