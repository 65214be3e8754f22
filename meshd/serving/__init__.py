"""serving: the request path, from a received call to the copy that answers it.

Owns: `router` (routing attempts: local copy, peer, load, reroute; and serving the calls
peers forward here), `forwarding` (sending a call to the peer chosen), `peer_protocol` (what
peers say to each other: hop and mode metadata, refusal reasons, what an answer means),
`local` (this instance's copies: loads, evictions,
the janitor's repairs, applied to the runtime and the registry), `gate` (a copy's
concurrency limit on asyncio), `peers` (channels to peer instances), `cluster` (the live
`ClusterView` snapshot and peer channels together), `copies` (loaded copies counted by
asking their holders), `invocations` (per-call metrics and the invoke log), and `proxy/`
(the raw-bytes gRPC handlers and the wire: headers, methods, id splicing, stream relays), and
`native/` (the optional native data plane: HAProxy carrying warm requests, this room its control plane).

May import: core, decisions, security, observability, process, kv, runtime, registry.
"""
