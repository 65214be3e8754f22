"""The KServe repository extension's view of the mesh: registered models (management and the
router) plus the optional model repository directory (meshd/api/modelrepo.py) that a load of an
unregistered name registers from first."""

from __future__ import annotations

import asyncio

from meshd.api.management import Management
from meshd.api.modelrepo import ModelDirectory
from meshd.decisions.status import ModelStatus, StatusView
from meshd.serving.router import Router

UNLOAD_VISIBLE_S = 5.0


class MeshRepository:
    def __init__(self, management: Management, router: Router, directory: ModelDirectory | None = None) -> None:
        self.management = management
        self.router = router
        self.directory = directory

    def model_ids(self) -> list[str]:
        return self.management.model_ids()

    async def unregistered(self) -> list[str]:
        if self.directory is None:
            return []
        names = await asyncio.to_thread(self.directory.names)
        registered = self.management.registry.models
        return [n for n in names if registered.get(n) is None]

    async def load(self, model_id: str) -> StatusView:
        """Loaded somewhere already, or loaded here now (waits); a name that is not registered
        is registered from the directory first (registered models win over the directory)."""
        # status() raises DATA_LOSS for a corrupt record: that name is not taken from the directory.
        if self.directory is not None and self.management.status(model_id).status is ModelStatus.NOT_FOUND:
            info = await asyncio.to_thread(self.directory.find, model_id)
            # Registering the same info twice is a no-op, so concurrent loads both succeed.
            await self.management.register(model_id, info, load_now=False, sync=False, last_used_ms=0)
        return await self.management.load(model_id)

    async def unload(self, model_id: str) -> None:
        self.management.registry.require(model_id)
        asked = set(await self.router.unload_copies(model_id))
        # Answer once this instance's mirror shows the copies gone, so a status read right
        # after (ModelReady, getModelStatus) agrees; the holders removed them before answering.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UNLOAD_VISIBLE_S
        while loop.time() < deadline:
            record = self.management.registry.get(model_id)
            if record is None or not asked & set(record.instance_ids):
                return
            await asyncio.sleep(0.02)
