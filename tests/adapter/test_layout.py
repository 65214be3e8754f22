"""Repository layouts the adapter builds for MLServer and Triton, and model sizing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.adapter import layout, sizing
from meshd.adapter.layout import LayoutError, MLServerLayout, ModelSource, TritonLayout


def source(model_id: str, model_type: str, path: Path, key: dict[str, object] | None = None) -> ModelSource:
    return ModelSource(model_id, model_type, path, key or {})


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return tmp_path / "repo"


def test_mlserver_single_file_gets_settings_for_its_type(tmp_path: Path, repo: Path) -> None:
    model = tmp_path / "src" / "model.joblib"
    model.parent.mkdir()
    model.write_bytes(b"weights")
    folder = layout.install(MLServerLayout(), repo, source("fraud-v1", "sklearn", model))
    assert folder == repo / "fraud-v1"
    settings = json.loads((folder / "model-settings.json").read_text())
    assert settings == {
        "name": "fraud-v1",
        "implementation": "mlserver_sklearn.SKLearnModel",
        "parameters": {"uri": "./model.joblib"},
    }
    assert (folder / "model.joblib").is_symlink() and (folder / "model.joblib").read_bytes() == b"weights"


def test_mlserver_folder_with_its_own_settings_keeps_them_but_takes_the_id(tmp_path: Path, repo: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "weights.bin").write_bytes(b"w")
    (src / "model-settings.json").write_text(
        json.dumps({"name": "old", "implementation": "custom.Runtime", "parameters": {"uri": "./weights.bin"}})
    )
    folder = layout.install(MLServerLayout(), repo, source("a/b c", "whatever", src))
    assert folder.parent == repo and folder.name.startswith("m-")  # not a safe folder name
    settings = json.loads((folder / "model-settings.json").read_text())
    assert settings["name"] == "a/b c" and settings["implementation"] == "custom.Runtime"
    assert (folder / "weights.bin").read_bytes() == b"w"
    assert json.loads((src / "model-settings.json").read_text())["name"] == "old"  # source untouched


def test_mlserver_folder_without_settings_and_unknown_types(tmp_path: Path, repo: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.json").write_text("{}")
    settings = json.loads(
        (layout.install(MLServerLayout(), repo, source("x", "xgboost", src)) / "model-settings.json").read_text()
    )
    assert settings["implementation"] == "mlserver_xgboost.XGBoostModel"
    assert settings["parameters"]["uri"] == "./model.json"
    with pytest.raises(LayoutError, match="no MLServer implementation for model type 'tensorflow'"):
        layout.install(MLServerLayout(), repo, source("y", "tensorflow", src))
    assert not (repo / "y").exists() and not any(p.name.startswith(".staging") for p in repo.iterdir())
    with pytest.raises(LayoutError, match="does not exist"):
        layout.install(MLServerLayout(), repo, source("z", "sklearn", tmp_path / "missing"))


def test_triton_single_file_gets_a_version_folder_and_a_minimal_config(tmp_path: Path, repo: Path) -> None:
    model = tmp_path / "exported.onnx"
    model.write_bytes(b"onnx")
    folder = layout.install(TritonLayout(), repo, source("resnet", "onnx", model))
    assert folder == repo / "resnet"
    assert (folder / "1" / "model.onnx").read_bytes() == b"onnx"
    assert (folder / "config.pbtxt").read_text() == 'name: "resnet"\nbackend: "onnxruntime"\n'


def test_triton_model_with_versions_and_config_is_linked_and_renamed(tmp_path: Path, repo: Path) -> None:
    src = tmp_path / "src"
    (src / "3").mkdir(parents=True)
    (src / "3" / "model.pt").write_bytes(b"pt")
    (src / "config.pbtxt").write_text('name: "something-else"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n')
    folder = layout.install(TritonLayout(), repo, source("ranker", "pytorch", src))
    assert (folder / "3" / "model.pt").read_bytes() == b"pt"
    assert not (folder / "1").exists()
    assert (folder / "config.pbtxt").read_text() == 'name: "ranker"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n'
    # A config without a name gets one.
    (src / "config.pbtxt").write_text('backend: "pytorch"\n')
    folder = layout.install(TritonLayout(), repo, source("ranker", "pytorch", src))  # replaces the old folder
    assert (folder / "config.pbtxt").read_text() == 'name: "ranker"\nbackend: "pytorch"\n'


def test_triton_savedmodel_folder_becomes_model_savedmodel(tmp_path: Path, repo: Path) -> None:
    src = tmp_path / "saved"
    (src / "variables").mkdir(parents=True)
    (src / "saved_model.pb").write_bytes(b"pb")
    folder = layout.install(TritonLayout(), repo, source("tf", "tensorflow", src))
    assert (folder / "1" / "model.savedmodel" / "saved_model.pb").read_bytes() == b"pb"


def test_triton_refuses_ids_it_cannot_name_and_unknown_types(tmp_path: Path, repo: Path) -> None:
    model = tmp_path / "m.bin"
    model.write_bytes(b"x")
    for bad in ("a/b", "..", "", "-x"):
        with pytest.raises(LayoutError, match="cannot be a Triton model name"):
            layout.install(TritonLayout(), repo, source(bad, "onnx", model))
    with pytest.raises(LayoutError, match="no Triton backend for model type 'sklearn'"):
        layout.install(TritonLayout(), repo, source("ok", "sklearn", model))


def test_uninstall_and_clear_remove_only_links(tmp_path: Path, repo: Path) -> None:
    model = tmp_path / "model.joblib"
    model.write_bytes(b"keep me")
    layout.install(MLServerLayout(), repo, source("m", "sklearn", model))
    layout.uninstall(MLServerLayout(), repo, "m")
    assert not (repo / "m").exists() and model.read_bytes() == b"keep me"
    layout.install(MLServerLayout(), repo, source("m2", "sklearn", model))
    layout.clear(repo)
    assert list(repo.iterdir()) == [] and model.exists()
    layout.uninstall(TritonLayout(), repo, "a/b")  # never installed: nothing to do


def test_model_type_comes_from_the_key_when_present() -> None:
    assert layout.model_type_of("demo", {"model_type": {"name": "SKLearn", "version": "1"}}) == "sklearn"
    assert layout.model_type_of("Onnx", {}) == "onnx"
    assert layout.model_type_of("onnx", {"model_type": "bad"}) == "onnx"


def test_sizes_declared_then_disk_times_multiplier_then_default() -> None:
    declared = '{"meshd": {"size_bytes": 5000}, "disk_size_bytes": 100}'
    assert sizing.model_size(declared, 999, 1.25, 7) == 5000
    assert sizing.model_size('{"disk_size_bytes": 1000}', 999, 1.25, 7) == 1250  # the key's disk size wins
    assert sizing.model_size("", 800, 1.25, 7) == 1000  # measured
    assert sizing.model_size("", None, 1.25, 7) == 7
    assert sizing.model_size("not json", 0, 2.0, 7) == 7
    assert sizing.capacity(1 << 30, 256 << 20) == 768 << 20
    assert sizing.capacity(100, 256 << 20) == sizing.MIN_CAPACITY_BYTES


def test_disk_usage_of_files_and_trees(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"123")
    (tmp_path / "d" / "e" / "b").write_bytes(b"45")
    (tmp_path / "d" / "dangling").symlink_to(tmp_path / "nowhere")
    assert sizing.disk_usage(tmp_path / "d") == 5
    assert sizing.disk_usage(tmp_path / "d" / "a") == 3


def test_the_repository_is_shared_safely(tmp_path: Path, repo: Path) -> None:
    # Model files inside the repository are refused (replacing the folder would delete them).
    repo.mkdir()
    inside = repo / "m1"
    inside.mkdir()
    (inside / "model.joblib").write_bytes(b"precious")
    with pytest.raises(LayoutError, match="inside the model server's repository"):
        layout.install(MLServerLayout(), repo, source("m1", "sklearn", inside))
    # A folder the adapter did not make is neither replaced nor cleared.
    model = tmp_path / "model.joblib"
    model.write_bytes(b"w")
    with pytest.raises(LayoutError, match="not made by the adapter"):
        layout.install(MLServerLayout(), repo, source("m1", "sklearn", model))
    layout.install(MLServerLayout(), repo, source("m2", "sklearn", model))
    layout.clear(repo)
    assert sorted(p.name for p in repo.iterdir()) == ["m1"]
    assert (inside / "model.joblib").read_bytes() == b"precious"
    layout.uninstall(MLServerLayout(), repo, "m1")  # not ours: left alone
    assert inside.exists()
    assert layout.overlap_problem(repo, tmp_path) is not None  # the root contains the repository
    assert layout.overlap_problem(repo, repo / "sub") is not None
    assert layout.overlap_problem(repo, tmp_path / "models") is None
    assert layout.overlap_problem(repo, None) is None


def test_what_counts_as_a_missing_model() -> None:
    import grpc

    from meshd.core.errors import means_model_missing

    code = grpc.StatusCode
    assert means_model_missing(code.NOT_FOUND, "Model m with version  not found")
    assert means_model_missing(code.UNAVAILABLE, "Request for unknown model: 'm' is not found")
    assert means_model_missing(code.INVALID_ARGUMENT, "Model m not found")
    assert not means_model_missing(code.UNAVAILABLE, "DNS resolution failed: Domain name not found")
    assert not means_model_missing(code.UNAVAILABLE, "failed to connect to all addresses")
    assert not means_model_missing(code.INTERNAL, "unknown model")
    assert not means_model_missing(code.INVALID_ARGUMENT, "input x not found")
