"""meshd in the `mm` container of a pod as modelmesh-serving's controller builds it, driven the
way the controller drives it (kserve/modelmesh-serving: config/internal/base/deployment.yaml.tmpl,
controllers/modelmesh/{modelmesh,runtime,etcd,cluster_config}.go, predictor_controller.go).

The pod: the controller's env for `mm` (MM_SERVICE_NAME, MM_SVC_GRPC_PORT, WKUBE_POD_NAME,
WKUBE_POD_IPADDR, MM_LOCATION, KV_STORE from the mounted etcd secret, MM_METRICS with
scheme=https, SHUTDOWN_TIMEOUT_MS=90000, MM_KVSTORE_PREFIX=mm, MM_DEFAULT_VMODEL_OWNER,
MM_LABELS, MM_TYPE_CONSTRAINTS_PATH and MM_DATAPLANE_CONFIG_PATH on a mounted ConfigMap,
INTERNAL_GRPC_PORT = the adapter, INTERNAL_SERVING_GRPC_PORT = the model server), the adapter
(`meshd adapter`) in front of a real MLServer, the probes polled over HTTP as the kubelet does,
and at shutdown the runtime containers' preStop (GET :8090/prestop) and the mm container's
own (`stop.sh wait`), which must return only once meshd is gone. mm's meshd is a plain
`pip install` of this checkout (conftest.py): the controller's https metrics with no TLS secret
work from that. Ports the controller fixes (8033, 8089, 8090, 2112, the adapter's)
are free ports here, so tests can share the host; each is set by its upstream variable.

A TLS variant: the controller's TLS env (a `tls.secretName` Secret, `tls.clientAuth: require`)
with the certificate modelmesh-serving's docs/configuration/tls.md has users make (names the
service, localhost and 0.0.0.0; no pod IP), two pods forwarding between them, and /metrics
scraped as Prometheus does (no client certificate).

The flows: setVModel with owner, autoDeleteTargetModel and loadNow; getVModelStatus polled to
LOADED; an update through TRANSITIONING; deleteVModel (the auto-delete target goes with it);
and the three no-supporting-runtime states with the exact messages the controller decodes,
one of them produced by a ConfigMap update (symlink swap) of the type constraints.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.inference import grpc_predict_v2_pb2_grpc as v2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.testing.mlserver import (
    TrainedModel,
    kill_mlserver,
    mlserver_python,
    start_mlserver_adapter,
    train_sklearn_models,
)
from meshd.testing.procs import Child, Children, free_port, free_ports, port_open, wait_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "modelmesh-serving"
RUNTIME = "mlserver-1.x"
OWNER = "ksp"  # the controller's MM_DEFAULT_VMODEL_OWNER
ST = mm.ModelStatusInfo
VST = mm.VModelStatusInfo
NO_HOME = "There are no running instances that meet the label requirements of type "

# MM_LABELS the controller gives an MLServer ServingRuntime's pods (GetServingRuntimeLabelSets).
LABELS = ["mt:sklearn", "mt:sklearn:0", "mt:xgboost", "mt:xgboost:1", "pv:grpc-v2", "pv:v2", f"rt:{RUNTIME}"]


def type_constraints(extra_runtime_labels: list[str]) -> str:
    """The tc-config ConfigMap's type_constraints as the controller computes it: each label of
    each runtime in the namespace requires itself; unknown types require `_no_runtime`."""
    constraints: dict[str, dict[str, list[str]]] = {}
    for label in [*LABELS, *extra_runtime_labels]:
        constraints[label] = {"required": [label]}
    constraints["mt:sklearn|pv:grpc-v2"] = {"required": ["mt:sklearn", "pv:grpc-v2"]}
    constraints["_default"] = {"required": ["_no_runtime"]}
    return json.dumps(constraints)


DATAPLANE = json.dumps(
    {
        "rpcConfigs": {
            "inference.GRPCInferenceService/ModelInfer": {"idExtractionPath": [1], "vModelId": True},
            "inference.GRPCInferenceService/ModelMetadata": {"idExtractionPath": [1], "vModelId": True},
        },
        "allowOtherRpcs": True,
    }
)


def write_configmap(mount: Path, version: int, files: dict[str, str]) -> None:
    """A ConfigMap volume as the kubelet writes it: files in `..<timestamped dir>`, `..data`
    swapped to it atomically, and each key a symlink through `..data`."""
    data = mount / f"..2026_01_01_00_00_0{version}"
    data.mkdir(parents=True)
    for key, text in files.items():
        (data / key).write_text(text)
    tmp = mount / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, mount / "..data")
    for key in files:
        if not (mount / key).is_symlink():
            (mount / key).symlink_to(f"..data/{key}")


def kv_store_env(connection_file: Path) -> str:
    """KV_STORE as the controller sets it: `etcd:<path of the mounted etcd secret>`."""
    return f"etcd:{connection_file}"


@dataclass
class Pod:
    procs: Children
    meshd: Child
    adapter: Child | None
    env: dict[str, str]
    grpc_port: int
    probe_port: int
    prestop_port: int
    metrics_port: int
    mlserver_pid_file: Path
    configmap: Path
    models: list[TrainedModel]
    meshd_bin: Path  # where mm's `meshd` is (a plain install)

    def http(self, port: int, path: str, timeout: float = 5.0) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0  # not answering


def start_adapter(
    pod: Pod,
    mlserver_env: Path,
    tmp: Path,
    adapter_port: int,
    mlserver_port: int,
    env: dict[str, str] | None = None,
) -> Child:
    ports = (adapter_port, mlserver_port, free_ports(1, avoid=(adapter_port, mlserver_port))[0])
    return start_mlserver_adapter(pod.procs, mlserver_env, tmp, ports, 512 << 20, pod.mlserver_pid_file, env=env)


@pytest.fixture(scope="module")
def mlserver_env() -> Path:
    return mlserver_python()


@pytest.fixture
def pod(mlserver_env: Path, tmp_path: Path, etcd_server: object, plain_meshd: Path) -> Iterator[Pod]:
    yield from start_pod(mlserver_env, tmp_path, etcd_server, plain_meshd)


def start_pod(
    mlserver_env: Path,
    tmp_path: Path,
    etcd_server: object,
    plain_meshd: Path,
    adapter_env: dict[str, str] | None = None,
) -> Iterator[Pod]:
    """The pod; `adapter_env`: more environment for the runtime container (the adapter)."""
    models = train_sklearn_models(mlserver_env, tmp_path / "models", 2)
    # The etcd secret, mounted as the controller mounts it (controllers/modelmesh/etcd.go).
    secret = tmp_path / "opt/kserve/mmesh/etcd/etcd_connection"
    secret.parent.mkdir(parents=True)
    secret.write_text(json.dumps({"endpoints": etcd_server.url, "root_prefix": "modelmesh-serving"}))  # type: ignore[attr-defined]
    configmap = tmp_path / "etc/watson/mmesh/config"
    configmap.mkdir(parents=True)
    write_configmap(
        configmap, 1, {"type_constraints": type_constraints(["mt:onnx"]), "dataplane_api_config": DATAPLANE}
    )
    grpc_port, probe_port, prestop_port, metrics_port, adapter_port, mlserver_port, peer_port, http_port = free_ports(8)
    env = {
        # config/internal/base/deployment.yaml.tmpl
        "MM_SERVICE_NAME": SERVICE,
        "MM_SVC_GRPC_PORT": str(grpc_port),
        "WKUBE_POD_NAME": f"{SERVICE}-{RUNTIME}-6d8f9c7b5d-x2x7k",
        "WKUBE_POD_IPADDR": "127.0.0.1",
        "MM_LOCATION": "127.0.0.1",  # status.hostIP
        "KV_STORE": kv_store_env(secret),
        "MM_METRICS": f"prometheus:port={metrics_port};scheme=https",
        "SHUTDOWN_TIMEOUT_MS": "90000",
        # controllers/modelmesh/modelmesh.go, runtime.go, cluster_config.go
        "MM_KVSTORE_PREFIX": "mm",
        "MM_DEFAULT_VMODEL_OWNER": OWNER,
        "MM_LABELS": ",".join(LABELS),
        "MM_TYPE_CONSTRAINTS_PATH": str(configmap / "type_constraints"),
        "MM_DATAPLANE_CONFIG_PATH": str(configmap / "dataplane_api_config"),
        "INTERNAL_GRPC_PORT": str(adapter_port),
        "INTERNAL_SERVING_GRPC_PORT": str(mlserver_port),
        # Upstream's fixed ports (8089, 8090) and meshd's own, moved off for a shared host.
        "MM_PROBE_PORT": str(probe_port),
        "MM_PRESTOP_WAIT_PORT": str(prestop_port),
        "MESHD_PEER_PORT": str(peer_port),
        "MESHD_HTTP_PORT": str(http_port),
        "MESHD_DATA_DIR": str(tmp_path / "data"),
    }
    procs = Children(tmp_path / "logs")
    pid_file = tmp_path / "mlserver.pid"
    try:
        # mm's meshd: a plain install, with the controller's https metrics and no TLS secret.
        meshd = procs.start("mm", [str(plain_meshd / "meshd"), "serve"], env)
        pod = Pod(
            procs,
            meshd,
            None,
            env,
            grpc_port,
            probe_port,
            prestop_port,
            metrics_port,
            pid_file,
            configmap,
            models,
            plain_meshd,
        )
        # The kubelet's probes, before the runtime is up: live, not ready.
        wait_until(lambda: pod.http(probe_port, "/live") == 200 or not meshd.alive(), 60, "/live")
        assert meshd.alive(), meshd.log_tail()
        assert pod.http(probe_port, "/ready") == 503, "ready before the runtime answered"
        pod.adapter = start_adapter(pod, mlserver_env, tmp_path, adapter_port, mlserver_port, adapter_env)
        wait_until(lambda: pod.http(probe_port, "/ready") == 200 or not meshd.alive(), 180, "/ready")
        assert meshd.alive(), meshd.log_tail()
        yield pod
    finally:
        procs.stop_all()  # whatever is left, in reverse start order (by PID)
        kill_mlserver(pid_file)  # and MLServer itself, had the adapter died first


def decode_model_state(status: mm.ModelStatusInfo) -> tuple[str, str]:
    """modelmesh-serving's reading of a ModelStatusInfo (predictor_controller.go,
    decodeModelState), restated from its documented rules: (state, failure reason)."""
    states = {ST.LOADED: "Loaded", ST.LOADING: "Loading", ST.LOADING_FAILED: "FailedToLoad"}
    state = states.get(status.status, "Pending")
    message = status.errors[0] if status.errors else ""
    if state != "FailedToLoad":
        return state, "ModelLoadFailed" if message else ""
    if not message.startswith(NO_HOME):
        return "FailedToLoad", "ModelLoadFailed"
    if not message.endswith("[_no_runtime]"):
        return "Loading", "RuntimeUnhealthy"
    if message[len(NO_HOME) : len(NO_HOME) + 3] == "rt:":
        return "FailedToLoad", "RuntimeNotRecognized"
    return "FailedToLoad", "NoSupportingRuntime"


def model_info(model: TrainedModel, model_type: str = "mt:sklearn") -> mm.ModelInfo:
    # A model already on the pod's disk: its key names no store (this pod's adapter has no
    # ROOT_MODEL_DIR and reads the path where it is). A model in the secret's store, pulled
    # first: test_a_predictor_with_storage_key_and_path_loads_from_the_secrets_store.
    key = {"model_type": {"name": "sklearn"}, "disk_size_bytes": 1024}
    return mm.ModelInfo(type=model_type, path=str(model.path), key=json.dumps(key))


def set_vmodel(stub: mm_grpc.ModelMeshStub, vmodel: str, target: str, info: mm.ModelInfo) -> VST:
    # As the controller calls it (predictor_controller.go): owner, autoDelete, loadNow.
    req = mm.SetVModelRequest(
        vModelId=vmodel,
        targetModelId=target,
        modelInfo=info,
        autoDeleteTargetModel=True,
        loadNow=True,
        owner=OWNER,
    )
    return stub.setVModel(req, timeout=30)


def vmodel_status(stub: mm_grpc.ModelMeshStub, vmodel: str) -> VST:
    return stub.getVModelStatus(mm.GetVModelStatusRequest(vModelId=vmodel, owner=OWNER), timeout=10)


def poll_vmodel(stub: mm_grpc.ModelMeshStub, vmodel: str, done: object, what: str, timeout: float = 120) -> VST:
    seen: list[VST] = []

    def check() -> bool:
        seen.append(vmodel_status(stub, vmodel))
        return bool(done(seen[-1]))  # type: ignore[operator]

    wait_until(check, timeout, what, interval_s=0.2)
    return seen[-1]


def infer(channel: grpc.Channel, vmodel: str, model: TrainedModel) -> list[int]:
    rows = model.inputs
    req = v2.ModelInferRequest(model_name=vmodel)  # the dataplane config: the vmodel id is in the body
    tensor = req.inputs.add(name="x", datatype="FP64", shape=[len(rows), 4])
    tensor.contents.fp64_contents.extend(v for row in rows for v in row)
    resp = v2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=60)
    return list(resp.outputs[0].contents.int64_contents)


def test_the_controllers_flows_on_a_pod_it_would_start(pod: Pod) -> None:
    first, second = pod.models
    with grpc.insecure_channel(f"127.0.0.1:{pod.grpc_port}") as ch:
        stub = mm_grpc.ModelMeshStub(ch)

        # Create: the response, then polled to LOADED, as the predictor reconciler does.
        created = set_vmodel(stub, "isvc-a", "isvc-a__isvc-1111111111", model_info(first))
        assert created.owner == OWNER and created.targetModelId == "isvc-a__isvc-1111111111"
        assert created.activeModelStatus.status in (ST.LOADING, ST.LOADED), created
        loaded = poll_vmodel(stub, "isvc-a", lambda s: s.activeModelStatus.status == ST.LOADED, "isvc-a LOADED")
        assert loaded.status == VST.DEFINED and decode_model_state(loaded.activeModelStatus) == ("Loaded", "")
        # The instance id is the pod name's last 12 characters, as upstream's.
        assert [c.location for c in loaded.activeModelStatus.modelCopyInfos] == [pod.env["WKUBE_POD_NAME"][-12:]]
        assert infer(ch, "isvc-a", first) == first.expected  # the id from the body, per the dataplane config

        # Update: a new target; TRANSITIONING until it is loaded, then it is active.
        updated = set_vmodel(stub, "isvc-a", "isvc-a__isvc-2222222222", model_info(second))
        assert updated.status == VST.TRANSITIONING, updated
        assert updated.activeModelId == "isvc-a__isvc-1111111111"
        assert decode_model_state(updated.targetModelStatus)[0] == "Loading"
        done = poll_vmodel(stub, "isvc-a", lambda s: s.status == VST.DEFINED, "the transition")
        assert done.activeModelId == "isvc-a__isvc-2222222222" and done.activeModelStatus.status == ST.LOADED
        assert infer(ch, "isvc-a", second) == second.expected
        # autoDeleteTargetModel: the replaced model goes once no vmodel refers to it.
        gone = mm.GetStatusRequest(modelId="isvc-a__isvc-1111111111")
        wait_until(lambda: stub.getModelStatus(gone, timeout=10).status == ST.NOT_FOUND, 30, "old target deleted")

        # Delete: the vmodel, and its auto-delete target with it.
        stub.deleteVModel(mm.DeleteVModelRequest(vModelId="isvc-a", owner=OWNER), timeout=30)
        assert vmodel_status(stub, "isvc-a").status == VST.NOT_FOUND
        last = mm.GetStatusRequest(modelId="isvc-a__isvc-2222222222")
        wait_until(lambda: stub.getModelStatus(last, timeout=10).status == ST.NOT_FOUND, 30, "target deleted")

        # No supporting runtime, three ways, each with the message the controller decodes.
        cases = {
            # a runtime for the type exists in the namespace, but none of its pods is running
            "mt:onnx": ("Loading", "RuntimeUnhealthy", "mt:onnx: [mt:onnx]"),
            # a runtime named that the namespace does not have
            "rt:triton-2.x": ("FailedToLoad", "RuntimeNotRecognized", "rt:triton-2.x: [_no_runtime]"),
            # a model type no runtime supports
            "mt:caffe": ("FailedToLoad", "NoSupportingRuntime", "mt:caffe: [_no_runtime]"),
        }
        for i, (model_type, (state, reason, tail)) in enumerate(cases.items()):
            vm = f"nohome-{i}"
            set_vmodel(stub, vm, f"{vm}__isvc-333333333{i}", model_info(first, model_type))
            st = poll_vmodel(stub, vm, lambda s: s.activeModelStatus.status == ST.LOADING_FAILED, vm, 30)
            assert list(st.activeModelStatus.errors) == [NO_HOME + tail], st
            assert decode_model_state(st.activeModelStatus) == (state, reason)

        # The ConfigMap changes (the onnx runtime is deleted): followed without a restart.
        write_configmap(pod.configmap, 2, {"type_constraints": type_constraints([]), "dataplane_api_config": DATAPLANE})
        st = poll_vmodel(
            stub,
            "nohome-0",
            lambda s: list(s.activeModelStatus.errors) == [NO_HOME + "mt:onnx: [_no_runtime]"],
            "reload",
        )
        assert decode_model_state(st.activeModelStatus) == ("FailedToLoad", "NoSupportingRuntime")

    # /metrics with the controller's scheme=https (a self-signed certificate: no MM_TLS_* here).
    insecure = ssl.create_default_context()
    insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
    with urllib.request.urlopen(f"https://127.0.0.1:{pod.metrics_port}/metrics", context=insecure, timeout=10) as r:
        assert b"modelmesh_api_request_milliseconds" in r.read()

    # Shutdown as Kubernetes does it: the runtime containers' preStop calls :8090/prestop (it
    # blocks until mm has stopped), and mm's own preStop runs `stop.sh wait`.
    answers: list[int] = []
    hook = threading.Thread(target=lambda: answers.append(pod.http(pod.prestop_port, "/prestop", timeout=120)))
    hook.start()
    wait_until(lambda: pod.http(pod.probe_port, "/ready") != 200, 30, "/ready to drop once the drain starts")
    path = f"{pod.meshd_bin}{os.pathsep}{os.environ.get('PATH', '')}"  # mm's own `meshd`
    stop_sh = ROOT / "deploy" / "image" / "stop.sh"
    assert shutil.which("meshd", path=path), "meshd must be on PATH for stop.sh"
    done_sh = subprocess.run(
        [str(stop_sh), "wait"],
        env={**os.environ, "PATH": path, "MM_PRESTOP_WAIT_PORT": str(pod.prestop_port)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done_sh.returncode == 0, done_sh.stderr
    # Gone when `stop.sh wait` returns (upstream's script waits for the process): the kubelet's
    # SIGTERM follows at once, and one landing before the exit would end mm as Error/143.
    assert not pod.meshd.alive(), "meshd still running when stop.sh wait returned"
    hook.join(120)
    assert answers in ([200], [0]), answers  # answered once stopped, or cut as the process exited
    assert pod.meshd.proc.returncode == 0, pod.meshd.log_tail()
    assert not port_open(pod.grpc_port)


# ---- issue 42: the storage-config secret and a Predictor's storage.key/path, unchanged ----

# modelmesh-serving's example secret (config/dependencies/minio-storage-secret.yaml, docs
# predictors/setup-storage.md): one key per storage, its value the JSON below. Only the
# endpoint differs: here an S3-protocol server (moto's) on loopback.
SECRET_ACCESS = ("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
EXAMPLE_BUCKET = "modelmesh-example-models"


@pytest.fixture
def storage_pod(
    mlserver_env: Path, tmp_path: Path, etcd_server: object, plain_meshd: Path, moto_url: str
) -> Iterator[Pod]:
    secret = tmp_path / "storage-config"  # the secret's mount: files through ..data, as the kubelet writes them
    entry = {
        "type": "s3",
        "access_key_id": SECRET_ACCESS[0],
        "secret_access_key": SECRET_ACCESS[1],
        "endpoint_url": moto_url,
        "default_bucket": EXAMPLE_BUCKET,
        "region": "us-south",
    }
    write_configmap(secret, 1, {"localMinIO": json.dumps(entry, indent=2)})
    # The runtime container's environment: the controller sets no ROOT_MODEL_DIR for the
    # adapter (its default, /models); here it is a folder of the test's.
    env = {"ROOT_MODEL_DIR": str(tmp_path / "models-dir"), "STORAGE_CONFIG_DIR": str(secret)}
    yield from start_pod(mlserver_env, tmp_path, etcd_server, plain_meshd, env)


def test_a_predictor_with_storage_key_and_path_loads_from_the_secrets_store(storage_pod: Pod, moto_url: str) -> None:
    import boto3  # a dev dependency: missing, the test fails rather than skips

    s3 = boto3.client(
        "s3",
        endpoint_url=moto_url,
        aws_access_key_id=SECRET_ACCESS[0],
        aws_secret_access_key=SECRET_ACCESS[1],
        region_name="us-south",
    )
    s3.create_bucket(Bucket=EXAMPLE_BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-south"})
    model = storage_pod.models[0]
    for f in model.path.rglob("*"):
        if f.is_file():
            s3.upload_file(str(f), EXAMPLE_BUCKET, f"sklearn/{model.name}/{f.relative_to(model.path)}")
    # What the controller writes for `storage: {key: localMinIO, path: sklearn/<name>}` and
    # `modelFormat: {name: sklearn}` (predictor_controller.go's ModelKeyInfo).
    key = {"storage_key": "localMinIO", "model_type": {"name": "sklearn"}}
    info = mm.ModelInfo(type="mt:sklearn", path=f"sklearn/{model.name}", key=json.dumps(key))
    with grpc.insecure_channel(f"127.0.0.1:{storage_pod.grpc_port}") as ch:
        stub = mm_grpc.ModelMeshStub(ch)
        set_vmodel(stub, "isvc-s3", "isvc-s3__isvc-4444444444", info)
        loaded = poll_vmodel(
            stub, "isvc-s3", lambda s: s.activeModelStatus.status in (ST.LOADED, ST.LOADING_FAILED), "isvc-s3"
        )
        assert decode_model_state(loaded.activeModelStatus) == ("Loaded", ""), loaded
        assert infer(ch, "isvc-s3", model) == model.expected
    models_dir = Path(storage_pod.env["MESHD_DATA_DIR"]).parent / "models-dir"
    assert (models_dir / "isvc-s3__isvc-4444444444" / model.name / "model.joblib").is_file()
    assert storage_pod.adapter is not None
    for child in (storage_pod.adapter, storage_pod.meshd):
        text = child.log_path.read_text(errors="replace")
        assert SECRET_ACCESS[1] not in text and SECRET_ACCESS[0] not in text


# ---- the controller's TLS: a Secret made as modelmesh-serving's docs/configuration/tls.md makes it ----

NAMESPACE = "modelmesh-serving"
TLS_MOUNT = "opt/kserve/mmesh/tls"  # controllers/modelmesh/tls.go's mount path


def tls_secret(directory: Path) -> Path:
    """The Secret's mount: tls.crt / tls.key from tls.md's openssl command (self-signed, SANs
    DNS:modelmesh-serving.<ns>, DNS:localhost, IP:0.0.0.0), and ca.crt the same certificate."""
    directory.mkdir(parents=True)
    config = directory.parent / "openssl-san.config"
    config.write_text(
        "[ req ]\ndistinguished_name = req\n[ san ]\n"
        f"subjectAltName = DNS:{SERVICE}.{NAMESPACE},DNS:localhost,IP:0.0.0.0\n"
    )
    cmd = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-sha256", "-days", "3560", "-nodes"]
    cmd += ["-keyout", str(directory / "tls.key"), "-out", str(directory / "tls.crt"), "-subj", f"/CN={NAMESPACE}"]
    subprocess.run([*cmd, "-extensions", "san", "-config", str(config)], check=True, capture_output=True, timeout=60)
    shutil.copy(directory / "tls.crt", directory / "ca.crt")
    return directory


def tls_pod_env(tmp: Path, name: str, etcd_url: str, secret: Path, runtime_port: int) -> dict[str, str]:
    """The controller's env for `mm` with TLS (tls.go: client auth as the user wrote it, the
    trust: tls.crt and the Secret's ca.crt). The demo runtime stands in for the model server."""
    connection = tmp / name / "etcd_connection"
    connection.parent.mkdir(parents=True)
    connection.write_text(json.dumps({"endpoints": etcd_url, "root_prefix": "modelmesh-serving-tls"}))
    grpc_port, probe_port, prestop_port, metrics_port, peer_port, http_port = free_ports(6)
    return {
        "MM_SERVICE_NAME": SERVICE,
        "MM_SVC_GRPC_PORT": str(grpc_port),
        "WKUBE_POD_NAME": f"{SERVICE}-{RUNTIME}-6d8f9c7b5d-{name}",
        "WKUBE_POD_IPADDR": "127.0.0.1",
        "MM_LOCATION": "127.0.0.1",
        "KV_STORE": kv_store_env(connection),
        "MM_METRICS": f"prometheus:port={metrics_port};scheme=https",
        "SHUTDOWN_TIMEOUT_MS": "90000",
        "MM_KVSTORE_PREFIX": "mm",
        "MM_DEFAULT_VMODEL_OWNER": OWNER,
        "MM_LABELS": "mt:demo",
        "INTERNAL_GRPC_PORT": str(runtime_port),
        "MM_TLS_KEY_CERT_PATH": str(secret / "tls.crt"),
        "MM_TLS_PRIVATE_KEY_PATH": str(secret / "tls.key"),
        "MM_TLS_CLIENT_AUTH": "require",
        "MM_TLS_TRUST_CERT_PATH": f"{secret / 'tls.crt'},{secret / 'ca.crt'}",
        "MM_PROBE_PORT": str(probe_port),
        "MM_PRESTOP_WAIT_PORT": str(prestop_port),
        "MESHD_PEER_PORT": str(peer_port),
        "MESHD_HTTP_PORT": str(http_port),
        "MESHD_DATA_DIR": str(tmp / name / "data"),
    }


def test_the_controllers_tls_with_the_documented_certificate_forwards_and_serves_metrics(
    tmp_path: Path, etcd_server: object, plain_meshd: Path
) -> None:
    from meshd.runtimes.models import decode_infer_response, generate_models, make_infer_request

    secret = tls_secret(tmp_path / TLS_MOUNT)
    model = generate_models(tmp_path / "models", 1)[0]
    etcd_url: str = etcd_server.url  # type: ignore[attr-defined]
    procs = Children(tmp_path / "logs")
    pods: list[tuple[Child, dict[str, str], int]] = []

    def start(name: str) -> tuple[Child, dict[str, str], int]:
        runtime_port = free_port()
        procs.python(f"runtime-{name}", "meshd.runtimes.demo", ["--port", str(runtime_port)])
        wait_until(lambda: port_open(runtime_port), 60, f"runtime {name}")
        env = tls_pod_env(tmp_path, name, etcd_url, secret, runtime_port)
        mm_ = procs.start(f"mm-{name}", [str(plain_meshd / "meshd"), "serve"], env)
        probe = int(env["MM_PROBE_PORT"])
        wait_until(lambda: pod_http(probe, "/ready") == 200 or not mm_.alive(), 120, f"pod {name} ready")
        assert mm_.alive(), mm_.log_tail()
        pods.append((mm_, env, runtime_port))
        return pods[-1]

    # An application's channel: the Secret's certificate as client certificate (the
    # rest-proxy's way), checked under a name the certificate holds.
    pem = {k: (secret / k).read_bytes() for k in ("ca.crt", "tls.crt", "tls.key")}
    app = grpc.ssl_channel_credentials(pem["ca.crt"], pem["tls.key"], pem["tls.crt"])
    name_override = [("grpc.ssl_target_name_override", "localhost")]
    rows = [[1.0, 2.0, 3.0, 4.0]]
    try:
        _, env_a, runtime_a = start("aaaaa")
        with grpc.secure_channel(f"127.0.0.1:{env_a['MM_SVC_GRPC_PORT']}", app, options=name_override) as ch:
            info = mm.ModelInfo(type="demo", path=str(model.path))
            req = mm.RegisterModelRequest(modelId=model.id, modelInfo=info, loadNow=True, sync=True)
            mm_grpc.ModelMeshStub(ch).registerModel(req, timeout=60)
            direct = v2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(
                make_infer_request(model.id, rows), metadata=(("mm-model-id", model.id),), timeout=30
            )
        mm_b, env_b, runtime_b = start("bbbbb")
        # Through b, whose runtime has no copy: b forwards to a over the internal mTLS link,
        # checking a's certificate under a name it holds (the pod IP is not in it).
        with grpc.secure_channel(f"127.0.0.1:{env_b['MM_SVC_GRPC_PORT']}", app, options=name_override) as ch:
            via_b = v2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(
                make_infer_request(model.id, rows), metadata=(("mm-model-id", model.id),), timeout=30
            )
        assert decode_infer_response(via_b) == decode_infer_response(direct)
        assert runtime_models(runtime_b) == [] and runtime_models(runtime_a) == [model.id]
        assert f"'{SERVICE}.{NAMESPACE}'" in mm_b.log_path.read_text(errors="replace")

        # /metrics as Prometheus scrapes the pod's annotations: https, no client certificate,
        # even with MM_TLS_CLIENT_AUTH=require on the API.
        scrape = ssl.create_default_context(cafile=str(secret / "ca.crt"))
        scrape.check_hostname = False  # the pod IP is not in the certificate
        for _, env, _ in pods:
            url = f"https://127.0.0.1:{env['MM_METRICS'].split('port=')[1].split(';')[0]}/metrics"
            with urllib.request.urlopen(url, context=scrape, timeout=10) as r:
                assert r.status == 200 and b"modelmesh_" in r.read()
    finally:
        procs.stop_all()


def pod_http(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def runtime_models(port: int) -> list[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        index = v2_grpc.GRPCInferenceServiceStub(ch).RepositoryIndex(v2.RepositoryIndexRequest(), timeout=10)
    return sorted(m.name for m in index.models)
