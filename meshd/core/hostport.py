"""`host:port` text, spelled so an IPv6 literal is unambiguous: `[fd00::7]:8080`.

One place builds and reads the addresses meshd writes (the instance record's `loc`, the
native data plane's address, URLs, log lines) and the ones it dials. An IPv6 pod IP
(WKUBE_POD_IPADDR on an IPv6-only or dual-stack cluster) goes in brackets, as grpc, HTTP
(RFC 3986) and users copying a log line expect; reading also takes the unbracketed form
(`fd00::7:8080`: the last colon starts the port), as a record written before brackets, or
by another writer, may hold. Pure: no sockets, no name lookups.
"""

from __future__ import annotations

import ipaddress

MAX_PORT = 65535


def is_ipv6(host: str) -> bool:
    """Whether `host` (bracketed or not) is an IPv6 literal; a zone (`fe80::1%eth0`) counts."""
    bare = unbracket(host)
    try:
        return isinstance(ipaddress.ip_address(bare.split("%", 1)[0]), ipaddress.IPv6Address)
    except ValueError:
        return False


def unbracket(host: str) -> str:
    """`[::1]` -> `::1`; anything else as given."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def bracket(host: str) -> str:
    """The host as it goes before `:port` or in a URL: an IPv6 literal in brackets, once."""
    return f"[{unbracket(host)}]" if is_ipv6(host) else host


def join(host: str, port: int | str) -> str:
    """`host:port`, `[v6]:port` for an IPv6 literal (bracketed or not)."""
    return f"{bracket(host)}:{port}"


def split(address: str) -> tuple[str, int]:
    """(host, port) of `host:port`, `[v6]:port` or `v6:port` (last colon); the host unbracketed.

    ValueError when there is no port, the port is not 1-65535, or brackets do not close."""
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep or "]" in host:
            raise ValueError(f"{address!r}: want [IPv6]:port")
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            raise ValueError(f"{address!r} has no port")
    if not host or not port.isdigit() or not 0 < int(port) <= MAX_PORT:
        raise ValueError(f"{address!r}: want host:port with a port from 1 to {MAX_PORT}")
    if ":" in host and not is_ipv6(host):  # `::1` alone: no port after all
        raise ValueError(f"{address!r}: an IPv6 address needs [brackets] and a port")
    return host, int(port)


def dial_target(address: str) -> str:
    """A grpc target for a peer's `host:port` as a record holds it: an unbracketed IPv6 host
    gets its brackets (grpc reads `::1:8080` as a host without a port); anything that is not
    `host:port` (`unix:/path`, a name without a port) is passed on as given."""
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    try:
        host, port = split(address)
    except ValueError:
        return address
    return join(host, port)
