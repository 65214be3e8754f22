"""Which inference methods meshd carries, and how (pure).

A method is carried when the runtime allows it (its `methodInfos` allow-list, or any with
`allowAnyMethod` or an empty map, SPEC §1) and the dataplane config does too (its
`rpcConfigs`, or any with `allowOtherRpcs`, the default). The ModelRuntime SPI, the
management API and meshd's peer service are never carried.

gRPC frames unary and streaming calls alike, so the streaming path carries a call of any
shape; the unary path costs less in Python and serves methods not declared streaming.
Streaming: KServe's `ModelStreamInfer`, and any method whose dataplane entry says
`"streaming": true` (ours).

Dataplane config (upstream `MM_DATAPLANE_CONFIG`):
`{"rpcConfigs": {"pkg.Svc/Method": {"idExtractionPath": [1], "vModelId": false}}, "allowOtherRpcs": true}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshd.serving.proxy.wire import check_path

FORBIDDEN_PREFIXES = (
    "/mmesh.ModelRuntime/",
    "/mmesh.ModelMesh/",
    "/meshd.peer.",
    "/meshd.admin.",  # ours; a method this version lacks is UNIMPLEMENTED, not the runtime's
    "/grpc.",
    # The runtime's own repository API would let a client unload models behind meshd's back.
    "/inference.GRPCInferenceService/Repository",
)
# Exactly "/service/method": other spellings ("mmesh.ModelRuntime/x" without the slash, which
# some servers accept) must not slip past the checks above.
_METHOD_PATH = re.compile(r"^/[^/]+/[^/]+$")
# meshd.llm.OpenAI/Call (ours) streams an LLM engine's answer back to the HTTP port.
KNOWN_STREAMING = frozenset({"/inference.GRPCInferenceService/ModelStreamInfer", "/meshd.llm.OpenAI/Call"})
# KServe V2 requests name their model in field 1: with no model header, that names it, so
# KServe clients work unchanged (tritonclient's get_model_metadata sends no header).
KSERVE_NAME_FIELD = {
    f"/inference.GRPCInferenceService/{m}": (1,)
    for m in ("ModelInfer", "ModelStreamInfer", "ModelMetadata", "ModelConfig", "ModelReady")
}
MAX_CACHED_METHODS = 1024  # bounds memory when any method is allowed


def method_path(name: str) -> str:
    """`pkg.Svc/Method` or `/pkg.Svc/Method` -> `/pkg.Svc/Method`."""
    return "/" + name.lstrip("/")


@dataclass(frozen=True, slots=True)
class RpcConfig:
    id_extraction_path: tuple[int, ...] = ()
    vmodel_id: bool = False  # the extracted id names a vmodel
    streaming: bool = False  # ours: carry with the streaming handler


@dataclass(frozen=True, slots=True)
class DataplaneConfig:
    rpc_configs: Mapping[str, RpcConfig] = field(default_factory=dict)
    allow_other_rpcs: bool = True

    @classmethod
    def parse(cls, text: str) -> DataplaneConfig:
        """Raises ValueError naming what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("must be a JSON object")
        unknown = set(data) - {"rpcConfigs", "allowOtherRpcs"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; expected rpcConfigs, allowOtherRpcs")
        allow = data.get("allowOtherRpcs", True)
        if not isinstance(allow, bool):
            raise ValueError("allowOtherRpcs must be true or false")
        rpcs = data.get("rpcConfigs", {})
        if not isinstance(rpcs, dict):
            raise ValueError("rpcConfigs must be an object of method name -> config")
        return cls({method_path(name): _rpc_config(name, value) for name, value in rpcs.items()}, allow)


def _rpc_config(name: str, value: Any) -> RpcConfig:
    if not isinstance(value, dict):
        raise ValueError(f"rpcConfigs[{name!r}] must be an object")
    unknown = set(value) - {"idExtractionPath", "vModelId", "streaming"}
    if unknown:
        raise ValueError(f"rpcConfigs[{name!r}]: unknown keys {sorted(unknown)}")
    path = value.get("idExtractionPath", [])
    if not isinstance(path, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in path):
        raise ValueError(f"rpcConfigs[{name!r}].idExtractionPath must be a list of field numbers")
    try:
        extraction = check_path(path) if path else ()
    except ValueError as e:
        raise ValueError(f"rpcConfigs[{name!r}].idExtractionPath: {e}") from None
    flags = {k: value.get(k, False) for k in ("vModelId", "streaming")}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise ValueError(f"rpcConfigs[{name!r}].{k} must be true or false")
    return RpcConfig(extraction, flags["vModelId"], flags["streaming"])


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """How one carried method is handled; made once per method path."""

    path: str  # "/pkg.Svc/Method"
    streaming: bool = False
    inject: tuple[int, ...] = ()  # the runtime's idInjectionPath; () = none
    extract: tuple[int, ...] = ()  # the dataplane idExtractionPath; () = headers only
    extract_vmodel: bool = False
    fallback: tuple[int, ...] = ()  # where the body names the model when no header does


class MethodTable:
    def __init__(
        self,
        injection_paths: Mapping[str, tuple[int, ...]],
        allow_any: bool,
        dataplane: DataplaneConfig | None = None,
    ) -> None:
        """`injection_paths`: the runtime's methodInfos (method -> idInjectionPath).

        Raises ValueError when the runtime reports an invalid path."""
        self.dataplane = dataplane or DataplaneConfig()
        self.runtime_allows_any = allow_any or not injection_paths
        self.injection: dict[str, tuple[int, ...]] = {}
        for name, path in injection_paths.items():
            try:
                self.injection[method_path(name)] = check_path(path) if path else ()
            except ValueError as e:
                raise ValueError(f"the runtime's idInjectionPath for {name}: {e}") from None
        self._specs: dict[str, MethodSpec] = {}
        self.version = 0  # bumped by `reconfigure`: handlers made from older specs are dropped

    def reconfigure(self, dataplane: DataplaneConfig) -> None:
        """A new dataplane config (MM_DATAPLANE_CONFIG_PATH changed): specs are made afresh."""
        self.dataplane = dataplane
        self._specs = {}
        self.version += 1

    def spec(self, path: str) -> MethodSpec | None:
        """How to carry `path`, or None when it is not carried (UNIMPLEMENTED)."""
        spec = self._specs.get(path)
        if spec is not None:
            return spec
        if not _METHOD_PATH.match(path) or path.startswith(FORBIDDEN_PREFIXES):
            return None
        if not self.runtime_allows_any and path not in self.injection:
            return None
        rpc = self.dataplane.rpc_configs.get(path)
        if rpc is None and not self.dataplane.allow_other_rpcs:
            return None
        rpc = rpc or RpcConfig()
        spec = MethodSpec(
            path=path,
            streaming=rpc.streaming or path in KNOWN_STREAMING,
            inject=self.injection.get(path, ()),
            extract=rpc.id_extraction_path,
            extract_vmodel=rpc.vmodel_id,
            fallback=KSERVE_NAME_FIELD.get(path, ()),
        )
        if len(self._specs) < MAX_CACHED_METHODS:  # method names may be client-chosen
            self._specs[path] = spec
        return spec
