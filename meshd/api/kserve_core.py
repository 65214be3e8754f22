"""KServe V2 health, server metadata and the repository extension, for the whole mesh,
independent of transport: the gRPC handlers (api/kserve.py) and the REST endpoints
(api/kserve_http.py) both convert their messages at the edge and call this.

ServerLive and ServerReady are this instance's (ready: serving and not stopping); ModelReady
is true when a copy of the model is loaded anywhere in the mesh. Repository extension
(SPEC §4): the index lists every registered model with its mesh-wide state (READY, LOADING,
UNAVAILABLE with the reason), then the model repository directory's models not registered
yet with state "" (Triton's answer for a model it has never loaded); load registers a model
from the directory first when needed and answers once it is loaded; unload unloads every
copy, the model staying registered. Errors are MeshErrors carrying their gRPC status.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

import meshd
from meshd.core.errors import InvalidArgument, MeshError, NotFound
from meshd.decisions.status import ModelStatus, StatusView

SERVER_NAME = "meshd"
REPOSITORY_EXTENSION = "model_repository"

INDEX_STATES = {
    ModelStatus.LOADED: "READY",
    ModelStatus.LOADING: "LOADING",
    ModelStatus.NOT_LOADED: "UNAVAILABLE",
    ModelStatus.LOADING_FAILED: "UNAVAILABLE",
}
UNREGISTERED_REASON = "not registered; in the model repository"


class Repository(Protocol):
    """What the repository extension needs of the mesh."""

    def model_ids(self) -> list[str]: ...

    async def unregistered(self) -> list[str]:
        """Models the repository directory holds that are not registered (none without one)."""
        ...

    async def load(self, model_id: str) -> StatusView: ...

    async def unload(self, model_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class IndexEntry:
    name: str
    state: str
    reason: str
    version: str = ""


class LoadFailedError(MeshError):
    """RepositoryModelLoad ended without a loaded copy (INTERNAL, as Triton answers)."""


class Unimplemented(MeshError):
    code = grpc.StatusCode.UNIMPLEMENTED


class KServeCore:
    def __init__(
        self,
        status: Callable[[str], StatusView],
        serving: Callable[[], bool],
        repository: Repository | None = None,
        resolve_vmodel: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        """`status`: a model's mesh-wide status (getModelStatus); `serving`: whether this
        instance takes work (false once it starts stopping); `resolve_vmodel`: a vmodel's
        active model."""
        self.status = status
        self.serving = serving
        self.repository = repository
        self.resolve_vmodel = resolve_vmodel

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.serving()

    def metadata(self) -> ServerMetadata:
        extensions = (REPOSITORY_EXTENSION,) if self.repository is not None else ()
        return ServerMetadata(SERVER_NAME, meshd.__version__, extensions)

    async def model_status(self, name: str, model_header: str = "", vmodel_header: str = "") -> ModelStatus:
        """Mesh-wide status of the model a ModelReady call names (NOT_FOUND: unknown).

        As for routing: a model header wins, then a vmodel header, then the name (a model,
        or else a vmodel of that name)."""
        target = model_header or (await self._active(vmodel_header) if vmodel_header else name)
        if not target:
            raise InvalidArgument("ModelReady needs a model name (body or mm-model-id header)")
        view = self.status(target)
        if view.status == ModelStatus.NOT_FOUND and not model_header and not vmodel_header:
            with contextlib.suppress(NotFound):
                view = self.status(await self._active(name))
        return view.status

    async def model_ready(self, name: str, model_header: str = "", vmodel_header: str = "") -> bool:
        return await self.model_status(name, model_header, vmodel_header) == ModelStatus.LOADED

    async def _active(self, vmodel_id: str) -> str:
        if self.resolve_vmodel is None:
            raise NotFound(f"vmodel {vmodel_id!r} not found")
        return await self.resolve_vmodel(vmodel_id)

    async def index(self, ready_only: bool = False) -> list[IndexEntry]:
        repository = self._repository()
        out: list[IndexEntry] = []
        for model_id in sorted(repository.model_ids()):
            try:
                view = self.status(model_id)
            except MeshError as e:  # a corrupt record: listed, with the reason
                if not ready_only:
                    out.append(IndexEntry(model_id, "UNAVAILABLE", e.message))
                continue
            if view.status == ModelStatus.NOT_FOUND:
                continue  # unregistered meanwhile
            state = INDEX_STATES.get(view.status, "UNAVAILABLE")
            if ready_only and state != "READY":
                continue
            reason = "; ".join(view.errors) or ("" if state != "UNAVAILABLE" else "not loaded")
            out.append(IndexEntry(model_id, state, reason))
        if not ready_only:
            listed = {e.name for e in out}
            out += [IndexEntry(n, "", UNREGISTERED_REASON) for n in await repository.unregistered() if n not in listed]
        return out

    async def load(self, name: str) -> None:
        """Returns once a copy is loaded somewhere; LoadFailedError with the reasons if not."""
        view = await self._repository().load(_name(name))
        if view.status != ModelStatus.LOADED:
            reason = "; ".join(view.errors) or view.status.name
            raise LoadFailedError(f"failed to load {name!r}: {reason}")

    async def unload(self, name: str) -> None:
        await self._repository().unload(_name(name))

    def _repository(self) -> Repository:
        if self.repository is None:
            raise Unimplemented("the model repository extension is not enabled")
        return self.repository


def _name(model_name: str) -> str:
    if not model_name:
        raise InvalidArgument("model_name is empty")
    return model_name
