"""Model directories in the model server's repository, in the layout each server needs.

meshd's `loadModel` names a model by id, type, path and key; Triton and MLServer load models by
name from a repository folder. The adapter gives each model its own folder there, made from
the model's files (symlinked, never copied or modified) plus what the server needs:

- MLServer: `<repo>/<dir>/model-settings.json` with `name` = the model id, and the
  `implementation` for the model type (kept if the model brings its own settings file, whose
  relative `uri` keeps working because the files sit beside it);
- Triton: `<repo>/<model id>/config.pbtxt` (the model's own, with its `name` set to the id, or
  a minimal one naming the backend for the type) and a version folder `1/` holding the model
  file under the backend's default name, unless the model already has version folders.

A folder is built under a temporary name and renamed into place, so the server never sees
half of one. Each folder the adapter makes carries a marker file, and only marked folders are
ever removed: the repository may hold other things, and model files are never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from meshd.adapter import pbtxt
from meshd.adapter import schema as model_schema
from meshd.core.model_types import (
    MLSERVER_IMPLEMENTATIONS,
    TRITON_BACKENDS,
    TRITON_FOLDER_NAMES,
    TRITON_KERAS,
    triton_backend,
)

MLSERVER_SETTINGS = "model-settings.json"
MARKER = ".meshd-adapter"  # in every folder the adapter makes, and only those
TRITON_CONFIG = "config.pbtxt"
SCHEMA_PATH_KEY = "schema_path"  # upstream: the model's schema file, local once pulled

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class LayoutError(ValueError):
    """The model cannot be laid out for this server (the load fails with this message)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    model_id: str
    model_type: str
    path: Path
    key: dict[str, Any]
    schema: Path | None = None  # the key's schema_path, applied to the server's config


def model_type_of(registered_type: str, key: dict[str, Any]) -> str:
    """The key's `model_type` (`{"name": ...}` as modelmesh-serving writes it, or a plain
    string), else the registered type; lower case, without a `:<version>` tail (upstream)."""
    mt = key.get("model_type")
    name = mt.get("name") if isinstance(mt, dict) else mt
    chosen = name if isinstance(name, str) and name else registered_type
    return chosen.split(":", 1)[0].lower()


def schema_path_of(key: dict[str, Any]) -> str | None:
    """The key's `schema_path` (None: none); anything but a string is refused (upstream)."""
    raw = key.get(SCHEMA_PATH_KEY)
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise LayoutError(f"{SCHEMA_PATH_KEY} in the model key must be a string, got {json.dumps(raw)[:60]}")
    return raw


class Layout(Protocol):
    server: str

    def directory_name(self, model_id: str) -> str: ...

    def build(self, source: ModelSource, target: Path) -> None: ...


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except RuntimeError as e:  # a symlink loop (OSError from Python 3.13)
        raise LayoutError(f"cannot follow {path}: {e}") from None


def _link(link: Path, to: Path) -> None:
    link.symlink_to(_resolved(to))


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.iterdir())


def _link_entries(source_dir: Path, target: Path, skip: frozenset[str] = frozenset()) -> None:
    for entry in _entries(source_dir):
        if entry.name not in skip:
            _link(target / entry.name, entry)


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode()
    except UnicodeDecodeError as e:
        raise LayoutError(f"{path} is not UTF-8 text (byte {e.start})") from None


def _schema(source: ModelSource) -> model_schema.Schema | None:
    if source.schema is None:
        return None
    if not source.schema.is_file():
        raise LayoutError(f"the model's schema {source.schema} is not a file")
    try:
        return model_schema.parse(_read_text(source.schema))
    except model_schema.SchemaError as e:
        raise LayoutError(f"the model's schema {source.schema}: {e}") from None


class MLServerLayout:
    server = "mlserver"

    def directory_name(self, model_id: str) -> str:
        # MLServer finds a model by the name in its settings file, not by folder: any id works.
        if _SAFE_NAME.match(model_id):
            return model_id
        return "m-" + hashlib.sha256(model_id.encode()).hexdigest()[:32]

    def build(self, source: ModelSource, target: Path) -> None:
        path = source.path
        if path.is_dir():
            settings_file = path / MLSERVER_SETTINGS
            _link_entries(path, target, skip=frozenset({MLSERVER_SETTINGS}))
            if settings_file.is_file():
                settings = _read_json(settings_file)
            else:
                files = [p for p in _entries(path) if not p.name.startswith(".")]
                uri = f"./{files[0].name}" if len(files) == 1 and files[0].is_file() else "."
                settings = self._new_settings(source, uri)
        else:
            _link(target / path.name, path)
            settings = self._new_settings(source, f"./{path.name}")
        settings["name"] = source.model_id
        schema = _schema(source)
        if schema is not None:
            settings = model_schema.mlserver_settings(settings, schema)
        (target / MLSERVER_SETTINGS).write_text(json.dumps(settings, indent=2))

    def _new_settings(self, source: ModelSource, uri: str) -> dict[str, Any]:
        implementation = MLSERVER_IMPLEMENTATIONS.get(source.model_type)
        if implementation is None:
            known = ", ".join(sorted(MLSERVER_IMPLEMENTATIONS))
            raise LayoutError(
                f"no MLServer implementation for model type {source.model_type!r} (known: {known}); "
                f"put a {MLSERVER_SETTINGS} beside the model"
            )
        return {"name": source.model_id, "implementation": implementation, "parameters": {"uri": uri}}


class TritonLayout:
    server = "triton"

    def directory_name(self, model_id: str) -> str:
        # Triton names a model by its folder, so the folder must be the id itself.
        if not _SAFE_NAME.match(model_id):
            raise LayoutError(
                f"model id {model_id!r} cannot be a Triton model name "
                "(letters, digits, '.', '_' and '-', starting with a letter or digit)"
            )
        return model_id

    def build(self, source: ModelSource, target: Path) -> None:
        path = source.path
        config = path / TRITON_CONFIG
        if path.is_dir() and config.is_file():
            # The model's own layout: its config (renamed) and its files as they are.
            text = _with_name(_read_text(config), source.model_id, config)
            self._link_native(source, target)
        else:
            text = self._minimal_config(source)
            self._link_files(source, target)
        schema = _schema(source)
        if schema is not None:
            try:
                text = model_schema.triton_config(text, schema)
            except (model_schema.SchemaError, pbtxt.PbtxtError) as e:
                raise LayoutError(f"cannot apply the schema {source.schema} to {TRITON_CONFIG}: {e}") from None
        (target / TRITON_CONFIG).write_text(text)

    def _link_native(self, source: ModelSource, target: Path) -> None:
        path = source.path
        if any(p.is_dir() and p.name.isdigit() for p in _entries(path)):
            _link_entries(path, target, skip=frozenset({TRITON_CONFIG}))
            return
        version = target / "1"
        version.mkdir()
        folder_name = TRITON_FOLDER_NAMES.get(source.model_type)
        if folder_name == "model.savedmodel":
            _link(version / folder_name, path)
        else:
            _link_entries(path, version, skip=frozenset({TRITON_CONFIG}))

    def _link_files(self, source: ModelSource, target: Path) -> None:
        """Upstream's layout for model files without a config: the largest version folder
        (or the files themselves as version 1); one entry of a known type takes the name
        its backend looks for (model.onnx, model.pt, model.plan, model.graphdef for a file,
        model.savedmodel for a TensorFlow or Keras folder)."""
        path, model_type, version = source.path, source.model_type, "1"
        known = model_type in TRITON_BACKENDS or model_type in TRITON_FOLDER_NAMES
        if path.is_dir():
            entries = [e for e in _entries(path) if e.name != model_schema.SCHEMA_FILE]
            largest = _largest_version(entries)
            if largest is not None:
                version, path = largest.name, largest
                entries = _entries(path)
            if len(entries) == 1 and known:
                path = entries[0]
        folder = target / version
        folder.mkdir()
        if path.is_dir():
            folder_name = TRITON_FOLDER_NAMES.get(model_type)
            if folder_name is not None:
                _link(folder / folder_name, path)
            else:
                _link_entries(path, folder)
        else:
            if model_type == TRITON_KERAS:
                raise LayoutError(
                    f"{path} is a single Keras file: Triton serves Keras as a TensorFlow SavedModel folder "
                    "(upstream converts .h5 files with TensorFlow, which the adapter does not ship); "
                    "export the model with model.save(<folder>) and register the folder"
                )
            file_name = TRITON_BACKENDS[model_type][1] if model_type in TRITON_BACKENDS else path.name
            _link(folder / file_name, path)

    def _minimal_config(self, source: ModelSource) -> str:
        backend = triton_backend(source.model_type)
        if backend is None:
            known = ", ".join(sorted({*TRITON_BACKENDS, TRITON_KERAS}))
            raise LayoutError(
                f"no Triton backend for model type {source.model_type!r} (known: {known}); "
                f"put a {TRITON_CONFIG} beside the model"
            )
        # Triton completes inputs and outputs itself for most backends (auto-complete config).
        return f'name: "{source.model_id}"\nbackend: "{backend}"\n'


def _largest_version(entries: list[Path]) -> Path | None:
    """The largest numbered folder, when every folder is numbered (upstream: files are
    ignored, and one folder of any other name means there are no version folders)."""
    best: tuple[int, Path] | None = None
    for entry in entries:
        if not entry.is_dir():
            continue
        if not entry.name.isdigit():
            return None
        number = int(entry.name)
        if number > 0 and (best is None or number > best[0]):
            best = (number, entry)
    return best[1] if best else None


def _with_name(config: str, model_id: str, where: Path) -> str:
    """The model's own config.pbtxt with its top-level name set to the id (Triton requires the
    name to match the folder, or be absent): a `name` inside a block or a comment is left alone."""
    try:
        return pbtxt.set_field(config, "name", pbtxt.quote(model_id))
    except pbtxt.PbtxtError as e:
        raise LayoutError(f"cannot read {where} as protobuf text: {e}") from None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LayoutError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise LayoutError(f"{path} is not a JSON object")
    return data


def overlap_problem(repository: Path, model_root: Path | None) -> str | None:
    """Why the repository and the model root cannot be used together (None: they can)."""
    if model_root is None:
        return None
    repo, root = repository.resolve(), model_root.resolve()
    if repo == root or repo in root.parents or root in repo.parents:
        return f"the repository {repository} and the model root {model_root} must not contain each other"
    return None


def install(layout: Layout, repository: Path, source: ModelSource) -> Path:
    """Build the model's folder in the repository (replacing a stale one); its path."""
    if not source.path.exists():
        raise LayoutError(f"model path {str(source.path)!r} does not exist")
    resolved, repo = _resolved(source.path), repository.resolve()
    if resolved == repo or repo in resolved.parents:
        raise LayoutError(f"model path {str(source.path)!r} is inside the model server's repository")
    final = repository / layout.directory_name(source.model_id)
    if (final.exists() or final.is_symlink()) and not _ours(final):
        raise LayoutError(f"{final} exists and was not made by the adapter; not replacing it")
    staging = repository / f".staging-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir(parents=True)
    try:
        (staging / MARKER).write_text("made by meshd adapter; removed with the model\n")
        try:
            layout.build(source, staging)
        except (OSError, RuntimeError) as e:  # a file that cannot be read, listed or linked
            raise LayoutError(f"model {source.model_id!r} at {source.path}: {e}") from None
        if final.exists() or final.is_symlink():
            _remove_path(final)
        staging.rename(final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def uninstall(layout: Layout, repository: Path, model_id: str) -> None:
    """Remove the model's folder (only the links and files the adapter made)."""
    try:
        name = layout.directory_name(model_id)
    except LayoutError:
        return  # never installed
    if _ours(repository / name):
        _remove_path(repository / name)


def clear(repository: Path) -> None:
    """Remove every model folder the adapter made (and unfinished ones): the server then
    starts clean. Anything else in the repository is left alone."""
    repository.mkdir(parents=True, exist_ok=True)
    for entry in repository.iterdir():
        if _ours(entry) or (entry.name.startswith(".staging-") and entry.is_dir()):
            _remove_path(entry)


def _ours(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def _remove_path(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
