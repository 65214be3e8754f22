"""loops: the control loops that run beside the request path, each on its own timer.

Owns: `leader` (the elected leader's duties: pruning records, preloading, cluster gauges),
`scaler` (adding and dropping copies as load changes), `inventory` (asking holders what
they hold, for listings), `runtime_watch` (probing the runtime; a dead runtime's copies
leave the records), `config_files` (mounted config files followed as they change),
`dynamic_config` (upstream's run-time settings under `config/` in etcd, followed as they change).

May import: core, decisions, observability, kv, runtime, registry, serving.
"""
