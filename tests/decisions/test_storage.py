"""The storage helper's pure rules: upstream's storage-config contract, URI paths, path
safety, listings, parts, retries and the disk tier's order."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from meshd.decisions.storage import (
    Listed,
    StorageConfigError,
    check_model_id,
    local_name,
    parse_key,
    plan_files,
    redact,
    resolve,
    rewritten_key,
    safe_relpath,
    schema_name,
    set_dotpath,
    staging_name,
    uri_params,
    within,
)
from meshd.decisions.storage_plan import (
    ALLOCATE_HEADROOM_BYTES,
    MIN_SAMPLES,
    OBJECTS_CAP,
    OBJECTS_START,
    DiskTier,
    Failure,
    ObjectWorkers,
    Part,
    allocate_first,
    backoff_ms,
    classify_status,
    plan_parts,
    retryable,
    stalled,
    token_fresh,
)

MINIO = {
    "type": "s3",
    "access_key_id": "AKIAEXAMPLE",
    "secret_access_key": "s3cr3t-value",
    "endpoint_url": "http://minio:9000",
    "region": "us-south",
    "default_bucket": "modelmesh-example-models",
}


def reader(configs: Mapping[str, Mapping[str, object]]):  # type: ignore[no-untyped-def]
    return lambda name: configs.get(name)


def test_a_local_path_without_storage_fields_needs_no_pull() -> None:
    assert resolve("/models/m.onnx", {}, reader({})) is None
    assert resolve("m.onnx", {"model_type": "sklearn"}, reader({})) is None
    # `default_<type>` entries do not make a key without fields a remote one: only `default`
    assert resolve("m.onnx", {"model_type": "sklearn"}, reader({"default_s3": MINIO})) is None


def test_a_key_without_storage_fields_pulls_from_the_default_entry() -> None:
    # What modelmesh-serving writes for an InferenceService with only storage.path.
    configs = {"default": {"type": "http", "url": "http://models.example"}}
    src = resolve("sklearn/mnist-svm.joblib", {"model_type": {"name": "sklearn"}}, reader(configs))
    assert src is not None and src.type == "http" and src.path == "sklearn/mnist-svm.joblib"
    assert src.config["url"] == "http://models.example" and src.storage_key == ""


def test_storage_key_names_the_secret_entry_and_params_override() -> None:
    key = {"storage_key": "localMinIO", "storage_params": {"bucket": "other"}}
    src = resolve("sklearn/mnist-svm.joblib", key, reader({"localMinIO": MINIO}))
    assert src is not None
    assert src.type == "s3" and src.config["bucket"] == "other" and src.path == "sklearn/mnist-svm.joblib"
    assert src.storage_key == "localMinIO"
    assert "s3cr3t" not in src.store and "AKIA" not in src.store


def test_default_bucket_is_the_deprecated_spelling_of_bucket() -> None:
    src = resolve("m", {"storage_key": "k"}, reader({"k": MINIO}))
    assert src is not None and src.config["bucket"] == "modelmesh-example-models"


def test_deprecated_top_level_bucket_replaces_only_a_bucket_the_entry_has() -> None:
    src = resolve("m", {"storage_key": "k", "bucket": "legacy"}, reader({"k": {**MINIO, "bucket": "b"}}))
    assert src is not None and src.config["bucket"] == "legacy"
    # upstream: no bucket in the entry (here only the deprecated default_bucket), no override
    src = resolve("m", {"storage_key": "k", "bucket": "legacy"}, reader({"k": MINIO}))
    assert src is not None and src.config["bucket"] == "modelmesh-example-models"
    with pytest.raises(StorageConfigError, match="lacks bucket"):
        resolve("m", {"storage_key": "k", "bucket": "legacy"}, reader({"k": {"type": "s3"}}))


def test_unknown_storage_key_is_an_error_naming_it() -> None:
    with pytest.raises(StorageConfigError, match="Did not find storage config for key 'nope'"):
        resolve("m", {"storage_key": "nope"}, reader({}))


def test_storage_key_cannot_leave_the_config_directory() -> None:
    for bad in ("../etc/passwd", "a/b", "..", ""):  # "" too: upstream refuses it, never `default`
        with pytest.raises(StorageConfigError, match="not a plain name"):
            resolve("m", {"storage_key": bad}, reader({}))


def test_without_a_key_default_of_the_type_only_else_default() -> None:
    configs = {"default": {"type": "http", "url": "http://a"}, "default_s3": {**MINIO, "bucket": "b3"}}
    src = resolve("m", {"storage_params": {"type": "s3"}}, reader(configs))
    assert src is not None and src.config["bucket"] == "b3"
    src = resolve("m", {"storage_params": {"type": "gcs", "bucket": "g"}}, reader(configs))
    # no default_gcs: the params alone (upstream), never the `default` entry of another type
    assert src is not None and src.type == "gcs" and dict(src.config) == {"type": "gcs", "bucket": "g"}
    src = resolve("m", {"storage_params": {"type": "pvc", "name": "vol"}}, reader({}))
    assert src is not None and src.type == "pvc"
    src = resolve("m", {"storage_params": {"bucket": "b"}}, reader({"default": {**MINIO, "bucket": "d"}}))
    assert src is not None and src.type == "s3" and src.config["bucket"] == "b"


def test_a_default_entry_of_one_store_never_reaches_another() -> None:
    minio = {**MINIO, "bucket": "models", "certificate": "-----BEGIN CERTIFICATE-----"}
    for path in ("gs://public-bucket/m", "hf://org/name", "https://acct.blob.core.windows.net/cont/m"):
        src = resolve(path, {}, reader({"default": minio}))
        assert src is not None and src.type != "s3"
        leaked = {"endpoint_url", "certificate", "access_key_id", "secret_access_key", "region"} & set(src.config)
        assert not leaked, (path, leaked)


def test_no_type_after_merging_is_upstreams_error() -> None:
    with pytest.raises(StorageConfigError, match="Predictor Storage field missing"):
        resolve("m", {"storage_params": {"bucket": "b"}}, reader({}))


def test_unknown_type_and_missing_fields_are_named() -> None:
    with pytest.raises(StorageConfigError, match="not one of"):
        resolve("m", {"storage_params": {"type": "ftp"}}, reader({}))
    with pytest.raises(StorageConfigError, match="lacks bucket"):
        resolve("m", {"storage_params": {"type": "s3"}}, reader({}))
    with pytest.raises(StorageConfigError, match="both access_key_id and secret_access_key"):
        resolve("m", {"storage_params": {"type": "s3", "bucket": "b", "access_key_id": "x"}}, reader({}))


def test_dotpath_creates_objects_and_never_overwrites_a_non_string() -> None:
    d: dict[str, object] = {"headers": {"A": "1"}, "n": 3}
    set_dotpath(d, "headers.B", "2")
    set_dotpath(d, "x.y.z", "3")
    assert d["headers"] == {"A": "1", "B": "2"} and d["x"] == {"y": {"z": "3"}}
    with pytest.raises(StorageConfigError):
        set_dotpath(d, "n", "4")
    with pytest.raises(StorageConfigError):
        set_dotpath(d, "n.m", "4")
    with pytest.raises(StorageConfigError):
        set_dotpath(d, "a..b", "4")


def test_dotpath_never_overwrites_a_json_null() -> None:
    d: dict[str, object] = {"region": None, "headers": None}
    with pytest.raises(StorageConfigError, match="not a string"):
        set_dotpath(d, "region", "us")
    with pytest.raises(StorageConfigError, match="not an object"):
        set_dotpath(d, "headers.X", "1")
    assert d == {"region": None, "headers": None}


def test_uri_paths_map_as_the_controller_maps_storage_uris() -> None:
    assert uri_params("s3://bkt/a/b.onnx") == ({"type": "s3", "bucket": "bkt"}, "a/b.onnx")
    assert uri_params("gs://bkt/m") == ({"type": "gcs", "bucket": "bkt"}, "m")
    assert uri_params("pvc://vol/dir/m") == ({"type": "pvc", "name": "vol"}, "dir/m")
    assert uri_params("https://acct.blob.core.windows.net/cont/dir/m") == (
        {"type": "azure", "account_name": "acct", "container": "cont"},
        "dir/m",
    )
    assert uri_params("https://host:8443/x/m.bin") == ({"type": "http", "url": "https://host:8443"}, "x/m.bin")
    # the query stays on the URL, as the controller maps it (upstream's e2e `?raw=true`)
    assert uri_params("https://github.com/o/r/blob/main/m.joblib?raw=true") == (
        {"type": "http", "url": "https://github.com?raw=true"},
        "o/r/blob/main/m.joblib",
    )
    assert uri_params("hf://org/name@v1.0/sub") == ({"type": "hf", "repo": "org/name", "revision": "v1.0"}, "sub")
    assert uri_params("hf://org/name") == ({"type": "hf", "repo": "org/name"}, "")
    assert uri_params("/local/m") is None
    with pytest.raises(StorageConfigError, match="unsupported scheme"):
        uri_params("model-registry://x/y")
    with pytest.raises(StorageConfigError):
        uri_params("s3:///nobucket")


def test_uri_params_override_storage_params_and_use_the_default_entry() -> None:
    src = resolve("s3://real/m", {"storage_params": {"bucket": "ignored"}}, reader({"default_s3": MINIO}))
    assert src is not None and src.config["bucket"] == "real" and src.config["endpoint_url"] == "http://minio:9000"


def test_safe_relpath_refuses_escapes() -> None:
    assert safe_relpath("a/./b//c") == "a/b/c"
    for bad in ("../x", "a/../../x", "/etc/passwd", "", ".", "a\0b", "a\\..\\b"):
        with pytest.raises(StorageConfigError):
            safe_relpath(bad)


def test_model_ids_that_cannot_be_directories() -> None:
    assert check_model_id("m-1__isvc-abc") == "m-1__isvc-abc"
    assert check_model_id("é" * 127) == "é" * 127  # 254 bytes
    for bad in ("", ".", "..", "a/b", ".hidden", "é" * 128, "m" * 256):
        with pytest.raises(StorageConfigError, match="directory"):
            check_model_id(bad)


def test_staging_names_are_hidden_and_fit_a_file_name() -> None:
    assert staging_name("m-1") == ".m-1.partial"
    long_ids = ["m" * 246, "m" * 247, "m" * 255, "é" * 127]
    names = [staging_name(m) for m in long_ids]
    assert names[0] == "." + "m" * 246 + ".partial"  # 255 bytes: still the id
    for name in names:
        assert name.startswith(".") and name.endswith(".partial") and len(name.encode()) <= 255
    assert len(set(names)) == len(names)


def test_within() -> None:
    assert within("/pvc/v", "/pvc/v/m") and within("/pvc/v", "/pvc/v")
    assert not within("/pvc/v", "/pvc/v2/m") and not within("/pvc/v", "/etc")


def test_local_names_follow_upstream() -> None:
    assert local_name("sklearn/mnist-svm.joblib") == "mnist-svm.joblib"
    assert local_name("dir/") == "dir" and local_name("") == "_model" and local_name("/") == "_model"
    assert schema_name("s/schema.json", "schema.json") == "_schema.json"
    assert schema_name("s/schema.json", "model") == "schema.json"


def test_plan_files_single_object_and_folder() -> None:
    listed = [Listed("m/model.bin", 10), Listed("m/model.bin2", 5)]
    plan = plan_files("m/model.bin", listed)
    assert [(f.key, f.local) for f in plan.files] == [("m/model.bin", "model.bin")] and plan.total_bytes == 10
    listed = [Listed("m", 0), Listed("m/", 0), Listed("m/a", 1), Listed("m/sub/b", 2), Listed("mx/c", 3)]
    plan = plan_files("/m", listed)  # a leading slash is not a mismatch (modelmesh-serving#97)
    assert [(f.key, f.local) for f in plan.files] == [("m/a", "m/a"), ("m/sub/b", "m/sub/b")]
    assert plan.total_bytes == 3 and plan.name == "m"


def test_plan_files_refuses_a_key_that_escapes() -> None:
    with pytest.raises(StorageConfigError, match="escapes"):
        plan_files("m", [Listed("m/../../etc/cron.d/x", 1)])


def test_plan_files_refuses_a_file_and_folder_of_one_name() -> None:
    with pytest.raises(StorageConfigError, match="under a file"):
        plan_files("m", [Listed("m/a", 1), Listed("m/a/b", 1)])


def test_rewritten_key_drops_storage_fields_and_sets_the_size() -> None:
    key = parse_key(json.dumps({"storage_key": "k", "storage_params": {"a": "b"}, "bucket": "x", "model_type": "t"}))
    out = json.loads(rewritten_key(key, 1234, "/models/m/_schema.json"))
    assert out == {"model_type": "t", "disk_size_bytes": 1234, "schema_path": "/models/m/_schema.json"}
    with pytest.raises(StorageConfigError):
        parse_key("[1]")
    with pytest.raises(StorageConfigError):
        parse_key("{bad")
    assert parse_key("") == {}


def test_redact_hides_every_secret_value() -> None:
    config = {**MINIO, "headers": {"Authorization": "Bearer tok-123456"}}
    text = "failed with s3cr3t-value and AKIAEXAMPLE and Bearer tok-123456 at http://minio:9000"
    out = redact(text, config)
    assert "s3cr3t" not in out and "AKIAEXAMPLE" not in out and "tok-123456" not in out
    assert "http://minio:9000" in out


def test_plan_parts_cover_the_object_exactly() -> None:
    assert plan_parts(0) == ()
    assert plan_parts(10) == (Part(0, 9),)
    parts = plan_parts(100, part_bytes=30, threshold=50)
    assert parts == (Part(0, 29), Part(30, 59), Part(60, 89), Part(90, 99))
    assert sum(p.size for p in parts) == 100 and parts[0].header() == "bytes=0-29"


def test_failures_and_retries() -> None:
    assert classify_status(403) == Failure.AUTH and not retryable(Failure.AUTH)
    assert classify_status(404) == Failure.NOT_FOUND and not retryable(Failure.NOT_FOUND)
    assert classify_status(503) == Failure.TRANSIENT and retryable(Failure.TRANSIENT)
    assert classify_status(400) == Failure.BAD
    waits = [backoff_ms(a, 0.0) for a in range(1, 10)]
    assert waits == sorted(waits) and waits[-1] == 5_000 and backoff_ms(1, 0.999) < 200


def test_files_are_allocated_first_unless_the_volume_has_room_to_spare() -> None:
    gib = 1 << 30
    room = ALLOCATE_HEADROOM_BYTES
    # Ample: this pull twice over plus the headroom: workers create their own files.
    assert not allocate_first(free_bytes=2 * gib + room, need_bytes=gib)
    assert allocate_first(free_bytes=2 * gib + room - 1, need_bytes=gib)
    # Just enough for the pull (the free-space check passes): allocate everything first.
    assert allocate_first(free_bytes=gib, need_bytes=gib)
    # Other pulls in progress may still write what they were admitted for.
    assert allocate_first(free_bytes=4 * gib + room, need_bytes=gib, pulling_bytes=3 * gib)
    assert not allocate_first(free_bytes=5 * gib + room, need_bytes=gib, pulling_bytes=3 * gib)
    # An empty pull is decided by the headroom alone.
    assert not allocate_first(free_bytes=room, need_bytes=0)
    assert allocate_first(free_bytes=room - 1, need_bytes=0, headroom_bytes=room)


def _pull(objects: int, wall_s: float, cpu_s: float) -> list[int]:
    """Every object takes `wall_s` of which `cpu_s` CPU, whatever the workers: the counts after
    each object."""
    pace = ObjectWorkers(objects)
    counts, started = [], pace.workers
    for _ in range(objects):
        started += pace.done(wall_s, cpu_s, max(0, objects - started))
        counts.append(pace.workers)
    return counts


def test_object_workers_stay_few_where_python_is_the_limit() -> None:
    # Loopback, measured: 4 workers, ~4 ms an object of which ~1.45 ms CPU (1.45 cores busy).
    counts = _pull(1000, 0.004, 0.00145)
    assert OBJECTS_START == 4 and set(counts) == {4}


def test_object_workers_grow_where_the_store_keeps_them_waiting() -> None:
    # 20 ms to the first byte: ~25 ms an object, 2 ms of it CPU; 4 workers keep 0.32 cores
    # busy. Little's law: ~19 keep 1.5 busy; grown with headroom after the first samples.
    counts = _pull(1000, 0.025, 0.002)
    assert counts[MIN_SAMPLES - 2] == 4 and counts[MIN_SAMPLES - 1] == 29
    assert counts[-1] == 29  # 29 of them keep 2.3 cores busy: no more growth
    # A store that waits longer still grows further, in steps, up to the cap.
    counts = _pull(1000, 0.2, 0.001)
    assert counts[MIN_SAMPLES - 1] == OBJECTS_CAP == counts[-1]
    # A little wait: twice as many at least.
    counts = _pull(1000, 0.0035, 0.0005)
    assert counts[MIN_SAMPLES - 1] == 16


def test_object_workers_never_exceed_the_objects_left_and_start_no_more_than_objects() -> None:
    assert ObjectWorkers(2).workers == 2 and ObjectWorkers(0).workers == 1
    pace = ObjectWorkers(100)
    added = [pace.done(0.1, 0.0, 3) for _ in range(MIN_SAMPLES)]
    assert sum(added) == 3 and pace.workers == 7  # no CPU measured at all: as many as there are left
    assert pace.done(-1.0, -1.0, 50) == 0  # a clock that went back counts as nothing
    with pytest.raises(ValueError):
        ObjectWorkers(10, start=0)
    with pytest.raises(ValueError):
        ObjectWorkers(10, start=8, cap=4)


def test_a_token_is_fresh_until_the_margin_before_it_lapses() -> None:
    # An hour's token, 300 s margin: used until 3,300 s after it was fetched.
    assert token_fresh(fetched_s=1000, expires_s=4600, now_s=1000, margin_s=300)
    assert token_fresh(fetched_s=1000, expires_s=4600, now_s=4299, margin_s=300)
    assert not token_fresh(fetched_s=1000, expires_s=4600, now_s=4300, margin_s=300)
    # A 60 s token: half its life, not never.
    assert token_fresh(fetched_s=0, expires_s=60, now_s=29, margin_s=300)
    assert not token_fresh(fetched_s=0, expires_s=60, now_s=30, margin_s=300)
    # A clock that went back before the fetch: fetch anew.
    assert not token_fresh(fetched_s=1000, expires_s=4600, now_s=999, margin_s=300)


def test_stall_counts_only_time_without_progress() -> None:
    assert not stalled(last_progress_ms=1_000, now_ms=50_000, stall_ms=60_000)
    assert stalled(last_progress_ms=1_000, now_ms=62_000, stall_ms=60_000)


def test_disk_tier_refuses_a_model_larger_than_the_budget() -> None:
    tier = DiskTier(100 * 8192)
    got = tier.admit("huge", 101 * 8192, now_ms=1)
    assert not got.admitted and "disk budget" in got.reason and "huge" not in tier


def test_disk_tier_evicts_by_value_and_never_held_or_pulling_models() -> None:
    tier = DiskTier(10 * 8192)
    for i, mid in enumerate(("a", "b", "c")):
        assert tier.admit(mid, 3 * 8192, now_ms=i).admitted
        tier.done(mid, 3 * 8192, pull_ms=1000, now_ms=i)
    for t in range(5):
        tier.touch("a", 10 + t)  # a is used often
    got = tier.admit("d", 3 * 8192, now_ms=20, held={"b"})
    assert got.admitted and got.evict == ("c",)
    # only held and pulling models left to evict: refused, nothing changes
    assert tier.admit("e", 1 * 8192, now_ms=30).admitted  # takes the last free unit
    got = tier.admit("f", 6 * 8192, now_ms=31, held={"a", "b"})
    assert not got.admitted and "in use" in got.reason
    assert {e.model_id for e in tier.entries()} == {"a", "b", "d", "e"}


def test_disk_tier_restore_keeps_what_fits() -> None:
    tier = DiskTier(10 * 8192)
    assert tier.restore("a", 6 * 8192, pull_ms=5, last_used_ms=2)
    assert not tier.restore("b", 6 * 8192, pull_ms=5, last_used_ms=1)
    assert tier.complete("a") and "b" not in tier and tier.used_bytes == 6 * 8192
