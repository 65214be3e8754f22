"""The storage helper's one error: which model, which store, which object, what kind."""

from __future__ import annotations

from meshd.decisions.storage_plan import Failure


class StorageError(Exception):
    """A pull that failed. `kind` is one of `Failure`'s (or `config`); the message names the
    model, the store and the object, and never a credential (callers redact what stores say)."""

    def __init__(self, model_id: str, store: str, obj: str, kind: str, detail: str) -> None:
        self.model_id = model_id
        self.store = store
        self.object = obj
        self.kind = kind
        self.detail = detail
        where = f"{store} object {obj!r}" if obj else store
        super().__init__(f"model {model_id!r}: cannot pull from {where}: {detail}")

    @property
    def retryable(self) -> bool:
        """Whether another try (here later, or on another instance) may succeed."""
        return self.kind in (Failure.TRANSIENT, Failure.DISK)


class TransferError(Exception):
    """A failed request inside a pull (the helper adds the model and store)."""

    def __init__(self, kind: str, detail: str, obj: str = "") -> None:
        self.kind = kind
        self.detail = detail
        self.object = obj
        super().__init__(detail)


class ObjectChanged(TransferError):
    """An object no longer matches its listing (a 412 on its ETag, another length, another
    MD5): it changed since it was listed, so the pull lists the store again (once)."""

    def __init__(self, detail: str, obj: str) -> None:
        super().__init__(Failure.TRANSIENT, detail, obj)
