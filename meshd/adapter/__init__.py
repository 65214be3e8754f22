"""adapter: `meshd adapter`, a ModelRuntime (SPI) server in front of a KServe V2 model server
that speaks the model-repository extension (Triton in explicit model-control mode, MLServer).
An edge of its own: a separate process, sharing only the vocabulary with the daemon.

May import: core, decisions, observability, process.
"""
