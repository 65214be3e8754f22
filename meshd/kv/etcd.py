"""`EtcdStore`: the `KVStore` over a real etcd v3, through aetcd's channel and stubs.

It owns the mapping between meshd's store semantics and etcd's gRPC API: UTF-8 keys,
mod-revision compares, lease keep-alives, failure mapping (connectivity errors become
`StoreUnavailable`, never raw gRPC errors) and prefix watches that outlive etcd restarts.

aetcd's own Watcher hides compaction and does not resume after a broken stream, so
watches use the raw Watch stub: one gRPC stream per `watch_prefix` iterator, re-created
with backoff after any failure and resumed from the last delivered revision + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import aetcd
import grpc
from aetcd import rpc

from meshd.kv.store import (
    Compacted,
    Compare,
    Event,
    KeyValue,
    LeaseExpired,
    Op,
    Put,
    StoreError,
    StoreUnavailable,
    TxnResult,
)

log = logging.getLogger(__name__)

# Watch reconnect backoff: starts small so a restart costs little, capped so a long outage
# does not hammer etcd.
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0

_CHANNEL_OPTIONS: dict[str, Any] = {
    # gRPC's own reconnect backoff defaults to 1 s growing to 120 s; a watch resuming
    # after an etcd restart would wait that long before its stream could even start.
    "grpc.initial_reconnect_backoff_ms": int(BACKOFF_MIN_S * 1000),
    "grpc.min_reconnect_backoff_ms": int(BACKOFF_MIN_S * 1000),
    "grpc.max_reconnect_backoff_ms": int(BACKOFF_MAX_S * 1000),
    # Detect a silently dead peer on long-lived watch streams. etcd refuses pings more
    # often than every 5 s (--grpc-keepalive-min-time) and pings without streams.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 0,
    # Range responses over large prefixes can exceed gRPC's 4 MiB default.
    "grpc.max_receive_message_length": -1,
}

_UNAVAILABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class _StreamBroken(Exception):
    """The watch stream ended or was canceled by the server; reconnect."""


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """etcd's [key, range_end) covering every key that starts with `prefix`."""
    key = prefix.encode()
    if not key:
        return b"\0", b"\0"  # etcd: the whole keyspace
    end = bytearray(key)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return key, b"\0"  # all 0xff bytes: every key >= prefix
    end[-1] += 1
    return key, bytes(end)


def _map_rpc_error(err: grpc.aio.AioRpcError, what: str) -> StoreError:
    code = err.code()
    details = err.details() or ""
    if code in _UNAVAILABLE_CODES:
        return StoreUnavailable(f"etcd {what}: {code.name}: {details}")
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
        return LeaseExpired(f"etcd {what}: {details}")
    return StoreError(f"etcd {what}: {code.name}: {details}")


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        key=bytes(kv.key).decode(),
        value=bytes(kv.value),
        mod_revision=int(kv.mod_revision),
        create_revision=int(kv.create_revision),
        lease=int(kv.lease),
    )


def _event(ev: Any) -> Event:
    if ev.type == rpc.Event.DELETE:
        return Event("delete", bytes(ev.kv.key).decode(), b"", int(ev.kv.mod_revision))
    return Event("put", bytes(ev.kv.key).decode(), bytes(ev.kv.value), int(ev.kv.mod_revision))


def _group_by_revision(events: Sequence[Event]) -> list[list[Event]]:
    groups: list[list[Event]] = []
    for ev in events:
        if groups and groups[-1][0].mod_revision == ev.mod_revision:
            groups[-1].append(ev)
        else:
            groups.append([ev])
    return groups


def member_target(endpoints: Sequence[tuple[str, int]]) -> str:
    """One grpc target naming every member's addresses (grpc's `ipv4:`/`ipv6:` list schemes
    take addresses only, so host names are resolved here, once)."""
    v4: list[str] = []
    v6: list[str] = []
    for host, port in endpoints:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"etcd member {host}:{port} does not resolve: {e}") from None
        for family, _, _, _, addr in infos:
            if family == socket.AF_INET and f"{addr[0]}:{port}" not in v4:
                v4.append(f"{addr[0]}:{port}")
            elif family == socket.AF_INET6 and f"[{addr[0]}]:{port}" not in v6:
                v6.append(f"[{addr[0]}]:{port}")
    return "ipv4:" + ",".join(v4) if v4 else "ipv6:" + ",".join(v6)


class EtcdStore:
    """KVStore over etcd; unary calls are bounded by `timeout_s`, watches are not."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 5.0, others: Sequence[tuple[str, int]] = ()) -> None:
        """`others`: the cluster's other members; calls then spread over every member that
        answers (grpc's round_robin), so losing one member (a minority) costs one retry."""
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        options = dict(_CHANNEL_OPTIONS)
        if others:
            target = member_target([(host, port), *others])
            host, port = target.rsplit(":", 1)[0], int(target.rsplit(":", 1)[1])  # aetcd joins them again
            options["grpc.lb_policy_name"] = "round_robin"
        self._client = aetcd.Client(host=host, port=port, options=options)
        self._closed = False
        self._closed_event = asyncio.Event()
        self._watch_calls: set[Any] = set()

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 5.0) -> EtcdStore:
        """Parse "http://host:port" or "host:port", or a comma-separated list of members."""
        endpoints = []
        for one in url.split(","):
            one = one.strip()
            parsed = urllib.parse.urlsplit(one if "://" in one else f"http://{one}")
            if parsed.scheme not in ("http", ""):
                raise ValueError(f"unsupported etcd URL scheme {parsed.scheme!r} in {url!r} (only plain http)")
            if not parsed.hostname:
                raise ValueError(f"no host in etcd URL {url!r}")
            endpoints.append((parsed.hostname, parsed.port or 2379))
        (host, port), others = endpoints[0], endpoints[1:]
        return cls(host, port, timeout_s=timeout_s, others=others)

    def __repr__(self) -> str:
        return f"EtcdStore({self.host}:{self.port})"

    # -- plumbing --------------------------------------------------------------------

    async def _connected(self) -> Any:
        if self._closed:
            raise StoreUnavailable("etcd store is closed")
        try:
            await self._client.connect()  # creates the (lazy) channel and stubs once
        except aetcd.ClientError as e:
            raise StoreUnavailable(f"etcd connect: {e}") from e
        return self._client

    @contextlib.contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        try:
            yield
        except grpc.aio.AioRpcError as e:
            # grpc reports a call cancelled with its task as CANCELLED; that is the task's
            # cancellation, not a store error, and must not be swallowed by error handling.
            task = asyncio.current_task()
            if e.code() == grpc.StatusCode.CANCELLED and task is not None and task.cancelling():
                raise asyncio.CancelledError from e
            raise _map_rpc_error(e, what) from e

    # -- KVStore ---------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        client = await self._connected()
        with self._mapped("get"):
            resp = await client.kvstub.Range(rpc.RangeRequest(key=key.encode()), timeout=self.timeout_s)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        client = await self._connected()
        key, end = _prefix_range(prefix)
        # Without sort options etcd returns keys in ascending byte order, which for UTF-8
        # is code-point order, so it matches sorting the decoded strings.
        with self._mapped("range"):
            resp = await client.kvstub.Range(rpc.RangeRequest(key=key, range_end=end), timeout=self.timeout_s)
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        client = await self._connected()
        with self._mapped("put"):
            resp = await client.kvstub.Put(
                rpc.PutRequest(key=key.encode(), value=value, lease=lease), timeout=self.timeout_s
            )
        return int(resp.header.revision)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
        client = await self._connected()
        request = rpc.TxnRequest(
            compare=[
                rpc.Compare(
                    key=c.key.encode(),
                    target=rpc.Compare.MOD,
                    result=rpc.Compare.EQUAL,
                    mod_revision=c.mod_revision,
                )
                for c in compares
            ],
            success=[
                rpc.RequestOp(request_put=rpc.PutRequest(key=op.key.encode(), value=op.value, lease=op.lease))
                if isinstance(op, Put)
                else rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=op.key.encode()))
                for op in ops
            ],
        )
        with self._mapped("txn"):
            resp = await client.kvstub.Txn(request, timeout=self.timeout_s)
        return TxnResult(succeeded=bool(resp.succeeded), revision=int(resp.header.revision))

    async def grant_lease(self, ttl_s: int) -> int:
        client = await self._connected()
        with self._mapped("lease grant"):
            resp = await client.leasestub.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s), timeout=self.timeout_s)
        if resp.error:
            raise StoreError(f"etcd lease grant: {resp.error}")
        return int(resp.ID)

    async def keep_alive(self, lease_id: int) -> int:
        client = await self._connected()
        # LeaseKeepAlive is a bidi stream; one request and its one reply make a refresh.
        call = client.leasestub.LeaseKeepAlive(iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=self.timeout_s)
        try:
            with self._mapped("lease keep-alive"):
                reply = await call.read()
        finally:
            call.cancel()
        if reply is grpc.aio.EOF:
            raise StoreUnavailable("etcd lease keep-alive: stream ended without a reply")
        ttl = int(reply.TTL)
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease_id:x} expired or unknown")
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        client = await self._connected()
        try:
            with self._mapped("lease revoke"):
                await client.leasestub.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), timeout=self.timeout_s)
        except LeaseExpired:
            pass  # revoking an absent lease is a no-op by contract

    async def compact(self, revision: int) -> None:
        client = await self._connected()
        try:
            with self._mapped("compact"):
                await client.kvstub.Compact(rpc.CompactionRequest(revision=revision), timeout=self.timeout_s)
        except StoreError as e:
            if "has been compacted" not in str(e):
                raise
            # Already compacted at or past `revision`: the requested state holds.

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        for call in list(self._watch_calls):
            call.cancel()  # wakes watch iterators blocked on a read; they then end
        await self._client.close()

    # -- watch -----------------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        if self._closed:
            raise StoreUnavailable("etcd store is closed")
        return self._watch(prefix, start_revision)

    async def _watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        key, range_end = _prefix_range(prefix)
        # Next revision to deliver; <= 0 means "from now", fixed by the first created reply.
        next_rev = start_revision
        backoff = BACKOFF_MIN_S
        while not self._closed:
            call: Any = None
            try:
                client = await self._connected()
                call = rpc.WatchStub(client.channel).Watch()
                self._watch_calls.add(call)
                create = rpc.WatchCreateRequest(
                    key=key,
                    range_end=range_end,
                    start_revision=max(next_rev, 0),
                    # Progress notifications let an idle watch advance its resume point, so
                    # a reconnect after compaction does not needlessly report Compacted.
                    progress_notify=True,
                    # Large responses come in fragments instead of failing; merged below.
                    fragment=True,
                )
                await call.write(rpc.WatchRequest(create_request=create))
                pending: list[Event] = []
                while True:
                    resp = await call.read()
                    if resp is grpc.aio.EOF:
                        raise _StreamBroken("watch stream ended")
                    if resp.compact_revision > 0:
                        raise Compacted(int(resp.compact_revision))
                    if resp.canceled:
                        raise _StreamBroken(f"watch canceled: {resp.cancel_reason or 'no reason given'}")
                    if resp.created:
                        backoff = BACKOFF_MIN_S
                        if next_rev <= 0:
                            next_rev = int(resp.header.revision) + 1
                        continue
                    pending.extend(_event(ev) for ev in resp.events)
                    if resp.fragment:
                        continue  # more of this response follows
                    if not pending:
                        # Progress notification (sent only to a synced watcher): every
                        # change up to header.revision has been delivered.
                        next_rev = max(next_rev, int(resp.header.revision) + 1)
                        continue
                    # etcd never splits one revision across unfragmented responses, so each
                    # complete response holds whole revisions.
                    batches, pending = _group_by_revision(pending), []
                    for batch in batches:
                        rev = batch[0].mod_revision
                        if rev < next_rev:
                            log.warning("etcd watch %r: dropping repeated revision %d", prefix, rev)
                            continue
                        next_rev = rev + 1
                        yield batch
            except (grpc.aio.AioRpcError, _StreamBroken, StoreUnavailable) as e:
                if self._closed:
                    return
                detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
                log.info("etcd watch %r broke (%s); resuming from %d in %.1fs", prefix, detail, next_rev, backoff)
            except asyncio.CancelledError:
                # close() cancels the stream under us: end quietly. A cancellation of the
                # consuming task itself must propagate.
                task = asyncio.current_task()
                if self._closed and (task is None or task.cancelling() == 0):
                    return
                raise
            finally:
                if call is not None:
                    call.cancel()
                    self._watch_calls.discard(call)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):  # wait_for could swallow a cancel here
                    await self._closed_event.wait()
            backoff = min(backoff * 2, BACKOFF_MAX_S)
