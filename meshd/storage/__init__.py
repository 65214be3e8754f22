"""storage: the storage helper. Pulls a model from where its users keep it (S3 and
S3-compatible stores, GCS, Azure Blob, HTTP(S), a PVC, Hugging Face Hub) onto local disk before
the runtime loads it, and keeps pulled models on disk as a second cache tier (docs/storage.md).
The rules (config resolution, paths, parts, retries, the tier's order) are pure, in
`meshd.decisions.storage` and `meshd.decisions.storage_plan`; this room does the I/O.

The API the runtimes build on (`StorageHelper`):
    helper = StorageHelper(StorageSettings.from_env(root_dir))
    await helper.start()                       # cleans half-written pulls, restores the tier
    size = await helper.predict_size(model_id, model_path, model_key)   # None: a local path
    pulled = await helper.pull(model_id, model_path, model_key)         # Pulled | None
    helper.release(model_id)                   # the runtime unloaded it: files stay, evictable
    helper.inventory()                         # Inventory: what the disk holds, the pulls running
    await helper.close()
Failures raise `StorageError` (model, store, object, kind), never naming a credential.

May import: core, decisions, observability.
"""

from meshd.storage.errors import StorageError
from meshd.storage.helper import Inventory, Pulled, StorageHelper, StorageSettings

__all__ = ["Inventory", "Pulled", "StorageError", "StorageHelper", "StorageSettings"]
