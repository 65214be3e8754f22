"""`meshd models|vmodels|instances`: arguments, the calls they make, and what they print.

Every command takes `--address` (default `$MESHD_ADDRESS`, else localhost:8033),
`--timeout` and `--json`. A failed call prints one line `meshd <command>: <why>` on stderr
and exits 1; bad arguments are argparse's usage error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc

from meshd._proto.meshd import admin_pb2, admin_pb2_grpc
from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd._proto.mmesh import model_mesh_pb2_grpc as mm_grpc
from meshd.ops import render
from meshd.ops.connect import (
    ADDRESS_ENV,
    DEFAULT_TIMEOUT_S,
    OpsError,
    Target,
    TargetTls,
    default_address,
    open_channel,
    rpc_failure,
)

ADMIN = admin_pb2.DESCRIPTOR.services_by_name["MeshAdmin"].full_name
MANAGEMENT = mm.DESCRIPTOR.services_by_name["ModelMesh"].full_name

Handler = Callable[[argparse.Namespace, Target, grpc.Channel], int]


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 86_400:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 86400 seconds: {text!r}")
    return value


def _utf8(text: str) -> str:
    """An id as given on the command line; bytes that are not UTF-8 are a usage error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {text!r}") from None
    return text


def _address(text: str) -> str:
    """host:port of meshd's external gRPC port ([v6]:port, or unix:PATH); what to fix when not."""
    text = text.strip()
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    problem = address_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def address_problem(text: str) -> str | None:
    """Why `text` is not an address the CLI can dial, saying what to write instead."""
    if text.startswith(("unix:", "unix-abstract:")):
        return None
    _, sep, rest = text.partition("://")
    if sep:
        host = rest.split("/")[0] or "HOST:8033"
        return f"{text!r} is a URL; give host:port of meshd's gRPC port, e.g. {host if ':' in host else host + ':8033'}"
    host, colon, port = text.rpartition(":")
    if not colon or not host or (host.endswith(":") and not host.startswith("[")):
        return f"{text!r} has no port; meshd's gRPC port is 8033 by default: {text}:8033"
    if not port.isdigit() or not 0 < int(port) <= 65535:
        return f"{text!r}: the port must be a number from 1 to 65535"
    return None


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address",
        type=_address,
        default=None,
        help=f"meshd external gRPC address host:port (default: ${ADDRESS_ENV}, else localhost:8033)",
    )
    common.add_argument(
        "--timeout", type=_timeout, default=DEFAULT_TIMEOUT_S, help=f"seconds per call (default {DEFAULT_TIMEOUT_S:g})"
    )
    common.add_argument("--json", action="store_true", help="print JSON (stable field names, see docs/operations.md)")
    tls = common.add_argument_group("TLS (a meshd with MM_TLS_* set)")
    tls.add_argument("--tls", action="store_true", help="dial with TLS, checking the server against system roots")
    tls.add_argument("--tls-ca", metavar="FILE", help="CA certificates (PEM) to check the server with; implies --tls")
    tls.add_argument("--tls-cert", metavar="FILE", help="client certificate (PEM) for MM_TLS_CLIENT_AUTH=REQUIRE")
    tls.add_argument("--tls-key", metavar="FILE", help="private key (PEM) of --tls-cert")
    tls.add_argument("--tls-server-name", metavar="NAME", help="name the server certificate holds, if not the address")
    return common


def _target_tls(args: argparse.Namespace) -> TargetTls | None:
    wanted = args.tls or args.tls_ca or args.tls_cert or args.tls_key or args.tls_server_name
    if not wanted:
        return None
    return TargetTls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def add_commands(sub: Any) -> None:
    """Add `models`, `vmodels` and `instances` to the `meshd` subcommands."""
    common = _common()

    models = sub.add_parser("models", help="list, get (or show), register and unregister models")
    msub = models.add_subparsers(dest="action", required=True, metavar="{list,get,register,unregister}")
    p = msub.add_parser("list", parents=[common], help="every registered model: status, copies, size, last use")
    p.set_defaults(func=_run(_models_list, "models list"))
    p = msub.add_parser("get", aliases=["show"], parents=[common], help="one model in detail (alias: show)")
    p.add_argument("model_id", type=_utf8, metavar="MODEL_ID")
    p.set_defaults(func=_run(_models_get, "models get"))
    p = msub.add_parser("register", parents=[common], help="register a model (mmesh registerModel)")
    p.add_argument("model_id", type=_utf8, metavar="MODEL_ID")
    _model_info_arguments(p, required=True)
    p.add_argument("--load-now", action="store_true", help="start loading a copy now")
    p.add_argument("--sync", action="store_true", help="with --load-now: wait for the load to finish")
    p.add_argument(
        "--last-used-ms",
        type=_non_negative,
        default=0,
        help="last-used time to record (ms since the epoch; default: 6 h ago, 1 h ago with --load-now, "
        "upstream's rule so a new model cannot evict models in use; `models list` says LAST USED 'never' "
        "until it is used)",
    )
    p.set_defaults(func=_run(_models_register, "models register"))
    p = msub.add_parser("unregister", parents=[common], help="unregister a model (mmesh unregisterModel)")
    p.add_argument("model_id", type=_utf8, metavar="MODEL_ID")
    p.set_defaults(func=_run(_models_unregister, "models unregister"))

    vmodels = sub.add_parser("vmodels", help="set, get (or show) and delete vmodels")
    vsub = vmodels.add_subparsers(dest="action", required=True, metavar="{set,get,delete}")
    p = vsub.add_parser("set", parents=[common], help="create a vmodel or move it to a target (mmesh setVModel)")
    p.add_argument("vmodel_id", type=_utf8, metavar="VMODEL_ID")
    p.add_argument("target", type=_utf8, metavar="TARGET_MODEL_ID")
    _model_info_arguments(p, required=False)
    p.add_argument("--auto-delete", action="store_true", help="delete the target once no vmodel references it")
    p.add_argument("--load-now", action="store_true", help="load the target now")
    p.add_argument("--force", action="store_true", help="switch at once, without waiting for the target to load")
    p.add_argument("--sync", action="store_true", help="wait for the switch (or load) to finish")
    p.add_argument("--update-only", action="store_true", help="fail (NOT_FOUND) if the vmodel does not exist")
    p.add_argument("--owner", default="", help="vmodel owner (must match an existing vmodel's)")
    p.add_argument("--expected-target", type=_utf8, default="", help="only if the current target is this model (CAS)")
    p.set_defaults(func=_run(_vmodels_set, "vmodels set", check=(p, _check_vmodel_set)))
    p = vsub.add_parser(
        "get", aliases=["show"], parents=[common], help="one vmodel's status (mmesh getVModelStatus; alias: show)"
    )
    p.add_argument("vmodel_id", type=_utf8, metavar="VMODEL_ID")
    p.add_argument("--owner", default="")
    p.set_defaults(func=_run(_vmodels_get, "vmodels get"))
    p = vsub.add_parser("delete", parents=[common], help="delete a vmodel (mmesh deleteVModel)")
    p.add_argument("vmodel_id", type=_utf8, metavar="VMODEL_ID")
    p.add_argument("--owner", default="")
    p.set_defaults(func=_run(_vmodels_delete, "vmodels delete"))

    instances = sub.add_parser("instances", help="list the mesh's instances")
    isub = instances.add_subparsers(dest="action", required=True, metavar="{list}")
    p = isub.add_parser("list", parents=[common], help="capacity, use, models, request rate, LRU age")
    p.set_defaults(func=_run(_instances_list, "instances list"))


INT64_MAX = (1 << 63) - 1


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    if value > INT64_MAX:  # protobuf's int64 fields refuse more (a traceback, not a usage error)
        raise argparse.ArgumentTypeError(f"must be at most {INT64_MAX}: {text!r}")
    return value


def _model_info_arguments(p: argparse.ArgumentParser, required: bool) -> None:
    what = "the model's" if required else "the target's (to register it with the vmodel)"
    p.add_argument("--type", dest="model_type", metavar="TYPE", required=required, help=f"{what} type (ModelInfo.type)")
    p.add_argument("--path", default="", help=f"{what} path (ModelInfo.path)")
    p.add_argument("--key", default="", help=f"{what} key (ModelInfo.key)")


Check = tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], str | None]]


def _run(handler: Handler, command: str, check: Check | None = None) -> Callable[[argparse.Namespace], int]:
    """The command as `meshd` calls it: arguments checked together (a usage error, exit 2),
    one channel, a failed call as one line and exit 1."""

    def run(args: argparse.Namespace) -> int:
        if check is not None:
            parser, rule = check
            problem = rule(args)
            if problem is not None:
                parser.error(problem)  # exits 2
        if bool(args.tls_cert) != bool(args.tls_key):
            print(f"meshd {command}: --tls-cert and --tls-key go together", file=sys.stderr)
            return 2
        address = args.address or default_address()
        problem = None if args.address else address_problem(address)
        if problem is not None:
            print(f"meshd {command}: ${ADDRESS_ENV}: {problem}", file=sys.stderr)
            return 2
        target = Target(address, args.timeout, _target_tls(args))
        try:
            with open_channel(target) as channel:
                return handler(args, target, channel)
        except OpsError as e:
            print(f"meshd {command}: {e}", file=sys.stderr)
            return 1

    return run


def _call(target: Target, service: str, method: Callable[..., Any], request: Any) -> Any:
    try:
        return method(request, timeout=target.timeout_s)
    except grpc.RpcError as e:
        raise rpc_failure(target, e, service) from None


def _print(args: argparse.Namespace, data: render.JSON, text: Callable[[], str]) -> int:
    print(json.dumps(data, indent=2) if args.json else text())
    return 0


# ---- models -------------------------------------------------------------------------------
def _models_list(args: argparse.Namespace, target: Target, channel: grpc.Channel) -> int:
    stub = admin_pb2_grpc.MeshAdminStub(channel)
    resp = _call(target, ADMIN, stub.listModels, admin_pb2.ListModelsRequest())
    return _print(args, render.models_json(resp), lambda: render.models_table(resp))


def _models_get(args: argparse.Namespace, target: Target, channel: grpc.Channel) -> int:
    stub = admin_pb2_grpc.MeshAdminStub(channel)
    resp = _call(target, ADMIN, stub.listModels, admin_pb2.ListModelsRequest(modelIds=[args.model_id]))
    if len(resp.models) != 1:
        raise OpsError(f"expected one model in the answer, got {len(resp.models)}")
    m = resp.models[0]
    return _print(args, render.model_json(m), lambda: render.model_block(m, resp.nowMs))


def _models_register(args: argparse.Namespace, target: Target, channel: grpc.Channel) -> int:
    info = mm.ModelInfo(type=args.model_type, path=args.path, key=args.key)
    req = mm.RegisterModelRequest(
        modelId=args.model_id, modelInfo=info, loadNow=args.load_now, sync=args.sync, lastUsedTime=args.last_used_ms
    )
    st = _call(target, MANAGEMENT, mm_grpc.ModelMeshStub(channel).registerModel, req)
    code = _print(args, render.status_json(args.model_id, st), lambda: render.status_block(args.model_id, st, _now()))
    if args.load_now and args.sync and st.status != mm.ModelStatusInfo.LOADED:
        # Registered, but the load asked for did not succeed: scripts see it in the exit code.
        name = mm.ModelStatusInfo.ModelStatus.Name(st.status)
        print(f"meshd models register: {args.model_id} registered but not loaded ({name})", file=sys.stderr)
        return 1
    return code


def _models_unregister(args: argparse.Namespace, target: Target, channel: grpc.Channel) -> int:
    stub = mm_grpc.ModelMeshStub(channel)
    # unregisterModel of an absent model is a no-op (SPEC §2); a script asking for it hears so.
    st = _call(target, MANAGEMENT, stub.getModelStatus, mm.GetStatusRequest(modelId=args.model_id))
    if st.status == mm.ModelStatusInfo.NOT_FOUND:
        raise OpsError(f"model {args.model_id!r} not found")
    _call(target, MANAGEMENT, stub.unregisterModel, mm.UnregisterModelRequest(modelId=args.model_id))
    data = {"modelId": args.model_id, "unregistered": True}
    return _print(args, data, lambda: f"model {args.model_id} unregistered")


# ---- vmodels ------------------------------------------------------------------------------
def _check_vmodel_set(args: argparse.Namespace) -> str | None:
    if args.model_type is None and (args.path or args.key):
        return "--path and --key describe the target's ModelInfo: give --type too"
    return None


def _vmodels_set(args: argparse.Namespace, target: Target, channel: grpc.Channel) -> int:
    req = mm.SetVModelRequest(
        vModelId=args.vmodel_id,
        targetModelId=args.target,
        updateOnly=args.update_only,
        autoDeleteTargetModel=args.auto_delete,
        loadNow=args.load_now,
        force=args.force,
        sync=args.sync,
        expectedTargetModelId=args.expected_target,
        owner=args.owner,
    )
    if args.model_type is not None:
        req.modelInfo.CopyFrom(mm.ModelInfo(type=args.model_type, path=args.path, key=args.key))
    v = _call(target, MANAGEMENT, mm_grpc.ModelMeshStub(channel).setVModel, req)
    return _print(args, render.vmodel_json(args.vmodel_id, v), lambda: render.vmodel_block(args.vmodel_id, v))


def _vmodels_get(args: argparse.Namespace, target: Target, channel: grpc.Channel) -> int:
    req = mm.GetVModelStatusRequest(vModelId=args.vmodel_id, owner=args.owner)
    v = _call(target, MANAGEMENT, mm_grpc.ModelMeshStub(channel).getVModelStatus, req)
    if v.status == mm.VModelStatusInfo.NOT_FOUND:
        raise OpsError(f"vmodel {args.vmodel_id!r} not found")
    return _print(args, render.vmodel_json(args.vmodel_id, v), lambda: render.vmodel_block(args.vmodel_id, v))


def _vmodels_delete(args: argparse.Namespace, target: Target, channel: grpc.Channel) -> int:
    stub = mm_grpc.ModelMeshStub(channel)
    get = mm.GetVModelStatusRequest(vModelId=args.vmodel_id, owner=args.owner)
    if _call(target, MANAGEMENT, stub.getVModelStatus, get).status == mm.VModelStatusInfo.NOT_FOUND:
        raise OpsError(f"vmodel {args.vmodel_id!r} not found")
    req = mm.DeleteVModelRequest(vModelId=args.vmodel_id, owner=args.owner)
    _call(target, MANAGEMENT, stub.deleteVModel, req)
    data = {"vmodelId": args.vmodel_id, "deleted": True}
    return _print(args, data, lambda: f"vmodel {args.vmodel_id} deleted")


# ---- instances ----------------------------------------------------------------------------
def _instances_list(args: argparse.Namespace, target: Target, channel: grpc.Channel) -> int:
    stub = admin_pb2_grpc.MeshAdminStub(channel)
    resp = _call(target, ADMIN, stub.listInstances, admin_pb2.ListInstancesRequest())
    return _print(args, render.instances_json(resp), lambda: render.instances_table(resp))


def _now() -> int:
    return int(time.time() * 1000)
