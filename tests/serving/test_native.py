"""The native data plane's pure parts (routes, HAProxy's configuration and table dumps), and
every configuration it renders checked by a real HAProxy (`haproxy -c`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from meshd.core.records import NATIVE_ADDRESS, InstanceRecord, ModelRecord
from meshd.decisions.placement.view import ClusterView, InstanceView
from meshd.serving.native.haproxy_config import (
    ID_IN_FIELD_1,
    PLAIN,
    Counters,
    Layout,
    TlsFiles,
    haproxy_address,
    haproxy_listen,
    map_key_ok,
    parse_table,
    render,
    trailers_reset_bug,
)
from meshd.serving.native.plane import split_address
from meshd.serving.native.routes import (
    LocalCopy,
    assign_slots,
    carried_since,
    local_routes,
    map_changes,
    native_peers,
    peer_routes,
    runtime_api_commands,
)
from meshd.serving.native.setup import carried_methods
from meshd.serving.proxy.methods import DataplaneConfig, MethodTable
from meshd.testing.certs import TestCA

INFER = "/inference.GRPCInferenceService/ModelInfer"
META = "/inference.GRPCInferenceService/ModelMetadata"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def test_map_keys_are_only_what_haproxy_takes_verbatim() -> None:
    assert map_key_ok("model-0001") and map_key_ok("a/b:c@1.2_x")
    for bad in ("", "has space", "semi;colon", "back\\slash", "#comment", "tab\t", "é", "x" * 251):
        assert not map_key_ok(bad), bad


def test_runtime_endpoints_become_haproxy_addresses() -> None:
    assert haproxy_address("127.0.0.1:8085") == "127.0.0.1:8085"
    assert haproxy_address("unix:/run/rt.sock") == "unix@/run/rt.sock"
    assert haproxy_address("unix:///run/rt.sock") == "unix@/run/rt.sock"
    assert haproxy_address("[::1]:8085") == "ipv6@::1:8085"  # HAProxy: the last colon starts the port
    assert haproxy_address("localhost:8085") == "localhost:8085"


def test_the_external_port_listens_on_both_families_where_the_host_has_ipv6() -> None:
    assert haproxy_listen(8033, dual_stack=True) == ":::8033 v4v6"
    assert haproxy_listen(8033, dual_stack=False) == "0.0.0.0:8033"


def test_local_routes_are_loaded_unlimited_copies_of_an_answering_runtime() -> None:
    copies = [
        LocalCopy("served", True, False),
        LocalCopy("loading", False, False),
        LocalCopy("limited", True, True),
        LocalCopy("bad id", True, False),
    ]
    assert local_routes(copies, runtime_up=True) == {"served"}
    assert local_routes(copies, runtime_up=False) == set()


def test_native_peers_are_live_reachable_dialable_others() -> None:
    instances = {
        "me": InstanceView("me", native="10.0.0.1:8033"),
        "b": InstanceView("b", native="10.0.0.2:8033"),
        "c": InstanceView("c", native=""),  # Python data plane
        "d": InstanceView("d", native="10.0.0.4:8033", shutdown=True),
        "e": InstanceView("e", native="10.0.0.5:8033"),  # found unreachable
        "f": InstanceView("f", native="peer-f:8033"),  # not an IP literal
    }
    view = ClusterView("me", 0, instances, unreachable=frozenset({"e"}))
    assert native_peers(view, lambda a: split_address(a) is not None) == {"b": "10.0.0.2:8033"}


def test_counters_read_twice_give_what_was_carried_between() -> None:
    assert carried_since({"a": 5, "b": 7}, {"a": 9, "b": 7, "c": 2}) == {"a": 4, "c": 2}
    assert carried_since({"a": 5}, {"a": 1}) == {}  # HAProxy restarted: its table starts again


def test_peer_slots_are_stable_and_bounded() -> None:
    slots = assign_slots({}, {"b": "10.0.0.2:8033", "c": "10.0.0.3:8033"}, 2)
    assert slots == {"0": "b", "1": "c"}
    # b leaves, d arrives: c keeps its slot, d takes the free one
    assert assign_slots(slots, {"c": "x", "d": "y"}, 2) == {"0": "d", "1": "c"}
    # beyond the slots, the rest have none
    assert assign_slots({}, {"a": "1", "b": "2", "c": "3"}, 2) == {"0": "a", "1": "b"}


def _view(now: int, **natives: str) -> ClusterView:
    instances = {"me": InstanceView("me", capacity=100)}
    for iid, native in natives.items():
        instances[iid] = InstanceView(iid, capacity=100, native=native)
    return ClusterView("me", now, instances)


def test_peer_routes_go_to_the_copy_python_would_pick_on_a_native_peer() -> None:
    now = 1_000_000
    view = _view(now, b="10.0.0.2:8033", c="")
    records = {
        "on-b": ModelRecord("demo", instance_ids={"b": now - 60_000}),
        "on-c": ModelRecord("demo", instance_ids={"c": now - 60_000}),  # c has no native port
        "gone": ModelRecord("demo", instance_ids={"x": now - 60_000}),  # x is not live
        "here": ModelRecord("demo", instance_ids={"me": now - 60_000, "b": now - 60_000}),
    }
    natives = {"b": "10.0.0.2:8033"}
    wanted = ["on-b", "on-c", "gone", "here", "unregistered"]
    routes = peer_routes(wanted, records, view, natives, {"b": "3"}, lambda _type: 10_000, local={"here"})
    assert routes == {"on-b": "be_peer_3"}


def test_instance_records_carry_the_native_address_to_the_view() -> None:
    record = InstanceRecord(capacity=10, location="10.0.0.2:8080", extra={NATIVE_ADDRESS: "10.0.0.2:8033"})
    assert InstanceView.from_record("b", record).native == "10.0.0.2:8033"
    assert InstanceView.from_record("b", InstanceRecord(capacity=10, extra={NATIVE_ADDRESS: 5})).native == ""


def test_map_changes_send_only_the_differences() -> None:
    current = {"a": "1", "b": "be_peer_0", "c": "1"}
    desired = {"a": "1", "b": "be_peer_1", "d": "1"}
    changes = map_changes(current, desired)
    assert changes.put == {"b": "be_peer_1", "d": "1"} and changes.delete == ["c"]
    assert runtime_api_commands("/m.map", current, changes) == [
        "del map /m.map c",
        "set map /m.map b be_peer_1",
        "add map /m.map d 1",
    ]
    assert not map_changes(desired, desired)


def test_counters_table_dump_is_read_per_model() -> None:
    dump = (
        "# table: st_local, type: string, size:1048576, used:2\n"
        "0x7f31e00b97e8: key=model-0001 use=5 exp=86399900 conn_cur=5 http_req_cnt=6\n"
        "0x7f31e00b9800: key=m2 use=0 exp=86399997 conn_cur=0 http_req_cnt=12345\n"
    )
    assert parse_table(dump) == {"model-0001": Counters(6, 5), "m2": Counters(12345, 0)}
    assert parse_table("") == {}


def test_peer_addresses_must_be_ip_literals() -> None:
    assert split_address("10.0.0.2:8033") == ("10.0.0.2", 8033)
    assert split_address("[::1]:8033") == ("::1", 8033)
    assert split_address("fd00::7:8033") == ("fd00::7", 8033)  # unbracketed, as an older record holds it
    assert split_address("peer.example:8033") is None  # HAProxy would need DNS resolvers
    assert split_address("10.0.0.2:0") is None and split_address("10.0.0.2") is None


def test_carried_methods_are_unary_with_the_id_in_headers_or_field_1() -> None:
    table = MethodTable({"inference.GRPCInferenceService/ModelInfer": (1,), "tf.Predict/Predict": (1, 1)}, True)
    carried = carried_methods(table, ["tf.Predict/Predict"], {"/inference.GRPCInferenceService/ModelReady"})
    assert carried == {INFER: ID_IN_FIELD_1, META: PLAIN}  # streams and deeper paths stay on Python
    config = {"rpcConfigs": {INFER.lstrip("/"): {"idExtractionPath": [1]}}, "allowOtherRpcs": True}
    extracting = MethodTable({}, True, DataplaneConfig.parse(json.dumps(config)))
    assert INFER not in carried_methods(extracting, [], set())


def _layout(tmp: Path, **kw: object) -> Layout:
    args: dict[str, object] = {
        "listen": "127.0.0.1:18033",  # -c parses, binds nothing
        "python": f"unix@{tmp / 'py.sock'}",
        "runtime": "127.0.0.1:1",
        "api_socket": str(tmp / "api.sock"),
        "methods_map": str(tmp / "m.map"),
        "local_map": str(tmp / "l.map"),
        "peers_map": str(tmp / "p.map"),
        "vmodels_map": str(tmp / "v.map"),
        **kw,
    }
    for name in ("methods_map", "local_map", "peers_map", "vmodels_map"):
        Path(str(args[name])).write_text("")
    return Layout(**args)  # type: ignore[arg-type]


def _check(haproxy: str, text: str, tmp: Path) -> None:
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(text)
    done = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "variant", ["plain", "deadline", "tls", "mtls", "unix-runtime", "log", "ipv6", "ipv6-tls", "per-connection"]
)
def test_every_rendered_configuration_is_valid_for_haproxy(haproxy_path: str, tmp_path: Path, variant: str) -> None:
    pem = tmp_path / "cert-key.pem"
    ca = TestCA(tmp_path, "ca")
    issued = ca.issue("inst", dns=("meshd.test",), ips=("127.0.0.1",))
    pem.write_bytes(Path(issued.cert).read_bytes() + Path(issued.key).read_bytes())
    tls = TlsFiles(str(pem), str(ca.cert) if variant == "mtls" else None, str(ca.cert))
    kw: dict[str, object] = {
        "plain": {},
        "deadline": {"deadline_required": True},
        "tls": {"tls": tls},
        "mtls": {"tls": tls},
        "unix-runtime": {"runtime": "unix@/run/runtime.sock"},
        "log": {"log_socket": str(tmp_path / "log.sock")},
        "ipv6": {"listen": haproxy_listen(18033, dual_stack=True), "runtime": haproxy_address("[::1]:8085")},
        "ipv6-tls": {"listen": haproxy_listen(18033, dual_stack=True), "tls": tls},
        "per-connection": {"request_per_connection": True, "tls": tls},
    }[variant]
    text = render(_layout(tmp_path, **kw))
    _check(haproxy_path, text, tmp_path)
    assert "noreuseport" in text  # a taken port fails start-up
    servers = [line for line in text.splitlines() if line.strip().startswith("server ")]
    # the runtime and its Python backup, each peer slot and its backup, the Python path itself
    assert len(servers) == 2 + 2 * 16 + 1
    assert all((" max-reuse 0" in line) == (variant == "per-connection") for line in servers), servers
    assert ("grpc-timeout) eq 0" in text) == (variant == "deadline")
    # peers are always verified
    assert ("verify required" in text) == (variant in ("mtls", "tls", "ipv6-tls", "per-connection"))


@pytest.mark.parametrize(
    ("line", "bug"),
    [
        ("HAProxy version 2.6.12-1+deb12u3 2025/10/03 - https://haproxy.org/", True),  # Debian 12
        ("HA-Proxy version 2.0.14 2020/04/02 - https://haproxy.org/", True),  # the older spelling
        ("HAProxy version 2.8.5-1ubuntu3 2024/04/01 - https://haproxy.org/", True),
        ("HAProxy version 2.9.0 2023/12/01 - https://haproxy.org/", True),
        ("HAProxy version 2.9.1 2023/12/15 - https://haproxy.org/", False),  # the fix
        ("HAProxy version 2.10-dev0 2023/12/01 - https://haproxy.org/", False),
        ("HAProxy version 3.0.11-9e587df 2025/06/02 - https://haproxy.org/", False),  # Debian 13
        ("HAProxy version 3.2.0 2025/05/28 - https://haproxy.org/", False),
        ("something else entirely", True),  # unknown: the safe configuration
    ],
)
def test_which_haproxy_gets_a_connection_per_request(line: str, bug: bool) -> None:
    assert trailers_reset_bug(line) is bug
