"""The bad-input matrix (issue 8): every row against one real mesh (etcd + `meshd serve` +
reference runtime with idInjectionPath [1]) gets its exact status and a message naming the
problem; after every row the records stored at module start are unchanged and still served.

Rows already covered elsewhere are not repeated here (docs/reliability.md "Bad input" lists them all):
tests/integration/test_single_instance.py (empty model id, empty type, 5 000-byte id on
registerModel, unknown model, non-UTF-8 `-bin` header, no id at all, both headers, two
different mm-model-id values, malformed body, runtime SPI and unknown methods, a corrupt
model record), tests/integration/test_dataplane.py (body that cannot be spliced, id
extraction from truncated or non-UTF-8 bodies) and tests/integration/test_ops_cli.py.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from meshd._proto.inference import grpc_predict_v2_pb2 as v2
from meshd._proto.meshd import admin_pb2 as admin
from meshd._proto.meshd import admin_pb2_grpc as admin_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.core.records import InstanceRecord, RecordError
from meshd.kv.embedded import EmbeddedEtcd
from meshd.kv.etcd import EtcdStore
from meshd.kv.store import Delete
from meshd.runtimes.models import (
    DemoModel,
    GeneratedModel,
    decode_infer_response,
    generate_models,
    make_infer_request,
)
from meshd.testing.cluster import LocalMesh, Node
from meshd.testing.procs import wait_until

from ..conftest import DATA_PLANES, data_plane_settings

pytestmark = pytest.mark.slow

T = TypeVar("T")
ROWS = [[0.5, -1.0, 2.0, 0.25]]
MODEL_SIZE = 1 << 20
MAX_MSG = 16 << 20  # MM_SVC_GRPC_MAX_MSG_SIZE default
INFER = "/inference.GRPCInferenceService/ModelInfer"
SVC = "/mmesh.ModelMesh/"
CODE = grpc.StatusCode
WAIT_S = 15.0  # bound for a watch to deliver a write; not a timing assertion


@dataclass
class Mesh:
    node: Node
    channel: grpc.Channel
    models: list[GeneratedModel]  # m0, m1 registered and loaded, m2 spare
    service: str
    etcd_url: str
    data_plane: str = "python"

    @property
    def mm(self) -> Any:
        return _Timed(mm_grpc.ModelMeshStub(self.channel))

    @property
    def admin(self) -> Any:
        return _Timed(admin_grpc.MeshAdminStub(self.channel))

    def raw(self, method: str) -> Any:
        return self.channel.unary_unary(method)

    def infer(self, metadata: tuple[tuple[str, str | bytes], ...], body: bytes | None = None) -> list[list[float]]:
        body = body if body is not None else make_infer_request("", ROWS).SerializeToString()
        resp = self.raw(INFER)(body, metadata=metadata, timeout=30)
        return decode_infer_response(_infer_response(resp))

    def key(self, kind: str, item_id: str) -> str:
        return f"/tas-runtime/{self.service}/{kind}/{item_id}"

    def store(self, fn: Callable[[EtcdStore], Awaitable[T]]) -> T:
        async def run() -> T:
            store = EtcdStore.from_url(self.etcd_url)
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(run())

    def get(self, key: str) -> bytes | None:
        kv = self.store(lambda s: s.get(key))
        return kv.value if kv is not None else None

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.store(lambda s: s.put(key, value, lease))

    def delete(self, key: str) -> None:
        self.store(lambda s: s.txn([], [Delete(key)]))

    def lease_of(self, key: str) -> int:
        kv = self.store(lambda s: s.get(key))
        assert kv is not None, key
        return kv.lease

    def log(self) -> str:
        return self.node.meshd.log_path.read_text(errors="replace")


class _Timed:
    """A stub whose calls have a deadline unless one is given: a row never hangs the module."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)
        return lambda request, **kw: method(request, **{"timeout": 30, **kw})


def _infer_response(raw: bytes) -> Any:
    return v2.ModelInferResponse.FromString(raw)


def _expected(model: GeneratedModel) -> list[list[float]]:
    return DemoModel.load(model.path).predict(ROWS)


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return len(a) == len(b) and all(
        abs(p - q) < 1e-4 for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True)
    )


@pytest.fixture(scope="module", params=DATA_PLANES)
def mesh(
    etcd_server: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Mesh]:
    """One instance for the whole module (once per data plane), with two loaded models and a
    vmodel on m0."""
    tmp: Path = tmp_path_factory.mktemp("badinput")
    settings = data_plane_settings(request.param, request)
    local = LocalMesh(tmp, service=f"bad-{uuid.uuid4().hex[:8]}", settings=settings)
    local.etcd_url = etcd_server.url
    channel: grpc.Channel | None = None
    try:
        node = local.add_node("bad-a", runtime_args=["--capacity-bytes", str(8 * MODEL_SIZE), "--inject-id"])
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        channel = grpc.insecure_channel(node.target, options=opts)
        models = generate_models(tmp / "models", 3, size_bytes=MODEL_SIZE)
        m = Mesh(node, channel, models, local.service, etcd_server.url, request.param)
        for model in models[:2]:
            info = mm.ModelInfo(type="demo", path=str(model.path))
            req = mm.RegisterModelRequest(modelId=model.id, modelInfo=info, loadNow=True, sync=True)
            assert m.mm.registerModel(req, timeout=60).status == mm.ModelStatusInfo.LOADED
        vm = mm.SetVModelRequest(vModelId="v0", targetModelId=models[0].id, sync=True)
        assert m.mm.setVModel(vm, timeout=60).status == mm.VModelStatusInfo.DEFINED
        yield m
    finally:
        if channel is not None:
            channel.close()
        local.stop()


def stored(m: Mesh) -> dict[str, Any]:
    """What must never change: the models' info and references, and the vmodel."""
    out: dict[str, Any] = {}
    for model in m.models[:2]:
        raw = m.get(m.key("registry", model.id))
        assert raw is not None, f"record of {model.id} lost"
        rec = json.loads(raw)
        out[model.id] = {k: rec.get(k) for k in ("type", "mPath", "encKey", "refs", "autoDel")}
    out["v0"] = json.loads(m.get(m.key("vmodels", "v0")) or b"null")
    return out


@pytest.fixture
def intact(mesh: Mesh) -> Iterator[Mesh]:
    """Checks after the row: stored records unchanged, models served directly and by vmodel."""
    before = stored(mesh)
    yield mesh
    assert stored(mesh) == before
    m0, m1 = mesh.models[0], mesh.models[1]
    assert _close(mesh.infer((("mm-model-id", m0.id),)), _expected(m0))
    assert _close(mesh.infer((("mm-model-id", m1.id),)), _expected(m1))
    assert _close(mesh.infer((("mm-vmodel-id", "v0"),)), _expected(m0))
    assert mesh.node.meshd.alive()


def refused(code: grpc.StatusCode, phrase: str, call: Callable[[], object]) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    details = e.value.details() or ""
    assert e.value.code() == code, details
    assert phrase.lower() in details.lower(), details


# ---- request rows: (name, call, status, phrase the message must contain) --------------------

Call = Callable[[Mesh], object]


def _info(m: Mesh, **kw: Any) -> Any:
    return mm.ModelInfo(type=kw.pop("type", "demo"), path=kw.pop("path", str(m.models[2].path)), **kw)


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (payload < 128 bytes)."""
    assert len(payload) < 0x80
    return bytes((field << 3 | 2, len(payload))) + payload


BIG = "x" * (MAX_MSG + 1024)
KB10 = "k" * 10_000
MB1 = "M" * (1 << 20)
NOT_UTF8 = b"\xff\xfe\x80"

MESH_METHODS = {
    "registerModel": "RegisterModelRequest",
    "unregisterModel": "UnregisterModelRequest",
    "getModelStatus": "GetStatusRequest",
    "ensureLoaded": "EnsureLoadedRequest",
    "setVModel": "SetVModelRequest",
    "deleteVModel": "DeleteVModelRequest",
    "getVModelStatus": "GetVModelStatusRequest",
}


def _rows() -> list[tuple[str, Call, grpc.StatusCode, str]]:
    rows: list[tuple[str, Call, grpc.StatusCode, str]] = [
        # -- oversized (over MM_SVC_GRPC_MAX_MSG_SIZE, 16 MiB by default): grpc refuses it
        (
            "oversized-infer",
            lambda m: m.infer(
                (("mm-model-id", m.models[0].id),),
                make_infer_request(m.models[0].id, ROWS).SerializeToString() + _big_field(),
            ),
            CODE.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
        (
            "oversized-registerModel",
            lambda m: m.mm.registerModel(mm.RegisterModelRequest(modelId="big", modelInfo=_info(m, key=BIG))),
            CODE.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
        (
            "oversized-setVModel",
            lambda m: m.mm.setVModel(
                mm.SetVModelRequest(vModelId="v0", targetModelId="big", modelInfo=_info(m, path=BIG))
            ),
            CODE.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
        # under grpc's limit, over meshd's ModelInfo limit (1 MiB: records stay small in etcd)
        (
            "modelInfo-2MiB",
            lambda m: m.mm.registerModel(
                mm.RegisterModelRequest(modelId="big", modelInfo=_info(m, key="k" * (2 << 20)))
            ),
            CODE.INVALID_ARGUMENT,
            "modelInfo is",
        ),
        # -- malformed protobuf
        (
            "malformed-admin-listModels",
            lambda m: m.raw("/meshd.admin.MeshAdmin/listModels")(b"\xff", timeout=10),
            CODE.INVALID_ARGUMENT,
            "meshd.admin.ListModelsRequest",
        ),
        (
            "malformed-infer-truncated-tensor",  # field 5 (inputs) claims 16 bytes, has 1
            lambda m: m.infer((("mm-model-id", m.models[0].id),), _ld(1, b"x") + b"\x2a\x10\x0a"),
            CODE.INVALID_ARGUMENT,
            "not valid protobuf",
        ),
        (
            "malformed-infer-bad-wire-type",  # field 1 sent as a varint where a string must be
            lambda m: m.infer((("mm-model-id", m.models[0].id),), b"\x08\x01"),
            CODE.INVALID_ARGUMENT,
            "not length-delimited",
        ),
        # -- headers
        ("header-empty", lambda m: m.infer((("mm-model-id", ""),)), CODE.INVALID_ARGUMENT, "must not be empty"),
        (
            "header-unknown-vmodel",
            lambda m: m.infer((("mm-vmodel-id", "no-such-vmodel"),)),
            CODE.NOT_FOUND,
            "no-such-vmodel",
        ),
        (
            "header-two-vmodel-ids",
            lambda m: m.infer((("mm-vmodel-id", "v0"), ("mm-vmodel-id", "v1"))),
            CODE.INVALID_ARGUMENT,
            "several different vmodel ids",
        ),
        (
            "header-plain-and-bin-differ",
            lambda m: m.infer((("mm-model-id", m.models[0].id), ("mm-model-id-bin", m.models[1].id.encode()))),
            CODE.INVALID_ARGUMENT,
            "several different model ids",
        ),
        (
            "header-model-and-vmodel-bin",
            lambda m: m.infer((("mm-model-id", m.models[0].id), ("mm-vmodel-id-bin", b"v0"))),
            CODE.INVALID_ARGUMENT,
            "both a model and a vmodel",
        ),
        (
            "header-bin-control-char",
            lambda m: m.infer((("mm-model-id-bin", b"a\x00b"),)),
            CODE.INVALID_ARGUMENT,
            "control characters",
        ),
        (
            "header-vmodel-bin-not-utf8",
            lambda m: m.infer((("mm-vmodel-id-bin", NOT_UTF8),)),
            CODE.INVALID_ARGUMENT,
            "not valid utf-8",
        ),
        # -- very long ids: meshd's id limit (1 KiB), then MM_SVC_GRPC_MAX_HEADERS_SIZE (8 KiB; exact,
        # so an id between 8 and 16 KiB is refused every time, not at random as grpc's default)
        (
            "header-id-2000-bytes",
            lambda m: m.infer((("mm-model-id", "h" * 2000),)),
            CODE.INVALID_ARGUMENT,
            "limit is 1024",
        ),
        ("header-id-7kB", lambda m: m.infer((("mm-model-id", "s" * 7000),)), CODE.INVALID_ARGUMENT, "limit is 1024"),
        ("header-id-10kB", lambda m: m.infer((("mm-model-id", KB10),)), CODE.RESOURCE_EXHAUSTED, "metadata"),
        ("header-id-12kB", lambda m: m.infer((("mm-model-id", "t" * 12_000),)), CODE.RESOURCE_EXHAUSTED, "metadata"),
        ("header-id-20kB", lambda m: m.infer((("mm-model-id", "k" * 20_000),)), CODE.RESOURCE_EXHAUSTED, "metadata"),
        ("header-id-1MB", lambda m: m.infer((("mm-model-id-bin", MB1.encode()),)), CODE.RESOURCE_EXHAUSTED, "metadata"),
        (
            "setVModel-vmodel-id-1MB",
            lambda m: m.mm.setVModel(mm.SetVModelRequest(vModelId=MB1, targetModelId=m.models[0].id)),
            CODE.INVALID_ARGUMENT,
            "vmodel id is 1048576 bytes long",
        ),
        (
            "setVModel-target-10kB",
            lambda m: m.mm.setVModel(mm.SetVModelRequest(vModelId="v0", targetModelId=KB10)),
            CODE.INVALID_ARGUMENT,
            "target model id is 10000 bytes long",
        ),
        (
            "getModelStatus-id-1MB",
            lambda m: m.mm.getModelStatus(mm.GetStatusRequest(modelId=MB1)),
            CODE.INVALID_ARGUMENT,
            "limit is 1024",
        ),
        (
            "registerModel-id-1MB",
            lambda m: m.mm.registerModel(mm.RegisterModelRequest(modelId=MB1, modelInfo=_info(m))),
            CODE.INVALID_ARGUMENT,
            "limit is 1024",
        ),
        (
            "ensureLoaded-id-10kB",
            lambda m: m.mm.ensureLoaded(mm.EnsureLoadedRequest(modelId=KB10)),
            CODE.INVALID_ARGUMENT,
            "limit is 1024",
        ),
        (
            "getModelStatus-control-char",
            lambda m: m.mm.getModelStatus(mm.GetStatusRequest(modelId="a\x01b")),
            CODE.INVALID_ARGUMENT,
            "control characters",
        ),
        # -- wrong ModelInfo
        (
            "registerModel-no-modelInfo",
            lambda m: m.mm.registerModel(mm.RegisterModelRequest(modelId="no-info")),
            CODE.INVALID_ARGUMENT,
            "modelInfo.type must not be empty",
        ),
        (
            "setVModel-modelInfo-without-type",
            lambda m: m.mm.setVModel(
                mm.SetVModelRequest(vModelId="v-new", targetModelId="new", modelInfo=_info(m, type=""))
            ),
            CODE.INVALID_ARGUMENT,
            "modelInfo.type must not be empty",
        ),
        (
            "registerModel-same-id-other-info",
            lambda m: m.mm.registerModel(
                mm.RegisterModelRequest(modelId=m.models[0].id, modelInfo=_info(m, path="/elsewhere"))
            ),
            CODE.ALREADY_EXISTS,
            "different model info",
        ),
        (
            "key-unknown-meshd-field",
            lambda m: m.mm.registerModel(
                mm.RegisterModelRequest(modelId="k1", modelInfo=_info(m, key='{"meshd": {"copies": 2}}'))
            ),
            CODE.INVALID_ARGUMENT,
            "unknown field(s)",
        ),
        (
            "key-negative-size",
            lambda m: m.mm.registerModel(
                mm.RegisterModelRequest(modelId="k2", modelInfo=_info(m, key='{"meshd": {"size_bytes": -1}}'))
            ),
            CODE.INVALID_ARGUMENT,
            "size_bytes must be > 0",
        ),
        (
            "key-min-above-max",
            lambda m: m.mm.registerModel(
                mm.RegisterModelRequest(
                    modelId="k3", modelInfo=_info(m, key='{"meshd": {"min_copies": 3, "max_copies": 1}}')
                )
            ),
            CODE.INVALID_ARGUMENT,
            "exceeds max_copies",
        ),
        (
            "key-size-not-a-number",
            lambda m: m.mm.registerModel(
                mm.RegisterModelRequest(modelId="k4", modelInfo=_info(m, key='{"meshd": {"size_bytes": "1GB"}}'))
            ),
            CODE.INVALID_ARGUMENT,
            "whole number",
        ),
    ]
    # Malformed bytes and non-UTF-8 strings (protobuf itself refuses them: sent raw) on every
    # management method, naming the message type.
    for method, message in MESH_METHODS.items():
        for what, body in (("truncated", b"\x0a\x05ab"), ("id-not-utf8", _ld(1, NOT_UTF8))):
            rows.append(
                (
                    f"{what}-{method}",
                    lambda m, method=method, body=body: m.raw(SVC + method)(body, timeout=10),
                    CODE.INVALID_ARGUMENT,
                    f"mmesh.{message}",
                )
            )
    target_not_utf8 = _ld(1, b"v-new") + _ld(2, NOT_UTF8)
    rows.append(
        (
            "target-not-utf8-setVModel",
            lambda m: m.raw(SVC + "setVModel")(target_not_utf8, timeout=10),
            CODE.INVALID_ARGUMENT,
            "mmesh.SetVModelRequest",
        )
    )
    return rows


def _big_field() -> bytes:
    """Field 15 (unknown to ModelInferRequest), length-delimited, just over the limit."""
    n = MAX_MSG + 1024
    length = bytearray()
    while n >= 0x80:
        length.append((n & 0x7F) | 0x80)
        n >>= 7
    length.append(n)
    return b"\x7a" + bytes(length) + b"\0" * (MAX_MSG + 1024)


ROW_LIST = _rows()


# Headers far beyond HAProxy's buffer (64 KiB) end the connection there, before any rule or
# meshd sees them: the client gets UNAVAILABLE, not meshd's RESOURCE_EXHAUSTED (docs/native.md).
NATIVE_CONNECTION_REFUSALS = {"header-id-1MB": (CODE.UNAVAILABLE, "")}


@pytest.mark.parametrize(("call", "code", "phrase"), [r[1:] for r in ROW_LIST], ids=[r[0] for r in ROW_LIST])
def test_request_row(
    intact: Mesh, call: Call, code: grpc.StatusCode, phrase: str, request: pytest.FixtureRequest
) -> None:
    row = request.node.callspec.id.split("-", 1)[-1] if intact.data_plane == "native" else ""
    code, phrase = NATIVE_CONNECTION_REFUSALS.get(row, (code, phrase))
    refused(code, phrase, lambda: call(intact))


# ---- rows whose answer is not an error -------------------------------------------------------


def test_duplicated_identical_header_is_one_id(intact: Mesh) -> None:
    """Defined behaviour: the same id twice (or in both the plain and -bin header) names it once."""
    m0 = intact.models[0]
    assert _close(intact.infer((("mm-model-id", m0.id), ("mm-model-id", m0.id))), _expected(m0))
    assert _close(intact.infer((("mm-model-id", m0.id), ("mm-model-id-bin", m0.id.encode()))), _expected(m0))


def test_absurd_path_is_registered_and_its_load_failure_reported(intact: Mesh) -> None:
    model_id = "absurd-path"
    info = mm.ModelInfo(type="demo", path="/nonexistent/\u2603/" + "deep/" * 200)
    try:
        st = intact.mm.registerModel(
            mm.RegisterModelRequest(modelId=model_id, modelInfo=info, loadNow=True, sync=True), timeout=60
        )
        assert st.status == mm.ModelStatusInfo.LOADING_FAILED
        assert any("nonexistent" in e for e in st.errors), st.errors
    finally:
        intact.mm.unregisterModel(mm.UnregisterModelRequest(modelId=model_id), timeout=30)


def test_unknown_and_unusable_key_fields_are_ignored(intact: Mesh) -> None:
    """Keys are opaque beyond meshd's own object: an unusable `disk_size_bytes` and unknown
    fields load as usual."""
    model_id = "odd-key"
    key = json.dumps({"disk_size_bytes": -5, "storage": {"bucket": None}, "meshd": {}})
    info = mm.ModelInfo(type="demo", path=str(intact.models[2].path), key=key)
    try:
        st = intact.mm.registerModel(
            mm.RegisterModelRequest(modelId=model_id, modelInfo=info, loadNow=True, sync=True), timeout=60
        )
        assert st.status == mm.ModelStatusInfo.LOADED
    finally:
        intact.mm.unregisterModel(mm.UnregisterModelRequest(modelId=model_id), timeout=30)


def test_size_larger_than_any_cache_is_refused_clearly(intact: Mesh) -> None:
    """A declared size no instance can hold: registered, the load refused with the sizes, and
    the inventory still answers (no size overflow anywhere)."""
    model_id = "too-big"
    info = mm.ModelInfo(type="demo", path=str(intact.models[2].path), key='{"meshd": {"size_bytes": 1e30}}')
    refused(
        CODE.INVALID_ARGUMENT,
        "whole number",
        lambda: intact.mm.registerModel(mm.RegisterModelRequest(modelId=model_id, modelInfo=info), timeout=30),
    )
    info.key = json.dumps({"meshd": {"size_bytes": 10**30}})
    try:
        # Placed through the cluster (issue 14): no instance can take it, said as such.
        refused(
            CODE.UNAVAILABLE,
            "could not be loaded anywhere",
            lambda: intact.mm.registerModel(
                mm.RegisterModelRequest(modelId=model_id, modelInfo=info, loadNow=True, sync=True), timeout=30
            ),
        )
        listed = intact.admin.listModels(admin.ListModelsRequest(), timeout=30)
        assert model_id in [s.modelId for s in listed.models]
    finally:
        intact.mm.unregisterModel(mm.UnregisterModelRequest(modelId=model_id), timeout=30)


# ---- corrupt values in etcd --------------------------------------------------------------------

CORRUPT_VALUES = {
    "garbage": b"garbage \x00 here",
    "wrong-shape": b'["type", "demo"]',
    "wrong-field-type": b'{"type": 5, "amid": 7, "cap": "big"}',
    "truncated": b'{"type": "demo", "mPath": "/x", "instanceIds": {"bad-',
    "not-utf8": b'{"type": "\xff\xfe"}',
}


def _logged(m: Mesh, key: str, since: int) -> bool:
    return f"corrupt record at {key}" in m.log()[since:]


@pytest.mark.parametrize("value", list(CORRUPT_VALUES.values()), ids=list(CORRUPT_VALUES))
def test_corrupt_model_record(intact: Mesh, value: bytes) -> None:
    m = intact
    m1 = m.models[1]
    key = m.key("registry", m1.id)
    good = m.get(key)
    assert good is not None
    since = len(m.log())
    m.put(key, value)
    try:

        def reported() -> bool:
            try:
                m.mm.getModelStatus(mm.GetStatusRequest(modelId=m1.id), timeout=10)
            except grpc.RpcError as e:
                assert e.code() == CODE.DATA_LOSS and m1.id in (e.details() or ""), e.details()
                return True
            return False

        wait_until(reported, WAIT_S, "the corrupt model record to be reported")
        wait_until(lambda: _logged(m, key, since), WAIT_S, "a log line naming the corrupt key")
        refused(
            CODE.DATA_LOSS,
            "corrupt",
            lambda: m.mm.registerModel(
                mm.RegisterModelRequest(modelId=m1.id, modelInfo=mm.ModelInfo(type="demo", path=str(m1.path))),
                timeout=10,
            ),
        )
        # The copy it already loaded keeps serving; the value is left as it was written.
        assert _close(m.infer((("mm-model-id", m1.id),)), _expected(m1))
        listed = {s.modelId: list(s.errors) for s in m.admin.listModels(admin.ListModelsRequest(), timeout=30).models}
        assert any("corrupt record" in e for e in listed[m1.id]), listed
        assert m.get(key) == value
    finally:
        m.put(key, good)
    wait_until(
        lambda: (
            _read_again(lambda: m.mm.getModelStatus(mm.GetStatusRequest(modelId=m1.id), timeout=10).status)
            == mm.ModelStatusInfo.LOADED
        ),
        WAIT_S,
        "the repaired record to be read again",
    )


@pytest.mark.parametrize("value", list(CORRUPT_VALUES.values()), ids=list(CORRUPT_VALUES))
def test_corrupt_vmodel_record(intact: Mesh, value: bytes) -> None:
    m = intact
    key = m.key("vmodels", "v0")
    good = m.get(key)
    assert good is not None
    since = len(m.log())
    m.put(key, value)
    try:

        def reported() -> bool:
            try:
                m.mm.getVModelStatus(mm.GetVModelStatusRequest(vModelId="v0"), timeout=10)
            except grpc.RpcError as e:
                assert e.code() == CODE.DATA_LOSS and "v0" in (e.details() or ""), e.details()
                return True
            return False

        wait_until(reported, WAIT_S, "the corrupt vmodel record to be reported")
        wait_until(lambda: _logged(m, key, since), WAIT_S, "a log line naming the corrupt key")
        refused(CODE.DATA_LOSS, "corrupt", lambda: m.infer((("mm-vmodel-id", "v0"),)))
        for call in (
            lambda: m.mm.setVModel(mm.SetVModelRequest(vModelId="v0", targetModelId=m.models[1].id), timeout=10),
            lambda: m.mm.deleteVModel(mm.DeleteVModelRequest(vModelId="v0"), timeout=10),
        ):
            refused(CODE.DATA_LOSS, "left untouched", call)
        # The model it names is served directly meanwhile; the value is left as written.
        assert _close(m.infer((("mm-model-id", m.models[0].id),)), _expected(m.models[0]))
        assert m.get(key) == value
    finally:
        m.put(key, good)
    wait_until(
        lambda: (
            _read_again(lambda: m.mm.getVModelStatus(mm.GetVModelStatusRequest(vModelId="v0"), timeout=10).status)
            == mm.VModelStatusInfo.DEFINED
        ),
        WAIT_S,
        "the repaired vmodel to be read again",
    )


def _read_again(read: Callable[[], int]) -> int | None:
    """A repaired record's status, or None while the mirror still holds the corrupt value (on a
    loaded host the repair's watch event can come after the first read): DATA_LOSS means "not
    yet", any other error fails the test."""
    try:
        return read()
    except grpc.RpcError as e:
        assert e.code() == CODE.DATA_LOSS, e.details()
        return None


def _listed_instances(m: Mesh) -> list[str]:
    return [i.instanceId for i in m.admin.listInstances(admin.ListInstancesRequest(), timeout=10).instances]


@pytest.mark.parametrize("value", list(CORRUPT_VALUES.values()), ids=list(CORRUPT_VALUES))
def test_corrupt_record_of_another_instance_is_ignored(intact: Mesh, value: bytes) -> None:
    m = intact
    key = m.key("instances", "ghost")
    since = len(m.log())
    m.put(key, value)
    try:
        wait_until(lambda: _logged(m, key, since), WAIT_S, "a log line naming the corrupt key")
        assert _listed_instances(m) == ["bad-a"]
    finally:
        m.delete(key)


@pytest.mark.parametrize("value", [*CORRUPT_VALUES.values(), None], ids=[*CORRUPT_VALUES, "deleted"])
def test_own_instance_record_overwritten_is_written_back(intact: Mesh, value: bytes | None) -> None:
    """The instance's own record, corrupted or deleted behind its back, is published again
    (peers would otherwise stop seeing it until its next load)."""
    m = intact
    key = m.key("instances", "bad-a")
    lease = m.lease_of(key)
    if value is None:
        m.delete(key)
    else:
        m.put(key, value, lease)

    def restored() -> bool:
        raw = m.get(key)
        if raw is None:
            return False
        try:
            InstanceRecord.decode(raw)
        except RecordError:
            return False
        return _listed_instances(m) == ["bad-a"]

    wait_until(restored, WAIT_S, "the instance record to be written back")
    assert m.lease_of(key) == lease
