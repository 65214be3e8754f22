"""The storage helper's pure rules: which store a model comes from, where its files go, and
which remote paths are safe to write locally.

Upstream's contract (modelmesh-runtime-adapter's puller, kept as it is so a modelmesh-serving
user's `storage-config` secret and predictors work unchanged):
- the model's key (`ModelInfo.key`, JSON) may carry `storage_key`, `storage_params`, the
  deprecated `bucket`, `schema_path` and `disk_size_bytes`;
- `storage_key` names one JSON file of the storage-config directory (an empty name is an
  error); without it the config is `default_<storage_params.type>` when the params name a
  type, else `default`; a missing entry is `{}` (the params alone);
- the deprecated top-level `bucket` replaces the config's bucket only when it has one;
- `storage_params` apply on top as dot-path string overrides (`headers.X-Token` sets a
  nested field), never over a non-string (JSON null included);
- no `type` after that is an error; files land in `ROOT_MODEL_DIR/<modelId>/<basename>`
  (`_model` when the path has no basename);
- the key handed to the runtime loses the storage fields and gains the measured
  `disk_size_bytes`.
meshd adds URI-style model paths (`s3://`, `gs://`, `pvc://`, `hf://`, `http(s)://`), mapped
as modelmesh-serving's controller maps a `storageUri`, and `hf` as a type of its own. A key
with no storage fields pulls from the `default` entry as upstream does; only when there is
no `default` entry is its path a local one (meshd's superset: upstream refuses it).

No I/O: the storage-config files are read by the caller, through `read_config`.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

TYPES = ("s3", "gcs", "azure", "http", "pvc", "hf")
MODEL_NAME_DEFAULT = "_model"  # upstream's local name for a model path without a basename
SCHEMA_NAME_CLASH = "_schema.json"  # upstream's name for a schema whose basename clashes with the model's
STORAGE_FIELDS = ("storage_key", "storage_params", "bucket")  # removed from the key handed to the runtime
AZURE_BLOB_HOST_SUFFIX = ".blob.core.windows.net"
DEFAULT_ENTRY = "default"  # upstream's defaultStorageKey: the entry a key without storage_key uses
# Fields whose values are secrets: never in a log line, an error or a record.
SECRET_FIELDS = frozenset(
    {
        "access_key_id",
        "secret_access_key",
        "session_token",
        "private_key",
        "client_secret",
        "connection_string",
        "account_key",
        "sas_token",
        "client_key",
        "token",
        "headers",
    }
)


class StorageConfigError(ValueError):
    """A model's storage cannot be resolved: a bad key, a missing config, a bad path."""


@dataclass(frozen=True)
class Source:
    """Where one model's files come from: the store's type, its merged config (with its
    secrets: never print it whole, use `store`), and the path inside the store."""

    type: str
    config: Mapping[str, object]
    path: str
    storage_key: str = ""  # the storage-config entry used ("" when none)
    schema_path: str = ""

    @property
    def store(self) -> str:
        """The store named for errors and logs: type, endpoint and bucket, never a credential."""
        c = self.config
        if self.type == "s3":
            where = str(c.get("endpoint_url") or "aws")
            return f"s3 {_strip_userinfo(where)} bucket {c.get('bucket', '?')!s}"
        if self.type == "gcs":
            return f"gcs bucket {c.get('bucket', '?')!s}"
        if self.type == "azure":
            return f"azure account {c.get('account_name', '?')!s} container {c.get('container', '?')!s}"
        if self.type == "http":
            # Never the query: it may hold a signature (a presigned URL).
            return f"http {_strip_userinfo(str(c.get('url', '?'))).partition('?')[0]}"
        if self.type == "pvc":
            return f"pvc {c.get('name', '?')!s}"
        if self.type == "hf":
            rev = str(c.get("revision") or "main")
            return f"hf {c.get('repo', '?')!s}@{rev}"
        return self.type


def _strip_userinfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, tail = rest.partition("/")
    return f"{scheme}://{host.rpartition('@')[2]}{slash}{tail}"


def parse_key(key: str) -> dict[str, object]:
    """The model key as a dict: JSON or empty (upstream's keys are JSON objects)."""
    if not key.strip():
        return {}
    try:
        value = json.loads(key)
    except json.JSONDecodeError as e:
        raise StorageConfigError(f"model key is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise StorageConfigError("model key is not a JSON object")
    return value


def set_dotpath(target: dict[str, object], path: str, value: str) -> None:
    """Set `a.b.c` in `target` to `value`, creating objects on the way; never overwrite a
    value that is not a string (upstream's dotpath rule)."""
    parts = path.split(".")
    if not all(parts):
        raise StorageConfigError(f"storage_params: bad field name {path!r}")
    node = target
    for part in parts[:-1]:
        if part not in node:
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise StorageConfigError(f"storage_params: {path!r} goes through a field that is not an object")
        node = child
    if parts[-1] in node and not isinstance(node[parts[-1]], str):  # a JSON null is not a string either
        raise StorageConfigError(f"storage_params: {path!r} would overwrite a field that is not a string")
    node[parts[-1]] = value


def uri_params(model_path: str) -> tuple[dict[str, str], str] | None:
    """A URI-style model path as (storage params, path in the store), as modelmesh-serving's
    controller maps a storageUri; None when the path is not a URI."""
    scheme, sep, rest = model_path.partition("://")
    if not sep:
        return None
    scheme = scheme.lower()
    authority, _, path = rest.partition("/")
    if not authority:
        raise StorageConfigError(f"model path {model_path!r} names no bucket or host")
    if scheme == "s3":
        return {"type": "s3", "bucket": authority}, path
    if scheme == "gs":
        return {"type": "gcs", "bucket": authority}, path
    if scheme == "pvc":
        return {"type": "pvc", "name": authority}, path
    if scheme == "hf":
        # hf://org/name[@revision][/path in the repo]
        name, _, inner = path.partition("/")
        name, at, revision = name.partition("@")
        if not name:
            raise StorageConfigError(f"model path {model_path!r}: hf:// wants org/name[@revision]")
        params = {"type": "hf", "repo": f"{authority}/{name}"}
        if at:
            params["revision"] = revision
        return params, inner
    if scheme in ("http", "https"):
        host = authority.rpartition("@")[2].lower()
        if host.endswith(AZURE_BLOB_HOST_SUFFIX):
            container, _, blob = path.partition("/")
            account = host[: -len(AZURE_BLOB_HOST_SUFFIX)]
            return {"type": "azure", "account_name": account, "container": container}, blob
        # The query stays on the URL (a signature, `?raw=true`), the path is joined to its path.
        path, _, query = path.partition("#")[0].partition("?")
        return {"type": "http", "url": f"{scheme}://{authority}" + (f"?{query}" if query else "")}, path
    raise StorageConfigError(f"model path {model_path!r}: unsupported scheme {scheme!r}")


def resolve(
    model_path: str,
    key: Mapping[str, object],
    read_config: Callable[[str], Mapping[str, object] | None],
) -> Source | None:
    """The source of a model, or None when it needs no pull (a local path: no storage
    fields and no `default` entry).

    `read_config(name)`: the storage-config entry `name` as a dict, None when there is none.
    """
    from_uri = uri_params(model_path)
    storage_key = key.get("storage_key")
    params = key.get("storage_params")
    no_fields = from_uri is None and storage_key is None and params is None and key.get("bucket") is None
    if no_fields and read_config(DEFAULT_ENTRY) is None:
        return None  # meshd's superset: upstream would refuse it ("Predictor Storage field missing")
    if storage_key is not None and not isinstance(storage_key, str):
        raise StorageConfigError("storage_key must be a string")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise StorageConfigError("storage_params must be an object")
    path = model_path
    if from_uri is not None:
        # The controller's rule: what the URI says overrides storage.parameters.
        params = {**params, **from_uri[0]}
        path = from_uri[1]
    config: dict[str, object]
    if storage_key is not None:
        _check_entry_name(storage_key)
        found = read_config(storage_key)
        if found is None:
            raise StorageConfigError(f"Did not find storage config for key {storage_key!r}")
        config = _copy(found)
    else:
        found = read_config(default_entry(params.get("type")))
        config = _copy(found) if found is not None else {}
    # The deprecated top-level bucket replaces the entry's bucket, only where it has one
    # (upstream warns, then uses it).
    bucket = key.get("bucket")
    if isinstance(bucket, str) and bucket and config.get("bucket") is not None:
        config["bucket"] = bucket
    if config.get("type") == "s3" and "bucket" not in config and "default_bucket" in config:
        config["bucket"] = config["default_bucket"]  # deprecated spelling, kept
    for name, value in params.items():
        if not isinstance(value, str):
            raise StorageConfigError(f"storage_params.{name} must be a string")
        set_dotpath(config, name, value)
    kind = config.get("type")
    if not isinstance(kind, str) or not kind:
        raise StorageConfigError("Predictor Storage field missing")
    if kind not in TYPES:
        raise StorageConfigError(f"storage type {kind!r} is not one of {', '.join(TYPES)}")
    _check_fields(kind, config)
    schema = key.get("schema_path")
    return Source(
        kind,
        config,
        path.lstrip("/") if kind != "http" else path,
        storage_key if storage_key is not None else "",
        schema if isinstance(schema, str) else "",
    )


def default_entry(storage_type: object) -> str:
    """The storage-config entry read for a key without `storage_key`: `default_<type>` when
    the params name a type, else `default` (upstream's puller; never both)."""
    if isinstance(storage_type, str) and storage_type:
        return f"{DEFAULT_ENTRY}_{storage_type}"
    return DEFAULT_ENTRY


def _copy(value: Mapping[str, object]) -> dict[str, object]:
    copied: dict[str, object] = json.loads(json.dumps(value))
    return copied


def _check_entry_name(name: str) -> None:
    # The key names a file of the storage-config directory: never a path out of it.
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise StorageConfigError(f"storage_key {name!r} is not a plain name")


REQUIRED = {
    "s3": ("bucket",),
    "gcs": ("bucket",),
    "azure": ("account_name", "container"),
    "http": ("url",),
    "pvc": ("name",),
    "hf": ("repo",),
}
BOTH_OR_NEITHER = {
    "s3": ("access_key_id", "secret_access_key"),
    "gcs": ("private_key", "client_email"),
    "http": ("client_certificate", "client_key"),
}


def _check_fields(kind: str, config: Mapping[str, object]) -> None:
    missing = [f for f in REQUIRED[kind] if not config.get(f)]
    if missing:
        raise StorageConfigError(f"{kind} storage config lacks {', '.join(missing)}")
    pair = BOTH_OR_NEITHER.get(kind)
    if pair and bool(config.get(pair[0])) != bool(config.get(pair[1])):
        raise StorageConfigError(f"{kind} storage config: give both {pair[0]} and {pair[1]}, or neither")


# ---- paths ---------------------------------------------------------------------------


def safe_relpath(rel: str) -> str:
    """`rel` as a normalised relative path that stays inside its root; refuses an absolute
    path, `..`, an empty name or a NUL."""
    if "\0" in rel or "\\" in rel:
        raise StorageConfigError(f"path {rel!r} has a forbidden character")
    if rel.startswith("/"):
        raise StorageConfigError(f"path {rel!r} is absolute")
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts:
        raise StorageConfigError(f"path {rel!r} names nothing")
    if ".." in parts:
        raise StorageConfigError(f"path {rel!r} escapes its root")
    return "/".join(parts)


# The longest file name Linux file systems take (ext4, XFS, tmpfs: 255 bytes).
NAME_MAX_BYTES = 255
STAGING_SUFFIX = ".partial"


def check_model_id(model_id: str) -> str:
    """A model id as one directory name under the model root."""
    if not model_id or model_id in (".", "..") or "/" in model_id or "\0" in model_id or model_id.startswith("."):
        raise StorageConfigError(f"model id {model_id!r} cannot name a directory")
    if len(model_id.encode()) > NAME_MAX_BYTES:
        raise StorageConfigError(f"model id {model_id[:32]!r}... is too long to name a directory (over 255 bytes)")
    return model_id


def staging_name(model_id: str) -> str:
    """The hidden directory a pull of `model_id` writes into before it is renamed into place:
    `.<modelId>.partial`, or a digest of the id where that name would be too long."""
    name = f".{model_id}{STAGING_SUFFIX}"
    if len(name.encode()) <= NAME_MAX_BYTES:
        return name
    return f".{hashlib.sha256(model_id.encode()).hexdigest()}{STAGING_SUFFIX}"


def local_name(remote_path: str) -> str:
    """The local name of a pulled model: the path's basename, `_model` when it has none."""
    name = posixpath.basename(remote_path.rstrip("/"))
    return name if name and name not in (".", "..") else MODEL_NAME_DEFAULT


def schema_name(schema_path: str, model_name: str) -> str:
    name = local_name(schema_path)
    return SCHEMA_NAME_CLASH if name == model_name else name


def within(root: str, target: str) -> bool:
    """Whether `target` (a resolved absolute path) lies inside `root` (resolved)."""
    root = root.rstrip("/") or "/"
    return target == root or target.startswith(root + "/") or root == "/"


# ---- listings ------------------------------------------------------------------------


@dataclass(frozen=True)
class Listed:
    """One object a store listed: its key, size and ETag (or checksum) when given, and what
    its GETs send so that they fail (HTTP 412) once the object is no longer the one listed
    (`version`: S3's and a web server's ETag, GCS's generation, Azure's ETag; "": none)."""

    key: str
    size: int
    etag: str = ""
    version: str = ""


@dataclass(frozen=True)
class FilePlan:
    """One file to pull: its key in the store, where it goes under the model's directory."""

    key: str
    local: str  # relative to the model's directory, starting with the model's local name
    size: int
    etag: str = ""
    version: str = ""  # Listed.version


@dataclass(frozen=True)
class ModelPlan:
    files: tuple[FilePlan, ...]
    name: str  # the model's local name (file or directory) under its directory
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_bytes", sum(f.size for f in self.files))


def plan_files(prefix: str, listed: Sequence[Listed], name: str | None = None) -> ModelPlan:
    """Which listed objects make the model at `prefix`, and where each goes.

    The exact key is a single-file model; otherwise the objects under `prefix/` form a
    directory (never `prefixmore`: upstream's fix for modelmesh-serving#97). Keys ending in
    `/` are folder markers and skipped, as are empty objects that are a prefix of others
    (folder markers written without the slash). A key whose relative path escapes the
    model's directory is refused.
    """
    prefix = prefix.strip("/")
    name = name or local_name(prefix)
    keys = {o.key for o in listed}
    under = prefix + "/" if prefix else ""
    exact = [o for o in listed if o.key == prefix and prefix]
    if exact and not (exact[0].size == 0 and any(k.startswith(under) for k in keys)):
        o = exact[0]
        return ModelPlan((FilePlan(o.key, name, o.size, o.etag, o.version),), name)
    files = []
    for o in listed:
        if not o.key.startswith(under) or o.key.endswith("/"):
            continue
        if o.size == 0 and any(k.startswith(o.key + "/") for k in keys):
            continue
        rel = safe_relpath(o.key[len(under) :])
        files.append(FilePlan(o.key, f"{name}/{rel}", o.size, o.etag, o.version))
    files.sort(key=lambda f: f.local)
    _check_no_clash(files)
    return ModelPlan(tuple(files), name)


def _check_no_clash(files: Sequence[FilePlan]) -> None:
    names = {f.local for f in files}
    for f in files:
        parent = posixpath.dirname(f.local)
        while parent:
            if parent in names:
                raise StorageConfigError(f"object {f.key!r} would sit under a file of the same model")
            parent = posixpath.dirname(parent)


# ---- the rewritten key ---------------------------------------------------------------


def rewritten_key(key: Mapping[str, object], disk_size_bytes: int, schema_local: str | None) -> str:
    """The key handed to the runtime: storage fields removed, the measured size set, the
    schema's local path when there is one (upstream's rewrite)."""
    out = {k: v for k, v in key.items() if k not in STORAGE_FIELDS}
    out["disk_size_bytes"] = disk_size_bytes
    if schema_local is not None:
        out["schema_path"] = schema_local
    return json.dumps(out, separators=(",", ":"))


def redact(text: str, config: Mapping[str, object]) -> str:
    """`text` with every secret value of `config` replaced by `***` (errors from libraries
    may echo what they were given)."""
    for secret in _secret_values(config):
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def _secret_values(config: Mapping[str, object]) -> list[str]:
    found: list[str] = []
    for name, value in config.items():
        if name in SECRET_FIELDS:
            if isinstance(value, str):
                found.append(value)
            elif isinstance(value, Mapping):
                found.extend(str(v) for v in value.values())
                found.extend(str(x) for v in value.values() if isinstance(v, list) for x in v)
        elif isinstance(value, Mapping):
            found.extend(_secret_values(value))
    return found
