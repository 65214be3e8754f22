"""The model repository directory: models that RepositoryModelLoad registers on first load.

A folder per model, named by the model id, under the directory `MESHD_MODEL_REPOSITORY`
names. Loading a name that is not registered looks for `<directory>/<name>/` and registers
it with (type, path, key) read from the folder, then loads it:

- `meshd-model.json` (optional): `{"type": str, "key": str | object, "path": str}`, every
  field optional; `path` is relative to the model folder (default: the folder itself), a
  `key` object is stored as its JSON text;
- else the type comes from Triton's `config.pbtxt` (`platform` or `backend`) or MLServer's
  `model-settings.json` (`implementation`), named as modelmesh-serving names model types;
- else the configured default type (`MESHD_MODEL_REPOSITORY_TYPE`); without one the load
  fails with FAILED_PRECONDITION naming the folder.

The registered path is the folder's absolute path as meshd sees it, so the runtime must see
the directory at the same path (or `meshd-model.json` names one it does). Names are one path
segment: `..`, `/`, `\\` and absolute paths are refused (INVALID_ARGUMENT) before the disk is
touched; folders whose name starts with `.` are never models. Parsing is pure (text in,
ModelInfo out); `ModelDirectory` only reads the files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from meshd.core.errors import FailedPrecondition, InvalidArgument, NotFound
from meshd.core.model_types import MLSERVER_IMPLEMENTATIONS, TRITON_BACKENDS
from meshd.decisions.ids import ModelInfo, check_id

MESHD_FILE = "meshd-model.json"
TRITON_CONFIG = "config.pbtxt"
MLSERVER_SETTINGS = "model-settings.json"
MAX_FOLDER_NAME_BYTES = 255  # NAME_MAX on Linux filesystems
MAX_FILE_BYTES = 1 << 20  # the small descriptor files; a bigger one is not what we think it is

# Triton platform names (config.pbtxt `platform`) -> model type; backends come from the adapter's table.
TRITON_PLATFORMS = {
    "onnxruntime_onnx": "onnx",
    "pytorch_libtorch": "pytorch",
    "tensorflow_savedmodel": "tensorflow",
    "tensorflow_graphdef": "tensorflow",
    "tensorrt_plan": "tensorrt",
}
_TRITON_BACKEND_TYPES = {backend: model_type for model_type, (backend, _) in TRITON_BACKENDS.items()}
_MLSERVER_TYPES = {impl: model_type for model_type, impl in MLSERVER_IMPLEMENTATIONS.items()}
# Top-level (unindented) `platform: "x"` / `backend: "x"` lines of a config.pbtxt (protobuf text format).
_PBTXT_FIELD = re.compile(r'^(platform|backend)\s*:\s*"([^"]*)"', re.MULTILINE)


def check_name(name: str) -> str:
    """The name as one safe path segment, or INVALID_ARGUMENT (pure)."""
    check_id(name, "model name")
    if name in {".", ".."} or "/" in name or "\\" in name or os.path.isabs(name):
        raise InvalidArgument(f"model name {name!r} must be a single folder name inside the model repository")
    if len(os.fsencode(name)) > MAX_FOLDER_NAME_BYTES:
        raise InvalidArgument(f"model name is longer than a folder name can be ({MAX_FOLDER_NAME_BYTES} bytes)")
    return name


def type_from_triton_config(text: str) -> str | None:
    """The model type a Triton config.pbtxt implies: its platform, else its backend."""
    fields: dict[str, str] = {}
    for m in _PBTXT_FIELD.finditer(text):
        fields.setdefault(m.group(1), m.group(2))
    if fields.get("platform"):
        return TRITON_PLATFORMS.get(fields["platform"], fields["platform"])
    if fields.get("backend"):
        return _TRITON_BACKEND_TYPES.get(fields["backend"], fields["backend"])
    return None


def type_from_mlserver_settings(text: str, source: str) -> str | None:
    """The model type an MLServer model-settings.json implies (its implementation class)."""
    data = _json_object(text, source)
    impl = data.get("implementation")
    if impl is None:
        return None
    if not isinstance(impl, str) or not impl:
        raise FailedPrecondition(f"{source}: 'implementation' must be a non-empty string")
    return _MLSERVER_TYPES.get(impl, impl)


def model_info(folder: Path, files: Mapping[str, str], default_type: str = "") -> ModelInfo:
    """ModelInfo for the model in `folder`, from its descriptor files' text (name -> text)."""
    model_type: str | None = None
    key = ""
    path = str(folder)
    if MESHD_FILE in files:
        source = str(folder / MESHD_FILE)
        data = _json_object(files[MESHD_FILE], source)
        unknown = sorted(set(data) - {"type", "key", "path"})
        if unknown:
            raise FailedPrecondition(f"{source}: unknown field(s) {unknown} (known: type, key, path)")
        model_type = _optional_str(data, "type", source)
        raw_key = data.get("key")
        if isinstance(raw_key, dict):
            key = json.dumps(raw_key, separators=(",", ":"))
        elif raw_key is not None:
            key = _optional_str(data, "key", source) or ""
        rel = _optional_str(data, "path", source)
        if rel:
            path = str(folder / rel)  # an absolute `path` replaces the folder (pathlib's rule)
    if not model_type and TRITON_CONFIG in files:
        model_type = type_from_triton_config(files[TRITON_CONFIG])
    if not model_type and MLSERVER_SETTINGS in files:
        model_type = type_from_mlserver_settings(files[MLSERVER_SETTINGS], str(folder / MLSERVER_SETTINGS))
    model_type = model_type or default_type
    if not model_type:
        raise FailedPrecondition(
            f"cannot tell the type of the model in {folder}: add {MESHD_FILE} with a 'type', "
            f"a {TRITON_CONFIG} or {MLSERVER_SETTINGS}, or set MESHD_MODEL_REPOSITORY_TYPE"
        )
    try:
        return ModelInfo(model_type, path, key).check()
    except InvalidArgument as e:
        raise FailedPrecondition(f"{folder}: {e.message}") from None


class ModelDirectory:
    """Reads model folders under `root` (blocking file I/O: call it off the event loop)."""

    def __init__(self, root: Path, default_type: str = "") -> None:
        self.root = root.absolute()
        self.default_type = default_type

    def names(self) -> list[str]:
        """Every model folder's name, sorted (an unreadable directory lists nothing)."""
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return []
        return sorted(e.name for e in entries if not e.name.startswith(".") and _is_dir(e))

    def find(self, name: str) -> ModelInfo:
        """The ModelInfo to register `name` with: INVALID_ARGUMENT for a name that is not one
        folder name, NOT_FOUND without such a folder, FAILED_PRECONDITION for unusable files."""
        check_name(name)
        folder = self.root / name
        try:
            is_folder = folder.is_dir()
        except OSError as e:  # e.g. a name the filesystem refuses
            raise InvalidArgument(f"model name {name!r} cannot be a folder here: {e.strerror}") from None
        if name.startswith(".") or not is_folder:
            raise NotFound(f"model {name!r} is neither registered nor in the model repository {self.root}")
        files: dict[str, str] = {}
        for fname in (MESHD_FILE, TRITON_CONFIG, MLSERVER_SETTINGS):
            text = _read_small(folder / fname)
            if text is not None:
                files[fname] = text
        return model_info(folder, files, self.default_type)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # follows symlinks: a linked model folder counts
    except OSError:
        return False


def _read_small(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FailedPrecondition(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise FailedPrecondition(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise FailedPrecondition(f"{path} is not UTF-8 text") from None


def _json_object(text: str, source: str) -> dict[str, object]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise FailedPrecondition(f"{source}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise FailedPrecondition(f"{source}: must hold a JSON object, not {type(data).__name__}")
    return data


def _optional_str(data: Mapping[str, object], field: str, source: str) -> str | None:
    value = data.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise FailedPrecondition(f"{source}: {field!r} must be a string, not {type(value).__name__}")
    return value
