"""A registry on the in-process store, as one instance's process would hold it."""

from __future__ import annotations

from meshd.core.records import ModelRecord, VModelRecord
from meshd.kv.memory import MemoryStore
from meshd.kv.table import Table
from meshd.registry.models import Registry


async def new_registry(store: MemoryStore) -> Registry:
    """Its own mirrors of the store's models and vmodels, started."""
    models = Table(store, "/t/registry/", ModelRecord.decode, ModelRecord.encode)
    vmodels = Table(store, "/t/vmodels/", VModelRecord.decode, VModelRecord.encode)
    await models.start()
    await vmodels.start()
    return Registry(models, vmodels)
