"""runtime: the seam to the model runtime beside meshd (meshd is the SPI client).

Owns: `client` (the `mmesh.ModelRuntime` calls), `endpoints` (channels to the runtime and
peers, over TCP or a unix socket), `loader` (the load queue: loading threads and timeouts).

May import: core, decisions, observability.
"""
