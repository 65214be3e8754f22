"""Storage faults through the process a runtime really talks to (issue 42 item 5): `meshd
adapter` (supervising a real MLServer) asked over gRPC `loadModel` for models in a store of
our own (`meshd.testing.objserver`, S3 shape, refusing any access key but its own). Wrong
credentials fail the load at once, naming the model, the store and the object, after one
request and without the secret; a model over the disk budget is refused before a byte moves;
the adapter killed -9 mid-pull leaves a half-written model that its next start removes, and the
load then pulls it again and MLServer serves it."""

from __future__ import annotations

import json
import shutil
import signal
import threading
from pathlib import Path

import grpc
import pytest

from meshd._proto.mmesh import model_runtime_pb2 as rt
from meshd._proto.mmesh import model_runtime_pb2_grpc as rt_grpc
from meshd.storage.helper import DONE_MARKER
from meshd.testing.mlserver import kill_mlserver, mlserver_python, start_mlserver_adapter, train_sklearn_models
from meshd.testing.objserver import ObjectServer
from meshd.testing.procs import Children, free_ports, port_open, wait_until

pytestmark = pytest.mark.slow

ACCESS, WRONG, SECRET = "AKIDMESHDRIGHT", "AKIDMESHDWRONG", "meshd-faults-secret-never-logged"
OVERHEAD = 256 << 20


def test_wrong_credentials_and_a_model_over_the_budget_fail_the_load_clearly(tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "bkt" / "big").mkdir(parents=True)
    (store / "bkt" / "big" / "weights.bin").write_bytes(b"\1" * (2 << 20))
    config = tmp_path / "storage-config"
    config.mkdir()
    with ObjectServer(store, access_key=ACCESS) as srv:
        for name, key in (("good", ACCESS), ("wrong", WRONG)):
            entry = {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "region": "us-east-1"}
            entry.update(access_key_id=key, secret_access_key=SECRET)
            (config / name).write_text(json.dumps(entry))
        adapter_port, mlserver_port, http_port = free_ports(3)
        pid_file = tmp_path / "mlserver.pid"
        root = tmp_path / "models"
        try:
            with Children(tmp_path / "logs") as children:
                adapter = start_mlserver_adapter(
                    children,
                    mlserver_python(),
                    tmp_path,
                    (adapter_port, mlserver_port, http_port),
                    (64 << 20) + OVERHEAD,
                    pid_file,
                    ["--memory-overhead-bytes", str(OVERHEAD), "--root-model-dir", str(root)],
                    env={"STORAGE_CONFIG_DIR": str(config), "MESHD_DISK_CACHE_BYTES": str(1 << 20)},
                )
                wait_until(lambda: port_open(adapter_port) and port_open(mlserver_port), 120, "adapter and MLServer")
                with grpc.insecure_channel(f"127.0.0.1:{adapter_port}") as ch:
                    stub = rt_grpc.ModelRuntimeStub(ch)

                    def load(model_id: str, key: str) -> grpc.RpcError:
                        keyed = json.dumps({"storage_key": key})
                        request = rt.LoadModelRequest(
                            modelId=model_id, modelPath="big", modelType="sklearn", modelKey=keyed
                        )
                        with pytest.raises(grpc.RpcError) as e:
                            stub.loadModel(request, timeout=60)
                        return e.value

                    # Wrong credentials: one request (the listing), no retry, a clear failure.
                    err = load("m-wrong", "wrong")
                    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
                    text = err.details() or ""
                    assert "m-wrong" in text and srv.url.split("//")[1] in text and "'big'" in text
                    assert "403" in text and SECRET not in text and WRONG not in text
                    assert len(srv.requests) == 1

                    # Over the disk budget (1 MiB; the model is 2 MiB): refused after the
                    # listing, before a byte of the model moves.
                    err = load("m-big", "good")
                    # INTERNAL: retryable, another instance's disk may hold it.
                    assert err.code() == grpc.StatusCode.INTERNAL, err.details()
                    text = err.details() or ""
                    assert "m-big" in text and "too large for the disk" in text and "'big'" in text
                    assert srv.gets() == [] and len(srv.requests) == 2
                    assert not (root / "m-big").exists() and not (root / "m-wrong").exists()
                log = adapter.log_path.read_text(errors="replace")
                assert SECRET not in log and WRONG not in log and ACCESS not in log
        finally:
            kill_mlserver(pid_file)


def test_an_adapter_killed_mid_pull_is_cleaned_up_at_its_next_start_which_pulls_again(tmp_path: Path) -> None:
    python = mlserver_python()
    model = train_sklearn_models(python, tmp_path / "trained", 1)[0]
    store = tmp_path / "store"
    folder = store / "bkt" / "sklearn" / model.name
    shutil.copytree(model.path, folder)
    (folder / "padding.bin").write_bytes(b"\0" * (1 << 20))  # 4 s at the rate below: time to kill
    config = tmp_path / "storage-config"
    config.mkdir()
    root = tmp_path / "models"
    pid_file = tmp_path / "mlserver.pid"
    with ObjectServer(store) as srv, Children(tmp_path / "logs") as children:
        entry = {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"}
        (config / "k").write_text(json.dumps(entry))
        request = rt.LoadModelRequest(
            modelId=model.name,
            modelPath=f"sklearn/{model.name}",
            modelType="sklearn",
            modelKey=json.dumps({"storage_key": "k", "model_type": "sklearn"}),
        )

        def start() -> int:
            adapter_port, mlserver_port, http_port = free_ports(3)
            start_mlserver_adapter(
                children,
                python,
                tmp_path,
                (adapter_port, mlserver_port, http_port),
                (64 << 20) + OVERHEAD,
                pid_file,
                ["--memory-overhead-bytes", str(OVERHEAD), "--root-model-dir", str(root)],
                env={"STORAGE_CONFIG_DIR": str(config)},
            )
            wait_until(lambda: port_open(adapter_port) and port_open(mlserver_port), 120, "adapter and MLServer")
            return adapter_port

        try:
            srv.faults.rate = 256 << 10
            port = start()
            first = children.items[-1]
            outcome: list[object] = []

            def ask() -> None:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    try:
                        outcome.append(rt_grpc.ModelRuntimeStub(ch).loadModel(request, timeout=60))
                    except grpc.RpcError as e:
                        outcome.append(e)

            asker = threading.Thread(target=ask)
            asker.start()
            wait_until(lambda: any(p.stat().st_size > 0 for p in root.glob(".*.partial/*/*")), 30, "the pull under way")
            first.stop(sig=signal.SIGKILL)  # no clean-up of its own
            kill_mlserver(pid_file)  # its MLServer, orphaned
            asker.join(30)
            assert outcome and isinstance(outcome[0], grpc.RpcError)  # the load never answered as done
            assert list(root.glob(".*.partial/*/*")) and not (root / model.name).exists()  # staged, not in place

            srv.faults.rate = 0
            gets = len(srv.gets())
            port = start()  # its helper's start-up removed the half-written pull
            assert not list(root.rglob("*.partial"))
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                loaded = rt_grpc.ModelRuntimeStub(ch).loadModel(request, timeout=60)
            assert loaded.sizeInBytes > 0 and len(srv.gets()) > gets  # pulled again, not found on disk
            assert (root / model.name / DONE_MARKER).is_file()
            assert (root / model.name / model.name / "model.joblib").read_bytes() == (
                model.path / "model.joblib"
            ).read_bytes()
        finally:
            kill_mlserver(pid_file)
