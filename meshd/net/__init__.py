"""net: the TCP sockets meshd's HTTP servers listen on.

Owns: `listen` (a bound socket on every address of both families, a dual-stack `::` with
IPV6_V6ONLY off, or `0.0.0.0` where the host has no IPv6; a host the user named as given).
How addresses are written and read (`[v6]:port`) is `meshd.core.hostport`.

May import: core.
"""
