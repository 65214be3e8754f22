"""process: the child processes meshd and the adapter run (HAProxy, a model server).

Owns: `child` (a child started with vfork and exec, nothing of Python or of gRPC's fork
handlers running in between; it dies with its parent; a thread of its own reaps it, so its
exit never depends on the event loop's child tracking).

May import: nothing else of meshd.
"""
