"""meshd: a Python model mesh beside any ModelMesh runtime.

Rooms, each a package whose docstring says what it owns and what it may import (a test,
tests/test_layout.py, holds the code to it); lowest first:

- `core`: the vocabulary (errors, clock, records). Pure.
- `decisions`: every rule shared with the simulator (placement, cache, gate, janitor,
  status, ids). Pure.
- `security`, `observability`: TLS and peer identity; metrics, tracing, logs.
- `kv`, `runtime`, `process`: the seams to etcd, to the model runtime, and to the child
  processes meshd and the adapter start.
- `registry`: model, vmodel and instance records in etcd.
- `serving`: the request path (router, forwarding, local copies, proxy handlers).
- `loops`: leader duties, copy scaling, inventory, the runtime watch.
- edges: `api` (servicers and their cores), `ops` (operator CLI), `adapter`, `runtimes`.
- assembly: `config` (environment to settings), `mesh` (one instance built and run),
  `cli`, `demo`; and `testing` beside it.
"""

__version__ = "0.1.0"
