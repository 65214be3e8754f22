"""Reference model-serving runtimes that meshd's tests, demo and benchmarks run beside it.

`models` owns the tiny model file format and the KServe V2 request/response helpers;
`demo` is the runtime process (`python -m meshd.runtimes.demo`) and `demo_server` its
gRPC servicers (the ModelMesh runtime SPI and KServe V2 inference), `echo` one method of
each gRPC shape for tests.

May import: core, decisions.
"""
