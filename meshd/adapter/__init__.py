"""adapter: `meshd adapter`, a ModelRuntime (SPI) server in front of a KServe V2 model server
that speaks the model-repository extension (Triton in explicit model-control mode, MLServer).
An edge of its own: a separate process, sharing only the vocabulary with the daemon. With a
model folder (`--root-model-dir`, upstream's ROOT_MODEL_DIR) it pulls models from where their
users keep them first (the storage room) and keeps them on disk as a tier (issue 42).

May import: core, decisions, observability, process, storage.
"""
