"""A model where its users keep it (issue 42): meshd + `meshd adapter` (with a model folder)
+ a real MLServer, the model in an S3-protocol store (moto's server, started here) named the
way modelmesh-serving names it (a `storage-config` entry, `storage_key`, `storage_params`).
The adapter pulls it before the load, MLServer loads the local copy, the files stay on disk
after the unload, meshd's record says so, and a reload comes from the disk, not the store.
A pull longer than the runtime's loading timeout is not cut while it runs (upstream's load
timed out: modelmesh-serving#219)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.core.records import DISK_TIER
from meshd.decisions.placement.disk import disk_reading
from meshd.testing.cluster import LocalMesh
from meshd.testing.mlserver import kill_mlserver, start_mlserver_adapter, train_sklearn_models
from meshd.testing.objserver import ObjectServer
from meshd.testing.procs import free_ports, port_open, wait_until

from .test_adapter_mlserver import OVERHEAD, Stack, infer, loaded_in_mlserver, mlserver_env  # noqa: F401
from .test_upstream_keys import under, upstream_key

pytestmark = pytest.mark.slow

ACCESS, SECRET = "AKIAMESHDTEST", "meshd-test-secret-never-logged"
BUCKET = "modelmesh-example-models"  # modelmesh-serving's example bucket name


@pytest.fixture
def stack(mlserver_env: Path, tmp_path: Path, etcd_server: object, moto_url: str) -> Iterator[Stack]:  # noqa: F811
    import boto3  # a dev dependency: missing, the test fails rather than skips

    models = train_sklearn_models(mlserver_env, tmp_path / "trained", 1)
    s3 = boto3.client(
        "s3", endpoint_url=moto_url, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET, region_name="us-east-1"
    )
    s3.create_bucket(Bucket=BUCKET)
    for m in models:
        for f in m.path.rglob("*"):
            if f.is_file():
                s3.upload_file(str(f), BUCKET, f"sklearn/{m.name}/{f.relative_to(m.path)}")
    # modelmesh-serving's storage-config secret, one file per key (its docs' localMinIO entry).
    config = tmp_path / "storage-config"
    config.mkdir()
    (config / "localMinIO").write_text(
        json.dumps(
            {
                "type": "s3",
                "access_key_id": ACCESS,
                "secret_access_key": SECRET,
                "endpoint_url": moto_url,
                "default_bucket": BUCKET,
                "region": "us-east-1",
            }
        )
    )
    with mlserver_stack(
        mlserver_env, tmp_path, etcd_server, "adapter-storage", {"STORAGE_CONFIG_DIR": str(config)}
    ) as st:
        st.models = models
        yield st


@contextlib.contextmanager
def mlserver_stack(
    python: Path, tmp_path: Path, etcd_server: object, service: str, env: dict[str, str]
) -> Iterator[Stack]:
    """meshd beside `meshd adapter` (models pulled under tmp_path/models) and a real MLServer;
    every process stopped on the way out."""
    mlserver_port, http_port, adapter_port, grpc_port = free_ports(4)
    pid_file = tmp_path / "mlserver.pid"
    mesh = LocalMesh(tmp_path / "mesh", service=service)
    mesh.etcd_url = etcd_server.url  # type: ignore[attr-defined]
    try:
        adapter = start_mlserver_adapter(
            mesh.children,
            python,
            tmp_path,
            (adapter_port, mlserver_port, http_port),
            (64 << 20) + OVERHEAD,
            pid_file,
            ["--memory-overhead-bytes", str(OVERHEAD), "--root-model-dir", str(tmp_path / "models")],
            env=env,
        )
        wait_until(lambda: port_open(adapter_port) and port_open(mlserver_port), 120, "adapter and MLServer")
        meshd = mesh.start_meshd(
            "inst-a", adapter_port, {"serving_port": mlserver_port, "rate_check_ms": 600_000}, grpc_port=grpc_port
        )
        yield Stack(meshd, adapter, grpc_port, mlserver_port, pid_file, [])
    finally:
        mesh.stop()
        kill_mlserver(pid_file)


def register(ch: grpc.Channel, name: str) -> None:
    # What modelmesh-serving's controller writes for a Predictor with storage.key/path.
    key = json.dumps({"storage_key": "localMinIO", "storage_params": {"bucket": BUCKET}, "model_type": "sklearn"})
    info = mm.ModelInfo(type="sklearn", path=f"sklearn/{name}", key=key)
    mm_grpc.ModelMeshStub(ch).registerModel(mm.RegisterModelRequest(modelId=name, modelInfo=info), timeout=30)


def test_a_model_in_s3_is_pulled_served_kept_on_disk_and_reloaded_from_it(
    stack: Stack, tmp_path: Path, etcd_server: object
) -> None:
    model = stack.models[0]
    root = tmp_path / "models"
    with stack.channel() as ch:
        register(ch, model.name)
        assert infer(ch, model) == model.expected
        assert (root / model.name / model.name / "model.joblib").is_file()  # ROOT_MODEL_DIR/<id>/<basename>
        assert not list(root.rglob("*.partial"))

        # meshd publishes what the adapter keeps on disk.
        key = upstream_key("", "adapter-storage", "instances", "inst-a")

        def on_disk() -> bool:
            reading = disk_reading(under(etcd_server, key).get(key, {}))  # type: ignore[arg-type]
            return reading is not None and model.name in reading

        wait_until(on_disk, 20, "the instance record to name the model on disk")
        assert DISK_TIER in under(etcd_server, key)[key]  # type: ignore[arg-type]

        # Unloaded (unregistered): MLServer lets it go, its files stay.
        mm_grpc.ModelMeshStub(ch).unregisterModel(mm.UnregisterModelRequest(modelId=model.name), timeout=30)
        wait_until(lambda: model.name not in loaded_in_mlserver(stack), 20, "the model to be unloaded")
        assert (root / model.name / model.name / "model.joblib").is_file()

        # The store loses it; a reload still serves, from the disk tier.
        import boto3  # a dev dependency: missing, the test fails rather than skips

        s3 = boto3.client(
            "s3",
            endpoint_url=json.loads((tmp_path / "storage-config" / "localMinIO").read_text())["endpoint_url"],
            aws_access_key_id=ACCESS,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )
        for obj in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"sklearn/{model.name}/").get("Contents", []):
            s3.delete_object(Bucket=BUCKET, Key=obj["Key"])
        register(ch, model.name)
        assert infer(ch, model) == model.expected
    # No credential in the adapter's or meshd's output.
    for child in (stack.adapter, stack.meshd):
        text = child.log_path.read_text(errors="replace")
        assert text and SECRET not in text and ACCESS not in text


def test_a_pull_longer_than_the_loading_timeout_is_not_cut(
    mlserver_env: Path,  # noqa: F811
    tmp_path: Path,
    etcd_server: object,
) -> None:
    """LOADTIME_TIMEOUT 8 s; the model's pull takes about 14 s (7 MiB at 512 KiB/s): meshd keeps
    the load while the adapter's disk tier lists the pull as running, and the request that asked
    for the model is answered. Before, the load failed at 8 s, however steadily it pulled."""
    model = train_sklearn_models(mlserver_env, tmp_path / "trained", 1)[0]
    folder = tmp_path / "store" / "bkt" / "sklearn" / model.name
    shutil.copytree(model.path, folder)
    (folder / "padding.bin").write_bytes(b"\0" * (7 << 20))
    config = tmp_path / "storage-config"
    config.mkdir()
    with ObjectServer(tmp_path / "store") as srv:
        srv.faults.rate = 512 << 10
        (config / "slow").write_text(
            json.dumps({"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"})
        )
        env = {"STORAGE_CONFIG_DIR": str(config), "LOADTIME_TIMEOUT": "8000"}
        with mlserver_stack(mlserver_env, tmp_path, etcd_server, "adapter-slow-pull", env) as stack:
            with stack.channel() as ch:
                key = json.dumps({"storage_key": "slow", "model_type": "sklearn"})
                info = mm.ModelInfo(type="sklearn", path=f"sklearn/{model.name}", key=key)
                mm_grpc.ModelMeshStub(ch).registerModel(
                    mm.RegisterModelRequest(modelId=model.name, modelInfo=info), timeout=30
                )
                assert infer(ch, model, timeout=90) == model.expected
            pulled = re.search(rf"{model.name}: pulled in (\d+) ms", stack.adapter.log_path.read_text())
            assert pulled is not None and int(pulled.group(1)) > 8000, "the pull was not longer than the timeout"
            assert "timed out" not in stack.meshd.log_path.read_text()
