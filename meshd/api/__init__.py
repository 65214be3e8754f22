"""api: the daemon's front doors, gRPC and HTTP, as thin conversions to core objects.

Owns: the servicers (`modelmesh`: the ModelMesh management API; `kserve` and `kserve_http`:
KServe V2 over gRPC and HTTP sharing `kserve_core`; `admin`; `peer`: the internal port's
non-inference calls; `health`; `probes`: upstream's HTTP /ready, /live and /prestop), the
cores they call (`management`, `repository`: the KServe repository extension, `modelrepo`:
the model repository directory), and the edge helpers (`parsing`, `grpc_errors`).

May import: core, decisions, security, observability, kv, runtime, registry, serving, loops, net.
"""
