"""core: the vocabulary every room speaks. Pure: no I/O, no event loop.

Owns: `errors` (meshd's failures, each with its gRPC status), `clock` (the `Clock` type
decisions take and the one wall clock the daemon injects), `records` (model, vmodel and
instance records and their upstream-compatible JSON), `model_types` (the model types
modelmesh-serving names and what serves each).

May import: nothing else of meshd. (`grpc` only for its status-code enum.)
"""
