"""decisions: every rule the daemon and the simulator (`sim/`) share. Pure and clock-injected.

Each function reads plain data (a `placement.view.ClusterView` snapshot with its `now_ms`,
record fields, counts) and returns a decision; randomness comes only from an injected
`random.Random`. No I/O, no asyncio, no wall clock: the mechanisms act on the answers.

Owns: `placement/` (where a model loads, which copy serves, how many copies: rank, serving,
scaling, constraints, modelkey, view, and `liveness`: what the records lag behind),
`cache` (what to admit and evict: LRU, GDSF, LRFU or RATE over 8 KiB units), `gate` (the per-copy
concurrency rules), `janitor` (what to repair between the cache and the registry), `status`
(what getModelStatus reports), `ids` (what a valid model id and ModelInfo are), `publishing`
(what this instance's record says and when it is due), `drain` (when a stopping instance's
drain grace ends), `dynamic_config` (what upstream's run-time settings under `config/` in etcd mean).

May import: core.
"""
