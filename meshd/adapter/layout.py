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

from meshd.core.model_types import MLSERVER_IMPLEMENTATIONS, TRITON_BACKENDS

MLSERVER_SETTINGS = "model-settings.json"
MARKER = ".meshd-adapter"  # in every folder the adapter makes, and only those
TRITON_CONFIG = "config.pbtxt"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class LayoutError(ValueError):
    """The model cannot be laid out for this server (the load fails with this message)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    model_id: str
    model_type: str
    path: Path
    key: dict[str, Any]


def model_type_of(registered_type: str, key: dict[str, Any]) -> str:
    """The key's `model_type.name` (modelmesh-serving writes it), else the registered type."""
    mt = key.get("model_type")
    if isinstance(mt, dict) and isinstance(mt.get("name"), str) and mt["name"]:
        return str(mt["name"]).lower()
    return registered_type.lower()


class Layout(Protocol):
    server: str

    def directory_name(self, model_id: str) -> str: ...

    def build(self, source: ModelSource, target: Path) -> None: ...


def _link_entries(source_dir: Path, target: Path, skip: frozenset[str] = frozenset()) -> None:
    for entry in sorted(source_dir.iterdir()):
        if entry.name not in skip:
            (target / entry.name).symlink_to(entry.resolve())


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
                files = [p for p in path.iterdir() if not p.name.startswith(".")]
                uri = f"./{files[0].name}" if len(files) == 1 and files[0].is_file() else "."
                settings = self._new_settings(source, uri)
        else:
            (target / path.name).symlink_to(path.resolve())
            settings = self._new_settings(source, f"./{path.name}")
        settings["name"] = source.model_id
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
        config = path / TRITON_CONFIG if path.is_dir() else None
        versioned = path.is_dir() and any(p.is_dir() and p.name.isdigit() for p in path.iterdir())
        if versioned:
            _link_entries(path, target, skip=frozenset({TRITON_CONFIG}))
        else:
            version = target / "1"
            version.mkdir()
            backend = TRITON_BACKENDS.get(source.model_type)
            if path.is_dir() and not (backend and backend[1].endswith(".savedmodel")):
                _link_entries(path, version, skip=frozenset({TRITON_CONFIG}))
            else:
                name = backend[1] if backend else path.name
                (version / name).symlink_to(path.resolve())
        if config is not None and config.is_file():
            text = _with_name(config.read_text(), source.model_id)
        else:
            text = self._minimal_config(source)
        (target / TRITON_CONFIG).write_text(text)

    def _minimal_config(self, source: ModelSource) -> str:
        backend = TRITON_BACKENDS.get(source.model_type)
        if backend is None:
            known = ", ".join(sorted(TRITON_BACKENDS))
            raise LayoutError(
                f"no Triton backend for model type {source.model_type!r} (known: {known}); "
                f"put a {TRITON_CONFIG} beside the model"
            )
        # Triton completes inputs and outputs itself for most backends (auto-complete config).
        return f'name: "{source.model_id}"\nbackend: "{backend[0]}"\n'


def _with_name(config: str, model_id: str) -> str:
    """The model's own config.pbtxt with its top-level name set to the id (Triton requires the
    name to match the folder, or be absent)."""
    line = f'name: "{model_id}"'
    pattern = re.compile(r'^name\s*:\s*"[^"]*"\s*$', re.M)
    if pattern.search(config):
        return pattern.sub(line, config, count=1)
    return f"{line}\n{config}"


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
    resolved, repo = source.path.resolve(), repository.resolve()
    if resolved == repo or repo in resolved.parents:
        raise LayoutError(f"model path {str(source.path)!r} is inside the model server's repository")
    final = repository / layout.directory_name(source.model_id)
    if (final.exists() or final.is_symlink()) and not _ours(final):
        raise LayoutError(f"{final} exists and was not made by the adapter; not replacing it")
    staging = repository / f".staging-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir(parents=True)
    try:
        (staging / MARKER).write_text("made by meshd adapter; removed with the model\n")
        layout.build(source, staging)
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
