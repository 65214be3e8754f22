"""serving.proxy: the inference proxy's gRPC side, a generic raw-bytes handler for every
runtime method: `handler` (external port), `peer_handler` (internal port), `headers` (which
model a call names), `methods` (which methods are carried, in which shape), `wire` (id
extraction and splicing), `streams` (relaying a stream).

May import: what `meshd.serving` may import, and `meshd.serving` itself.
"""
