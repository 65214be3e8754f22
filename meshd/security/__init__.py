"""security: TLS material and who may call the internal port.

Owns: `tls` (reading and checking MM_TLS_* files, server and client credentials, binding
a port with them), `peer_auth` (the interceptors that admit only mesh instances' certificates
on the internal port).

May import: core.
"""
