"""The storage helper against real servers started here: moto's S3 server, our own object
server (plain HTTP(S), S3-GET and Hugging Face shapes, with faults on demand), a PVC directory."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.storage import StorageError, StorageHelper, StorageSettings
from meshd.storage.helper import DONE_MARKER
from meshd.testing.certs import TestCA
from meshd.testing.objserver import ObjectServer
from meshd.testing.procs import wait_until_async

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
ACCESS = "AKIDMESHDTEST0001"
KIB = 1024
MIB = 1 << 20


def settings(tmp: Path, **kw: object) -> StorageSettings:
    base: dict[str, object] = {
        "root_dir": tmp / "models",
        "config_dir": tmp / "storage-config",
        "pvc_dir": tmp / "pvc_mounts",
        "budget_bytes": 64 * MIB,
        "stall_ms": 10_000,
        "part_bytes": 256 * KIB,
        "part_threshold": 512 * KIB,
        "parts_in_flight": 8,
    }
    base.update(kw)
    return StorageSettings(**base)  # type: ignore[arg-type]


def write_config(tmp: Path, name: str, config: dict[str, object]) -> None:
    d = tmp / "storage-config"
    d.mkdir(exist_ok=True)
    (d / name).write_text(json.dumps(config))


def blob(size: int, seed: int = 1) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(size))


def content(path: str | Path) -> bytes:
    return Path(path).read_bytes()


def link_target(path: str) -> Path | None:
    return Path(path).resolve() if Path(path).is_symlink() else None


async def started(s: StorageSettings) -> StorageHelper:
    helper = StorageHelper(s)
    await helper.start()
    return helper


# ---- moto: S3 protocol, listing, signatures ---------------------------------------------


@pytest.fixture
def s3(moto_url: str, tmp_path: Path) -> Iterator[object]:
    import boto3  # a dev dependency: missing, the test fails rather than skips

    client = boto3.client(
        "s3",
        endpoint_url=moto_url,
        aws_access_key_id=ACCESS,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    bucket = f"b-{tmp_path.name[-20:].lower().replace('_', '-')}".rstrip("-")
    client.create_bucket(Bucket=bucket)
    write_config(
        tmp_path,
        "localMinIO",
        {
            "type": "s3",
            "access_key_id": ACCESS,
            "secret_access_key": SECRET,
            "endpoint_url": moto_url,
            "region": "us-east-1",
            "default_bucket": bucket,
        },
    )
    client.bucket = bucket  # type: ignore[attr-defined]
    yield client


async def test_s3_folder_model_lands_in_upstreams_layout_with_a_rewritten_key(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    files = {"m/config.json": b"{}", "m/weights/part1.bin": blob(700 * KIB), "m/weights/part2.bin": blob(3 * KIB, 2)}
    for k, v in files.items():
        s3.put_object(Bucket=s3.bucket, Key=k, Body=v)
    s3.put_object(Bucket=s3.bucket, Key="mx/other", Body=b"not mine")
    helper = await started(settings(tmp_path))
    key = json.dumps({"storage_key": "localMinIO", "model_type": "sklearn"})
    assert await helper.predict_size("m1", "m", key) == sum(len(v) for v in files.values())
    pulled = await helper.pull("m1", "m", key)
    assert pulled is not None and not pulled.from_disk
    assert pulled.local_path == str(tmp_path / "models" / "m1" / "m")
    for k, v in files.items():
        assert (tmp_path / "models" / "m1" / k).read_bytes() == v
    assert not (tmp_path / "models" / "m1" / "mx").exists()
    assert json.loads(pulled.key) == {"model_type": "sklearn", "disk_size_bytes": pulled.disk_size_bytes}
    assert not list((tmp_path / "models").rglob("*.partial"))
    assert (tmp_path / "models" / "m1" / DONE_MARKER).exists()


async def test_model_ids_up_to_the_longest_file_name(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A 250-byte id's staging directory would be a 259-byte name: it takes a digest instead.
    s3.put_object(Bucket=s3.bucket, Key="one/w.bin", Body=b"abc")
    helper = await started(settings(tmp_path))
    key = json.dumps({"storage_key": "localMinIO"})
    long_id = "m" * 250
    pulled = await helper.pull(long_id, "one", key)
    assert pulled is not None and (tmp_path / "models" / long_id / "one" / "w.bin").read_bytes() == b"abc"
    assert not list((tmp_path / "models").glob(".*"))  # no staging directory left
    with pytest.raises(StorageError, match="too long to name a directory") as e:
        await helper.pull("m" * 256, "one", key)
    assert not e.value.retryable and [p.name for p in (tmp_path / "models").iterdir()] == [long_id]


async def test_s3_uri_path_single_object_in_parallel_parts(s3, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = blob(2 * MIB + 5)
    s3.put_object(Bucket=s3.bucket, Key="dir/model.onnx", Body=data)
    s3.put_object(Bucket=s3.bucket, Key="dir/model.onnx.bak", Body=b"x")
    write_config(tmp_path, "default_s3", json.loads((tmp_path / "storage-config" / "localMinIO").read_text()))
    helper = await started(settings(tmp_path))
    pulled = await helper.pull("m2", f"s3://{s3.bucket}/dir/model.onnx", "")
    assert pulled is not None and content(pulled.local_path) == data
    assert pulled.local_path.endswith("/m2/model.onnx") and pulled.disk_size_bytes == len(data)


async def test_reload_comes_from_the_disk_tier_also_after_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt" / "m").mkdir(parents=True)
    (root / "bkt" / "m" / "w.bin").write_bytes(blob(600 * KIB))
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        key = json.dumps({"storage_key": "k"})
        helper = await started(settings(tmp_path))
        first = await helper.pull("m", "m", key)
        gets = len(srv.gets())
        assert first is not None and not first.from_disk and gets >= 2  # two parts
        helper.release("m")
        again = await helper.pull("m", "m", key)
        assert again is not None and again.from_disk and len(srv.gets()) == gets
        assert again.local_path == first.local_path and again.pull_ms == first.pull_ms
        inv = helper.inventory()
        assert [(m.model_id, m.size_bytes) for m in inv.models] == [("m", 600 * KIB)] and inv.used_bytes == 600 * KIB
        restarted = await started(settings(tmp_path))
        assert [m.model_id for m in restarted.inventory().models] == ["m"]
        third = await restarted.pull("m", "m", key)
        assert third is not None and third.from_disk and len(srv.gets()) == gets


async def test_the_same_model_asked_twice_at_once_is_pulled_once(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "w.bin").write_bytes(blob(300 * KIB))
    with ObjectServer(root) as srv:
        srv.faults.rate = 2 * MIB  # slow enough for the two asks to overlap
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path))
        key = json.dumps({"storage_key": "k"})
        a, b = await asyncio.gather(helper.pull("m", "w.bin", key), helper.pull("m", "w.bin", key))
        assert a == b and len(srv.gets()) == 1


async def test_eviction_by_budget_spares_models_the_runtime_holds(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    for name in ("a", "b", "c"):
        (root / "bkt" / name).write_bytes(blob(400 * KIB))
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path, budget_bytes=900 * KIB))
        key = json.dumps({"storage_key": "k"})
        await helper.pull("a", "a", key)
        await helper.pull("b", "b", key)
        helper.release("b")  # a is still held by the runtime
        await helper.pull("c", "c", key)
        assert sorted(m.model_id for m in helper.inventory().models) == ["a", "c"]
        assert not (tmp_path / "models" / "b").exists() and (tmp_path / "models" / "a" / "a").exists()
        with pytest.raises(StorageError, match="held by models in use") as e:
            await helper.pull("b", "b", key)  # a and c both held
        assert e.value.kind == "disk"


# ---- HTTP(S), TLS, mTLS --------------------------------------------------------------


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "ca")


def server_tls(ca: TestCA, client_ca: bool = False) -> ssl.SSLContext:
    issued = ca.issue("objserver")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(issued.cert, issued.key)
    if client_ca:
        ctx.load_verify_locations(ca.cert)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@pytest.mark.parametrize("as_path", [False, True], ids=["ca-content", "ca-path"])
async def test_https_with_headers_and_a_ca_as_content_or_path(tmp_path: Path, ca: TestCA, as_path: bool) -> None:
    root = tmp_path / "srv"
    (root / "files").mkdir(parents=True)
    data = blob(900 * KIB)
    (root / "files" / "model.bin").write_bytes(data)
    with ObjectServer(root, tls=server_tls(ca)) as srv:
        cert = str(ca.cert) if as_path else ca.cert.read_text()
        write_config(
            tmp_path,
            "web",
            {"type": "http", "url": srv.url, "certificate": cert, "headers": {"X-Token": "hdr-secret-1"}},
        )
        helper = await started(settings(tmp_path))
        pulled = await helper.pull("h", "files/model.bin", json.dumps({"storage_key": "web"}))
        assert pulled is not None and content(pulled.local_path) == data
        assert all(h.get("X-Token") == "hdr-secret-1" for h in srv.headers_seen)
        assert len(srv.gets()) == 4  # above the 512 KiB threshold: four ranged GETs of 256 KiB


async def test_https_mtls_client_certificate(tmp_path: Path, ca: TestCA) -> None:
    root = tmp_path / "srv"
    root.mkdir()
    (root / "m.bin").write_bytes(b"weights")
    client = ca.issue("client")
    with ObjectServer(root, tls=server_tls(ca, client_ca=True)) as srv:
        base = {"type": "http", "url": srv.url, "certificate": ca.cert.read_text()}
        write_config(tmp_path, "nocert", base)
        write_config(
            tmp_path,
            "mtls",
            {**base, "client_certificate": client.cert.read_text(), "client_key": client.key.read_text()},
        )
        helper = await started(settings(tmp_path))
        pulled = await helper.pull("m", "m.bin", json.dumps({"storage_key": "mtls"}))
        assert pulled is not None and content(pulled.local_path) == b"weights"
        with pytest.raises(StorageError) as e:
            await helper.pull("m2", "m.bin", json.dumps({"storage_key": "nocert"}))
        assert e.value.kind in ("tls", "transient")
        assert not (tmp_path / "models" / "m2").exists()


async def test_untrusted_certificate_fails_clearly_and_leaves_nothing(tmp_path: Path, ca: TestCA) -> None:
    root = tmp_path / "srv"
    root.mkdir()
    (root / "m.bin").write_bytes(b"weights")
    with ObjectServer(root, tls=server_tls(ca)) as srv:
        write_config(tmp_path, "web", {"type": "http", "url": srv.url})  # system CAs only
        helper = await started(settings(tmp_path))
        with pytest.raises(StorageError, match="untrusted certificate") as e:
            await helper.pull("m", "m.bin", json.dumps({"storage_key": "web"}))
        assert e.value.kind == "tls" and "'m'" in str(e.value) and "m.bin" in str(e.value)
        assert not (tmp_path / "models" / "m").exists()


# ---- Hugging Face Hub shape ----------------------------------------------------------


async def test_hf_repo_listed_by_the_tree_api_and_fetched_by_resolve(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "srv"
    repo = root / "org" / "tiny"
    (repo / "sub").mkdir(parents=True)
    (repo / "config.json").write_text("{}")
    (repo / "sub" / "model.safetensors").write_bytes(blob(700 * KIB))
    with ObjectServer(root) as hub, ObjectServer(root) as cdn:
        hub.redirect_base = cdn.url  # large files redirect to another host, as the Hub's do
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_tokensecret123")
        helper = await started(settings(tmp_path))
        pulled = await helper.pull("hf1", "hf://org/tiny@main", "")
        assert pulled is not None
        local = Path(pulled.local_path)
        assert local.name == "_model"
        assert (local / "sub" / "model.safetensors").read_bytes() == blob(700 * KIB)
        assert (local / "config.json").read_text() == "{}"
        assert all(h.get("Authorization") == "Bearer hf_tokensecret123" for h in hub.headers_seen)
        assert len(cdn.gets()) == 4 and all("Authorization" not in h for h in cdn.headers_seen)


# ---- PVC -----------------------------------------------------------------------------


async def test_pvc_model_is_a_link_and_cannot_escape_its_volume(tmp_path: Path) -> None:
    vol = tmp_path / "pvc_mounts" / "vol"
    (vol / "models" / "m").mkdir(parents=True)
    (vol / "models" / "m" / "w.bin").write_bytes(b"12345")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("x")
    (vol / "models" / "out").symlink_to(tmp_path / "outside")
    helper = await started(settings(tmp_path))
    pulled = await helper.pull("p", "pvc://vol/models/m", "")
    assert pulled is not None and link_target(pulled.local_path) == (vol / "models" / "m").resolve()
    assert pulled.disk_size_bytes == 5
    for bad in ("pvc://vol/models/out/secret", "pvc://vol/../outside/secret"):
        with pytest.raises(StorageError, match=r"leaves the volume|escapes"):
            await helper.pull("p2", bad, "")
    with pytest.raises(StorageError, match="no such file"):
        await helper.pull("p3", "pvc://vol/models/none", "")


# ---- faults --------------------------------------------------------------------------


async def test_unknown_storage_key(tmp_path: Path) -> None:
    helper = await started(settings(tmp_path))
    with pytest.raises(StorageError, match="Did not find storage config for key 'nope'") as e:
        await helper.pull("m", "x", json.dumps({"storage_key": "nope"}))
    assert e.value.kind == "config"


async def test_missing_bucket_and_object_name_the_model_store_and_object(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        write_config(tmp_path, "nob", {"type": "s3", "endpoint_url": srv.url, "bucket": "nob", "anonymous": "true"})
        helper = await started(settings(tmp_path))
        with pytest.raises(StorageError, match="no such object") as e:
            await helper.pull("m", "absent/model", json.dumps({"storage_key": "k"}))
        assert "'m'" in str(e.value) and "bucket bkt" in str(e.value) and "absent/model" in str(e.value)
        with pytest.raises(StorageError, match="NoSuchBucket") as e:
            await helper.pull("m", "model", json.dumps({"storage_key": "nob"}))
        assert e.value.kind == "not_found"
        assert not (tmp_path / "models" / "m").exists()


async def test_wrong_credentials_fail_at_once_without_naming_them(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "m").write_bytes(b"x" * 10)
    caplog.set_level(logging.DEBUG)
    with ObjectServer(root, access_key="AKIDRIGHT") as srv:
        write_config(
            tmp_path,
            "k",
            {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt"}
            | {"access_key_id": ACCESS, "secret_access_key": SECRET},
        )
        helper = await started(settings(tmp_path))
        with pytest.raises(StorageError, match="InvalidAccessKeyId") as e:
            await helper.pull("m", "m", json.dumps({"storage_key": "k"}))
        assert e.value.kind == "auth" and len(srv.requests) == 1  # no retry storm
        for text in (str(e.value), caplog.text):
            assert SECRET not in text and ACCESS not in text


async def test_a_model_larger_than_the_budget_is_refused_before_a_byte_moves(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "big").write_bytes(blob(800 * KIB))
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path, budget_bytes=512 * KIB))
        key = json.dumps({"storage_key": "k"})
        assert await helper.predict_size("m", "big", key) == 800 * KIB
        with pytest.raises(StorageError, match="more than the disk budget") as e:
            await helper.pull("m", "big", key)
        assert e.value.kind == "disk" and srv.gets() == []
        assert not (tmp_path / "models" / "m").exists()


async def test_dropped_connections_mid_object_are_retried_per_part(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    data = blob(1200 * KIB)
    (root / "bkt" / "w").write_bytes(data)
    with ObjectServer(root) as srv:
        srv.faults.drop_after, srv.faults.drops = 100 * KIB, 3
        srv.faults.fail_status, srv.faults.fails = 0, 0
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path))
        pulled = await helper.pull("m", "w", json.dumps({"storage_key": "k"}))
        assert pulled is not None and content(pulled.local_path) == data
        resumed = [g for g in srv.gets() if g[2] and not g[2].endswith(("-262143", "-524287", "-786431", "-1048575"))]
        assert resumed, "a retry resumes after the bytes already written"


async def test_many_files_from_a_store_slow_to_answer_all_land_whole(tmp_path: Path) -> None:
    # 30 ms before each answer: the workers usually grow mid-pull (started by the workers
    # themselves); whether they do depends on timing, so only the result is checked.
    root = tmp_path / "srv"
    (root / "bkt" / "m").mkdir(parents=True)
    files = {f"m/f{i:03d}.bin": blob(3 * KIB + i, i) for i in range(60)}
    for k, v in files.items():
        (root / "bkt" / k).write_bytes(v)
    with ObjectServer(root) as srv:
        srv.faults.latency_s = 0.03
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path))
        pulled = await helper.pull("m1", "m", json.dumps({"storage_key": "k"}))
        assert pulled is not None and pulled.disk_size_bytes == sum(len(v) for v in files.values())
        for k, v in files.items():
            assert (tmp_path / "models" / "m1" / k).read_bytes() == v
        assert len(srv.gets()) == len(files)  # each object once
        assert not list((tmp_path / "models").rglob("*.partial"))


async def test_a_store_that_keeps_dropping_fails_and_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "w").write_bytes(blob(300 * KIB))
    with ObjectServer(root) as srv:
        srv.faults.fail_status, srv.faults.fails = 503, 1000
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path))
        with pytest.raises(StorageError, match="HTTP 503") as e:
            await helper.pull("m", "w", json.dumps({"storage_key": "k"}))
        assert e.value.kind == "transient" and e.value.retryable
        assert not (tmp_path / "models" / "m").exists() and "m" not in helper.tier


def unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=False, capture_output=True)


def _can_mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], check=False, capture_output=True
    )
    return got.returncode == 0


def fake_free(monkeypatch, free: int) -> None:  # type: ignore[no-untyped-def]
    """The free-space check sees `free` bytes (another writer fills the volume after it)."""
    real = shutil.disk_usage
    monkeypatch.setattr(
        "meshd.storage.helper.shutil.disk_usage", lambda p: real(p)._replace(free=free, total=max(free, 1 << 41))
    )


@pytest.mark.parametrize(
    "seen_free", [None, 2 * MIB, 1 << 40], ids=["seen-before", "filled-during-tight", "filled-during-ample"]
)
async def test_a_full_disk_fails_the_pull_cleanly(tmp_path: Path, monkeypatch, seen_free: int | None) -> None:  # type: ignore[no-untyped-def]
    models = tmp_path / "models"
    if not _can_mount_tmpfs(models):
        pytest.skip("a small tmpfs needs root here (mount)")
    try:
        root = tmp_path / "srv"
        (root / "bkt" / "m").mkdir(parents=True)
        for i in range(3):  # 1,200 KiB on a 1 MiB volume: the third file does not fit
            (root / "bkt" / "m" / f"w{i}").write_bytes(blob(400 * KIB, i))
        if seen_free is not None:
            fake_free(monkeypatch, seen_free)
        with ObjectServer(root) as srv:
            write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
            # The budget believes in room the volume does not have; one worker: files in order.
            helper = await started(settings(tmp_path, budget_bytes=64 * MIB, parts_in_flight=1, objects_in_flight=1))
            with pytest.raises(StorageError, match=r"disk is full|free") as e:
                await helper.pull("m", "m", json.dumps({"storage_key": "k"}))
            assert e.value.kind == "disk" and ("disk is full" in str(e.value)) == (seen_free is not None)
            assert e.value.model_id == "m" and e.value.object == ("m/w2" if seen_free else "m")
            assert list(models.iterdir()) == [] and "m" not in helper.tier  # no file, partial or not
            if seen_free == 1 << 40:
                # Room to spare as far as the check knows: each file is created by its worker,
                # so two files moved before the third found the disk full.
                assert [g[1] for g in srv.gets()] == ["/bkt/m/w0", "/bkt/m/w1"]
            else:
                assert srv.gets() == []  # refused before a byte moved: the files are allocated first
            # The disk freed, the same pull succeeds (nothing stale in the way).
            for i in range(2):
                (root / "bkt" / "m" / f"w{i}").write_bytes(blob(100 * KIB, i))
            (root / "bkt" / "m" / "w2").unlink()
            helper = await started(settings(tmp_path, budget_bytes=64 * MIB, parts_in_flight=1, objects_in_flight=1))
            pulled = await helper.pull("m", "m", json.dumps({"storage_key": "k"}))
            assert pulled is not None and sorted(os.listdir(pulled.local_path)) == ["w0", "w1"]
    finally:
        unmount(models)


@pytest.mark.parametrize("ample", [True, False], ids=["files-made-by-workers", "files-allocated-first"])
async def test_both_ways_of_creating_the_files_pull_the_same_bytes(tmp_path: Path, monkeypatch, ample: bool) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "srv"
    files = {
        "m/big": blob(1200 * KIB, 1),  # five parts of 256 KiB: always allocated before the first GET
        "m/a/small": blob(100 * KIB, 2),
        "m/a/b/tiny": blob(10, 3),
        "m/empty": b"",
    }
    for name, data in files.items():
        (root / "bkt" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "bkt" / name).write_bytes(data)
    fake_free(monkeypatch, 1 << 40 if ample else sum(len(d) for d in files.values()))  # just enough: first
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path))
        pulled = await helper.pull("m", "m", json.dumps({"storage_key": "k"}))
        assert pulled is not None
        got = {
            str(p.relative_to(tmp_path / "models" / "m")): p.read_bytes()
            for p in (tmp_path / "models" / "m").rglob("*")
            if p.is_file()
        }
        assert got.pop(DONE_MARKER) and got == files
        assert len(srv.gets()) == 5 + 2  # the empty file needs no GET


async def test_a_small_object_resumed_after_a_drop_lands_whole(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "w").write_bytes(blob(300 * KIB, 1))  # one GET
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path))
        srv.faults.drop_after, srv.faults.drops = 100 * KIB, 1
        pulled = await helper.pull("m", "w", json.dumps({"storage_key": "k"}))
        assert pulled is not None and content(pulled.local_path) == blob(300 * KIB, 1)
        assert [g[2] for g in srv.gets()] == ["", f"bytes={100 * KIB}-{300 * KIB - 1}"]


async def test_an_s3_etag_of_32_hex_digits_that_is_not_the_md5_pulls(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # What S3 answers for SSE-KMS and SSE-C objects, and MinIO for encrypted ones.
    from meshd.testing import objserver

    def encrypted_etag(self: object, target: Path, size: int) -> str:
        return hashlib.md5(b"envelope" + target.read_bytes(), usedforsecurity=False).hexdigest()

    monkeypatch.setattr(objserver._Handler, "_etag", encrypted_etag)
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "w").write_bytes(blob(300 * KIB, 1))
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        helper = await started(settings(tmp_path))
        pulled = await helper.pull("m", "w", json.dumps({"storage_key": "k"}))
        assert pulled is not None and content(pulled.local_path) == blob(300 * KIB, 1)


# ---- listings: fresh, and listed again when an object changed ------------------------


async def test_an_object_changed_since_it_was_listed_is_listed_again(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt" / "m").mkdir(parents=True)
    (root / "bkt" / "m" / "small").write_bytes(blob(2 * KIB, 1))
    (root / "bkt" / "m" / "big").write_bytes(blob(900 * KIB, 1))  # in parts
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        key = json.dumps({"storage_key": "k"})
        helper = await started(settings(tmp_path))
        for name, size in (("small", 3 * KIB), ("big", 1000 * KIB)):
            assert await helper.predict_size(name, f"m/{name}", key) is not None  # listed
            (root / "bkt" / "m" / name).write_bytes(blob(size, 2))  # re-uploaded: a new ETag (412)
            pulled = await helper.pull(name, f"m/{name}", key)
            assert pulled is not None and content(pulled.local_path) == blob(size, 2)
            assert pulled.disk_size_bytes == size


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_an_object_rewritten_between_the_parts_of_a_pull_is_pulled_whole_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The same size, other bytes, after the first part is served: the next part's If-Match
    fails (412), the pull lists again and the file is the new one whole, never half of each."""
    from meshd.testing import objserver

    root = tmp_path / "srv"
    (root / "bkt" / "m").mkdir(parents=True)
    target = root / "bkt" / "m" / "w"
    target.write_bytes(blob(900 * KIB, 1))  # 4 parts of 256 KiB
    serve = objserver._Handler._file
    rewritten = threading.Event()

    def serve_then_rewrite(self: objserver._Handler, path: Path, head: bool) -> None:
        serve(self, path, head)
        if not head and path == target.resolve() and self.headers.get("Range") and not rewritten.is_set():
            rewritten.set()
            target.write_bytes(blob(900 * KIB, 2))

    monkeypatch.setattr(objserver._Handler, "_file", serve_then_rewrite)
    with ObjectServer(root) as srv:
        params: dict[str, object] = {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"}
        if kind == "http":
            params = {"type": "http", "url": f"{srv.url}/bkt"}
        write_config(tmp_path, "k", params)
        helper = await started(settings(tmp_path, parts_in_flight=1))  # parts one after another
        pulled = await helper.pull("m", "m/w", json.dumps({"storage_key": "k"}))
        assert rewritten.is_set()
        assert pulled is not None and content(pulled.local_path) == blob(900 * KIB, 2)
        ranged = [h for h in srv.headers_seen if h.get("Range")]
        assert ranged and all(h.get("If-Match") for h in ranged)


async def test_a_failed_pull_drops_its_listing(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt" / "m").mkdir(parents=True)
    (root / "bkt" / "m" / "a").write_bytes(b"a" * 10)
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        key = json.dumps({"storage_key": "k"})
        helper = await started(settings(tmp_path))
        assert await helper.predict_size("m", "m", key) == 10
        srv.faults.fail_status, srv.faults.fails = 403, 1
        with pytest.raises(StorageError, match="403"):
            await helper.pull("m", "m", key)
        (root / "bkt" / "m" / "b").write_bytes(b"b" * 5)  # added since the listing
        pulled = await helper.pull("m", "m", key)
        assert pulled is not None and sorted(os.listdir(pulled.local_path)) == ["a", "b"]


async def test_a_pull_never_trusts_an_old_listing(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from meshd.storage import helper as helper_mod

    monkeypatch.setattr(helper_mod, "PLAN_FRESH_S", 0.0)  # any listing is old by the time of the pull
    root = tmp_path / "srv"
    (root / "bkt" / "m").mkdir(parents=True)
    (root / "bkt" / "m" / "a").write_bytes(b"a" * 10)
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        key = json.dumps({"storage_key": "k"})
        helper = await started(settings(tmp_path))
        assert await helper.predict_size("m", "m", key) == 10
        assert await helper.predict_size("other", "m", key) == 10  # sized, never pulled here
        (root / "bkt" / "m" / "b").write_bytes(b"b" * 5)
        pulled = await helper.pull("m", "m", key)
        assert pulled is not None and sorted(os.listdir(pulled.local_path)) == ["a", "b"]
        assert "other" not in helper._plans  # an old listing is not kept either


# ---- schemas -------------------------------------------------------------------------


async def test_a_schema_file_or_folder_is_pulled_and_a_missing_one_named(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt" / "m").mkdir(parents=True)
    (root / "bkt" / "m" / "w").write_bytes(b"w" * 10)
    (root / "bkt" / "s" / "sub").mkdir(parents=True)
    (root / "bkt" / "s" / "a.json").write_text("{}")
    (root / "bkt" / "s" / "sub" / "b.json").write_text("[]")
    with ObjectServer(root) as srv:
        params = {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"}
        helper = await started(settings(tmp_path))
        for schema, found in (("s/a.json", ["a.json"]), ("/s", ["a.json", "sub"])):
            key = json.dumps({"storage_params": params, "schema_path": schema})
            pulled = await helper.pull(f"m{len(found)}", "m", key)
            assert pulled is not None
            local = Path(str(json.loads(pulled.key)["schema_path"]))
            assert local.is_absolute() and local.parent == Path(pulled.local_path).parent
            if len(found) == 1:
                assert content(local) == b"{}"
            else:
                assert sorted(os.listdir(local)) == found and content(local / "sub" / "b.json") == b"[]"
        with pytest.raises(StorageError, match="no such object") as e:
            await helper.pull("m3", "m", json.dumps({"storage_params": params, "schema_path": "nope/schema.json"}))
        assert e.value.kind == "not_found" and e.value.object == "nope/schema.json"
        assert not (tmp_path / "models" / "m3").exists()


async def test_a_pvc_schema_is_linked_and_its_key_rewritten(tmp_path: Path) -> None:
    vol = tmp_path / "pvc_mounts" / "vol"
    (vol / "m").mkdir(parents=True)
    (vol / "m" / "w.bin").write_bytes(b"12345")
    (vol / "schemas").mkdir()
    (vol / "schemas" / "s.json").write_text("{}")
    helper = await started(settings(tmp_path))
    key = {"storage_params": {"type": "pvc", "name": "vol"}, "schema_path": "schemas/s.json"}
    pulled = await helper.pull("p", "m", json.dumps(key))
    assert pulled is not None and pulled.disk_size_bytes == 5
    local = str(json.loads(pulled.key)["schema_path"])
    assert local == str(tmp_path / "models" / "p" / "s.json") and link_target(local) == vol / "schemas" / "s.json"
    with pytest.raises(StorageError, match="no such file") as e:
        await helper.pull("p2", "m", json.dumps({**key, "schema_path": "schemas/none.json"}))
    assert e.value.kind == "not_found" and e.value.object == "schemas/none.json"


# ---- nothing lost on the way to a failure ----------------------------------------------


async def test_a_pull_refused_for_space_evicts_nothing(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "a").write_bytes(blob(40 * KIB))
    (root / "bkt" / "b").write_bytes(blob(60 * KIB))
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        key = json.dumps({"storage_key": "k"})
        helper = await started(settings(tmp_path, budget_bytes=64 * KIB))
        await helper.pull("a", "a", key)
        helper.release("a")
        # b fits the budget only without a; the volume has no room for it even without a.
        fake_free(monkeypatch, 1000)
        with pytest.raises(StorageError, match="free") as e:
            await helper.pull("b", "b", key)
        assert e.value.kind == "disk"
        assert (tmp_path / "models" / "a" / "a").exists() and [m.model_id for m in helper.inventory().models] == ["a"]
        monkeypatch.undo()
        await helper.pull("b", "b", key)  # with room, a is evicted for it
        assert [m.model_id for m in helper.inventory().models] == ["b"] and not (tmp_path / "models" / "a").exists()


async def test_a_copy_from_another_source_stays_until_its_replacement_is_complete(tmp_path: Path) -> None:
    for srv_dir, seed in (("srv", 1), ("srv2", 2)):
        (tmp_path / srv_dir / "bkt").mkdir(parents=True)
        (tmp_path / srv_dir / "bkt" / "w").write_bytes(blob(20 * KIB, seed))
    with ObjectServer(tmp_path / "srv") as srv, ObjectServer(tmp_path / "srv2") as srv2:
        config = {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"}
        write_config(tmp_path, "k", config)
        key = json.dumps({"storage_key": "k"})
        helper = await started(settings(tmp_path))
        first = await helper.pull("m", "w", key)
        assert first is not None
        helper.release("m")
        write_config(tmp_path, "k", {**config, "endpoint_url": "http://127.0.0.1:9"})  # edited: nothing there
        with pytest.raises(StorageError):
            await helper.pull("m", "w", key)
        assert content(first.local_path) == blob(20 * KIB, 1) and "m" in helper.tier
        write_config(tmp_path, "k", {**config, "endpoint_url": srv2.url})
        pulled = await helper.pull("m", "w", key)
        assert pulled is not None and not pulled.from_disk and content(pulled.local_path) == blob(20 * KIB, 2)
        assert sorted(os.listdir(tmp_path / "models")) == ["m"]  # the old copy gone, nothing aside


async def test_an_unreadable_listing_is_the_models_storage_error(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import xml.etree.ElementTree as ET

    from meshd.storage.stores import S3Store

    def unreadable(self: object, path: str) -> list[object]:
        raise ET.ParseError("syntax error: line 1, column 0")

    monkeypatch.setattr(S3Store, "list_objects", unreadable)
    write_config(tmp_path, "k", {"type": "s3", "endpoint_url": "http://127.0.0.1:9", "bucket": "bkt"})
    helper = await started(settings(tmp_path))
    for call in (helper.predict_size, helper.pull):
        with pytest.raises(StorageError, match=r"unreadable.*ParseError") as e:
            await call("m", "w", json.dumps({"storage_key": "k"}))
        assert e.value.model_id == "m" and e.value.kind == "bad" and "bucket bkt" in str(e.value)


@pytest.mark.slow  # five tries that each wait out the stall limit
async def test_a_slow_pull_lives_while_it_progresses_and_a_silent_one_times_out(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "w").write_bytes(blob(256 * KIB))
    with ObjectServer(root) as srv:
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        key = json.dumps({"storage_key": "k"})
        # 256 KiB at 128 KiB/s: 2 s in all, far over the 0.6 s stall limit, never silent that long.
        srv.faults.rate = 128 * KIB
        helper = await started(settings(tmp_path, stall_ms=600))
        pulling = asyncio.create_task(helper.pull("slow", "w", key))
        seen = []  # what inventory() says of the running pull (meshd's load deadline reads it)
        while not pulling.done():
            seen.extend(helper.inventory().pulls)
            await asyncio.sleep(0.2)
        pulled = await pulling
        assert pulled is not None and pulled.pull_ms > 600
        assert {p.model_id for p in seen} == {"slow"} and helper.inventory().pulls == ()
        moving = [p for p in seen if p.bytes_total]
        assert moving and all(p.bytes_total == 256 * KIB and p.idle_ms < 600 for p in moving)
        assert moving[-1].bytes_done > moving[0].bytes_done and moving[-1].elapsed_ms > moving[0].elapsed_ms
        assert [m.pull_ms for m in helper.inventory().models] == [pulled.pull_ms]
        # Silent after 10 KiB, every time: each try times out; the pull fails naming the object.
        srv.faults.rate = 0
        srv.faults.drop_after, srv.faults.drops, srv.faults.hang_s = 10 * KIB, 100, 2.0
        with pytest.raises(StorageError, match=r"no bytes for 0.6 s") as e:
            await helper.pull("silent", "w", key)
        assert e.value.kind == "transient" and "'w'" in str(e.value)


async def test_close_ends_a_running_pull_at_once_and_refuses_new_ones(tmp_path: Path) -> None:
    """A runtime stopping mid-pull is not held until the store answers (or the stall limit):
    close() shuts the pull's connections, its load fails as retryable, its files are gone."""
    root = tmp_path / "srv"
    (root / "bkt").mkdir(parents=True)
    (root / "bkt" / "w").write_bytes(blob(2 * MIB))
    with ObjectServer(root) as srv:
        # Silent after 64 KiB of each GET for 30 s (then a dropped connection, retried): without
        # close() ending it, this pull would last minutes.
        srv.faults.drop_after, srv.faults.drops, srv.faults.hang_s = 64 * KIB, 100, 30.0
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        key = json.dumps({"storage_key": "k"})
        helper = await started(settings(tmp_path, stall_ms=600_000, budget_bytes=64 * MIB))
        pulling = asyncio.create_task(helper.pull("m", "w", key))
        models = tmp_path / "models"
        await wait_until_async(
            lambda: len(srv.gets()) >= 2 and any(models.glob(".m.partial/*")), timeout_s=30, what="the pull under way"
        )
        await asyncio.wait_for(helper.close(), timeout=20)  # a hang guard, not a timing check
        with pytest.raises(StorageError, match="stopping") as e:
            await asyncio.wait_for(pulling, timeout=5)
        assert e.value.retryable and "'m'" in str(e.value)
        assert not (models / "m").exists() and helper.inventory().models == ()
        assert not [t for t in threading.enumerate() if t.name.startswith("pull-m")]
        with pytest.raises(StorageError, match="stopping"):
            await helper.pull("other", "w", key)


KILLED_CHILD = """
import asyncio, json, sys
from pathlib import Path
from meshd.storage import StorageHelper, StorageSettings
s = StorageSettings(Path(sys.argv[1]), Path(sys.argv[2]), budget_bytes=1 << 30,
                    part_bytes=1 << 18, part_threshold=1 << 19)
async def main():
    h = StorageHelper(s)
    await h.start()
    await h.pull("m", "m", json.dumps({"storage_key": "k"}))
asyncio.run(main())
"""


def start_child(models: Path, config_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(models), str(config_dir)])


@pytest.mark.slow  # a child process, killed
async def test_killed_mid_pull_the_next_start_cleans_up_and_pulls_again(tmp_path: Path) -> None:
    root = tmp_path / "srv"
    (root / "bkt" / "m").mkdir(parents=True)
    data = blob(1 * MIB)
    (root / "bkt" / "m" / "w.bin").write_bytes(data)
    (root / "bkt" / "m" / "small").write_bytes(b"abc")
    models = tmp_path / "models"
    with ObjectServer(root) as srv:
        srv.faults.rate = 256 * KIB  # 4 s for the big file: time to kill it mid-way
        write_config(tmp_path, "k", {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        child = start_child(models, tmp_path / "storage-config")
        try:
            await wait_until_async(
                lambda: any(p.stat().st_size > 0 for p in models.glob(".m.partial/m/*")) and len(srv.gets()) >= 2,
                timeout_s=30,
                what="the child's pull under way",
            )
            await asyncio.sleep(0.3)
        finally:
            child.kill()  # SIGKILL: no clean-up of its own
            child.wait()
        assert list(models.glob(".m.partial/m/*")) and not (models / "m").exists()  # staged, not in place
        srv.faults.rate = 0
        helper = await started(settings(tmp_path))
        assert not (models / "m").exists() and not list(models.glob(".m.partial")) and helper.inventory().models == ()
        pulled = await helper.pull("m", "m", json.dumps({"storage_key": "k"}))
        assert pulled is not None and not pulled.from_disk
        assert content(Path(pulled.local_path) / "w.bin") == data


@pytest.mark.slow
def test_pull_bench_smoke() -> None:
    """bench/pull.py runs end to end and prints every row (no timing thresholds here)."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "pull.py"
    proc = subprocess.run([sys.executable, str(bench), "--smoke"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {tuple(line.split()[:2]) for line in proc.stdout.splitlines()}
    for case in ("big", "small"):
        for tool in ("meshd", "meshd-fsync", "boto3", "s5cmd", "reload"):
            assert (case, tool) in rows, proc.stdout
    assert ("big", "one-GET") in rows and "summary:" in proc.stdout
