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
    # A plain string, as upstream's GetModelType also takes it; `:<version>` dropped.
    assert layout.model_type_of("demo", {"model_type": "ONNX"}) == "onnx"
    assert layout.model_type_of("demo", {"model_type": {"name": "tensorflow:2"}}) == "tensorflow"
    assert layout.model_type_of("onnx", {"model_type": 7}) == "onnx"
    assert layout.model_type_of("onnx", {"model_type": {"name": ""}}) == "onnx"


def test_sizes_declared_then_disk_times_multiplier_then_default() -> None:
    declared = '{"meshd": {"size_bytes": 5000}, "disk_size_bytes": 100}'
    assert sizing.model_size(declared, 999, 1.25, 7) == 5000
    assert sizing.model_size('{"disk_size_bytes": 1000}', 999, 1.25, 7) == 1250  # the key's disk size wins
    assert sizing.model_size("", 800, 1.25, 7) == 1000  # measured
    assert sizing.model_size("", None, 1.25, 7) == 7
    assert sizing.model_size("not json", 0, 2.0, 7) == 7
    # Upstream decodes JSON numbers as floats: a whole float is a size, not "unknown".
    assert sizing.model_size('{"disk_size_bytes": 1000.0}', 999, 1.25, 7) == 1250
    assert sizing.model_size('{"disk_size_bytes": 10.5}', 800, 1.25, 7) == 1000  # not whole: measured
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


def _tree(folder: Path) -> dict[str, str]:
    """Each link in the folder (recursively, not through links) -> where it points."""
    return {str(p.relative_to(folder)): str(p.readlink()) for p in sorted(folder.rglob("*")) if p.is_symlink()}


def test_triton_one_file_of_a_known_type_takes_the_backends_name(tmp_path: Path, repo: Path) -> None:
    # Upstream: a folder (or its largest version folder) with one entry of a known type.
    src = tmp_path / "mnist"
    src.mkdir()
    (src / "mnist.onnx").write_bytes(b"o")
    (src / "_schema.json").write_text("{}")  # upstream's old schema file is not a model file
    assert _tree(layout.install(TritonLayout(), repo, source("a", "onnx", src))) == {
        "1/model.onnx": str(src / "mnist.onnx")
    }
    versioned = tmp_path / "resnet"
    for v in ("1", "3"):
        (versioned / v).mkdir(parents=True)
        (versioned / v / "resnet.pt").write_bytes(v.encode())
    assert _tree(layout.install(TritonLayout(), repo, source("b", "pytorch", versioned))) == {
        "3/model.pt": str(versioned / "3" / "resnet.pt")
    }
    plan = tmp_path / "engine"
    (plan / "2").mkdir(parents=True)
    (plan / "2" / "x.plan").write_bytes(b"p")
    assert _tree(layout.install(TritonLayout(), repo, source("c", "tensorrt", plan))) == {
        "2/model.plan": str(plan / "2" / "x.plan")
    }


def test_triton_tensorflow_graphdef_file_and_wrapped_savedmodel(tmp_path: Path, repo: Path) -> None:
    graph = tmp_path / "frozen.pb"
    graph.write_bytes(b"g")
    folder = layout.install(TritonLayout(), repo, source("g", "tensorflow", graph))
    assert _tree(folder) == {"1/model.graphdef": str(graph)}
    assert (folder / "config.pbtxt").read_text() == 'name: "g"\nbackend: "tensorflow"\n'
    wrapper = tmp_path / "wrapper"
    (wrapper / "export" / "variables").mkdir(parents=True)
    (wrapper / "export" / "saved_model.pb").write_bytes(b"s")
    assert _tree(layout.install(TritonLayout(), repo, source("w", "tensorflow", wrapper))) == {
        "1/model.savedmodel": str(wrapper / "export")
    }


def test_triton_keras_folder_is_a_savedmodel_and_a_keras_file_is_refused(tmp_path: Path, repo: Path) -> None:
    saved = tmp_path / "keras"
    (saved / "variables").mkdir(parents=True)
    (saved / "saved_model.pb").write_bytes(b"s")
    folder = layout.install(TritonLayout(), repo, source("k", "keras", saved))
    assert _tree(folder) == {"1/model.savedmodel": str(saved)}
    assert (folder / "config.pbtxt").read_text() == 'name: "k"\nbackend: "tensorflow"\n'
    h5 = tmp_path / "m.h5"
    h5.write_bytes(b"h")
    with pytest.raises(LayoutError, match="single Keras file"):
        layout.install(TritonLayout(), repo, source("k2", "keras", h5))


def test_mlserver_mllib_has_an_implementation(tmp_path: Path, repo: Path) -> None:
    (tmp_path / "spark").mkdir()
    (tmp_path / "spark" / "metadata").mkdir()
    folder = layout.install(MLServerLayout(), repo, source("s", "mllib", tmp_path / "spark"))
    assert json.loads((folder / "model-settings.json").read_text())["implementation"] == "mlserver_mllib.MLlibModel"


def test_triton_native_config_names_are_set_at_the_top_level_only(tmp_path: Path, repo: Path) -> None:
    src = tmp_path / "src"
    (src / "1").mkdir(parents=True)
    (src / "1" / "model.onnx").write_bytes(b"o")
    nested = 'platform: "onnxruntime_onnx"\ninput [\n{\nname: "x"\ndims: [ 4 ]\n}\n]\n'
    for config, expected in [
        (nested, 'name: "m"\n' + nested),
        (
            'name: "old"  # exported\nplatform: "onnxruntime_onnx"\n',
            'name: "m"  # exported\nplatform: "onnxruntime_onnx"\n',
        ),
        ("name:'old' platform: 'onnxruntime_onnx'", "name:\"m\" platform: 'onnxruntime_onnx'"),
    ]:
        (src / "config.pbtxt").write_text(config)
        assert (layout.install(TritonLayout(), repo, source("m", "onnx", src)) / "config.pbtxt").read_text() == expected
    (src / "config.pbtxt").write_text('name: "open\n')
    with pytest.raises(LayoutError, match=r"config.pbtxt as protobuf text: unterminated string"):
        layout.install(TritonLayout(), repo, source("m", "onnx", src))


SCHEMA = {
    "inputs": [{"name": "in0", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "out0", "datatype": "INT64", "shape": [-1]}],
}


def test_triton_schema_becomes_the_configs_inputs_and_outputs(tmp_path: Path, repo: Path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    model = tmp_path / "m.onnx"
    model.write_bytes(b"o")
    made = layout.install(TritonLayout(), repo, ModelSource("a", "onnx", model, {}, schema_file))
    assert (made / "config.pbtxt").read_text() == (
        'name: "a"\nbackend: "onnxruntime"\n'
        'input [\n  { name: "in0" data_type: TYPE_FP32 dims: [ -1, 4 ] }\n]\n'
        'output [\n  { name: "out0" data_type: TYPE_INT64 dims: [ -1 ] }\n]\n'
    )
    src = tmp_path / "native"
    (src / "1").mkdir(parents=True)
    (src / "1" / "model.onnx").write_bytes(b"o")
    (src / "config.pbtxt").write_text('max_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP64 dims: [ 4 ] } ]\n')
    made = layout.install(TritonLayout(), repo, ModelSource("b", "onnx", src, {}, schema_file))
    text = (made / "config.pbtxt").read_text()
    assert 'name: "x"' not in text and 'name: "in0" data_type: TYPE_FP32 dims: [ 4 ]' in text and "dims: [  ]" in text
    with pytest.raises(LayoutError, match=r"schema .* is not a file"):
        layout.install(TritonLayout(), repo, ModelSource("c", "onnx", model, {}, tmp_path / "missing.json"))


def test_mlserver_schema_goes_into_generated_and_own_settings(tmp_path: Path, repo: Path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    model = tmp_path / "model.joblib"
    model.write_bytes(b"j")
    made = layout.install(MLServerLayout(), repo, ModelSource("a", "sklearn", model, {}, schema_file))
    settings = json.loads((made / "model-settings.json").read_text())
    assert settings["inputs"] == SCHEMA["inputs"] and settings["outputs"] == SCHEMA["outputs"]
    src = tmp_path / "own"
    src.mkdir()
    (src / "model-settings.json").write_text(json.dumps({"name": "x", "implementation": "c.R", "inputs": []}))
    made = layout.install(MLServerLayout(), repo, ModelSource("b", "whatever", src, {}, schema_file))
    settings = json.loads((made / "model-settings.json").read_text())
    assert settings["inputs"] == SCHEMA["inputs"] and settings["implementation"] == "c.R"


def test_schema_path_must_be_a_string() -> None:
    assert layout.schema_path_of({}) is None and layout.schema_path_of({"schema_path": "/s.json"}) == "/s.json"
    with pytest.raises(LayoutError, match="must be a string"):
        layout.schema_path_of({"schema_path": {"a": 1}})


def test_files_that_cannot_be_followed_or_read_fail_naming_them(tmp_path: Path, repo: Path) -> None:
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "model.joblib").write_bytes(b"x")
    (loop / "l1").symlink_to("l2")
    (loop / "l2").symlink_to("l1")
    with pytest.raises(LayoutError, match=r"cannot follow .*loop/l1"):
        layout.install(MLServerLayout(), repo, source("m", "sklearn", loop))
    binary = tmp_path / "bin"
    (binary / "1").mkdir(parents=True)
    (binary / "config.pbtxt").write_bytes(b"\xff\xfe name")
    with pytest.raises(LayoutError, match=r"bin/config.pbtxt is not UTF-8 text"):
        layout.install(TritonLayout(), repo, source("b", "onnx", binary))
    assert sorted(p.name for p in loop.iterdir()) == ["l1", "l2", "model.joblib"]  # nothing lost
    assert list(repo.iterdir()) == []  # and nothing half-made
