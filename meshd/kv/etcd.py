"""`EtcdStore`: the `KVStore` over a real etcd v3, through etcd's gRPC stubs (from aetcd).

It owns the mapping between meshd's store semantics and etcd's gRPC API: UTF-8 keys,
mod-revision compares, lease keep-alives, failure mapping (connectivity errors become
`StoreUnavailable`, never raw gRPC errors) and prefix watches that outlive etcd restarts.

It also owns the connection, because aetcd's client dials one plaintext endpoint: meshd
builds the channel itself, with TLS (CA, client certificate) and user/password auth (a
token on every call, renewed when etcd says it expired), and uses every endpoint of the
cluster. One endpoint is used at a time; when a call to it fails UNAVAILABLE the store
moves to the next one and repeats the call there once per endpoint (an UNAVAILABLE call
was not applied, so the repeat is safe), and a timed-out call or a broken watch moves it
too, so the store keeps serving while any member does.

aetcd's own Watcher hides compaction and does not resume after a broken stream, so
watches use the raw Watch stub: one gRPC stream per `watch_prefix` iterator, re-created
with backoff after any failure and resumed from the last delivered revision + 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from aetcd import rpc

from meshd.kv.health import Responsiveness
from meshd.kv.store import (
    Compacted,
    Compare,
    Event,
    KeyValue,
    LeaseExpired,
    LeaseTTL,
    Op,
    Put,
    StoreError,
    StoreUnavailable,
    TxnResult,
)
from meshd.kv.target import DEFAULT_PORT, Endpoint, EtcdTarget, KVStoreError, parse_kv_store

log = logging.getLogger(__name__)
T = TypeVar("T")

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
# etcd's answer to a call with an expired or unknown auth token (simple tokens expire after
# --auth-token-ttl idle seconds, and are per member): authenticate again and repeat.
_TOKEN_EXPIRED = "invalid auth token"


@dataclass(eq=False)
class _Conn:
    """One channel to one endpoint, its stubs and (with auth) its token."""

    endpoint: Endpoint
    channel: grpc.aio.Channel
    kv: Any = field(init=False)
    lease: Any = field(init=False)
    auth: Any = field(init=False)
    metadata: tuple[tuple[str, str], ...] | None = None
    authenticated: bool = False

    def __post_init__(self) -> None:
        self.kv = rpc.KVStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.auth = rpc.AuthStub(self.channel)

    def watch(self) -> Any:
        return rpc.WatchStub(self.channel).Watch(metadata=self.metadata)


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


class EtcdStore:
    """KVStore over etcd; unary calls are bounded by `timeout_s`, watches are not."""

    def __init__(self, target: EtcdTarget | str, port: int = DEFAULT_PORT, *, timeout_s: float = 5.0) -> None:
        if isinstance(target, str):  # a host and port: one plaintext endpoint
            target = EtcdTarget((Endpoint(target, port),))
        self.target = target
        self.timeout_s = timeout_s
        self._index = 0  # the endpoint in use
        self._conn: _Conn | None = None
        self._auth_lock = asyncio.Lock()
        self._closed = False
        self._closed_event = asyncio.Event()
        self._watch_calls: set[Any] = set()
        self._retired: set[asyncio.Task[None]] = set()
        self.health = Responsiveness()

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 5.0) -> EtcdStore:
        """`[http[s]://]host[:port]`, or several comma-separated (upstream's simple form)."""
        try:
            return cls(parse_kv_store(f"etcd:{url}"), timeout_s=timeout_s)
        except KVStoreError as e:
            raise ValueError(f"etcd URL {url!r}: {e}") from None

    @property
    def host(self) -> str:
        return self.target.endpoints[self._index].host

    @property
    def port(self) -> int:
        return self.target.endpoints[self._index].port

    def __repr__(self) -> str:
        return f"EtcdStore({self.target.describe()})"

    # -- plumbing --------------------------------------------------------------------

    def _dial(self, ep: Endpoint) -> _Conn:
        t = self.target
        options = dict(_CHANNEL_OPTIONS)
        if t.override_authority:
            options["grpc.ssl_target_name_override"] = t.override_authority
        address = str(ep)  # host:port, [v6]:port
        if t.tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=t.ca_cert, private_key=t.client_key, certificate_chain=t.client_cert
            )
            channel = grpc.aio.secure_channel(address, creds, options=list(options.items()))
        else:
            channel = grpc.aio.insecure_channel(address, options=list(options.items()))
        return _Conn(ep, channel)

    async def _connected(self) -> _Conn:
        if self._closed:
            raise StoreUnavailable("etcd store is closed")
        if self._conn is None:
            self._conn = self._dial(self.target.endpoints[self._index])
        conn = self._conn
        if self.target.user is not None and not conn.authenticated:
            async with self._auth_lock:
                if not conn.authenticated:
                    await self._authenticate(conn)
        return conn

    async def _authenticate(self, conn: _Conn) -> None:
        request = rpc.AuthenticateRequest(name=self.target.user or "", password=self.target.password or "")
        try:
            resp = await conn.auth.Authenticate(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            err = _map_rpc_error(e, f"authenticate as {self.target.user!r} at {conn.endpoint}")
            if isinstance(err, StoreUnavailable):
                self._rotate(conn, str(err))
            raise err from e
        conn.metadata = (("token", str(resp.token)),)
        conn.authenticated = True

    def _rotate(self, failed: _Conn, why: str) -> None:
        """Move to the next endpoint, unless another failure already moved past `failed`."""
        if self._conn is not failed or len(self.target.endpoints) == 1 or self._closed:
            return
        self._index = (self._index + 1) % len(self.target.endpoints)
        self._conn = None  # dialled on next use
        log.warning("etcd %s failed (%s); using %s", failed.endpoint, why, self.target.endpoints[self._index])
        # Calls still running on the old channel finish within their timeout; watches on it
        # reconnect to the new one when it closes.
        task = asyncio.get_running_loop().create_task(self._close_later(failed.channel))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def _close_later(self, channel: grpc.aio.Channel) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2 * self.timeout_s):
                await self._closed_event.wait()
        await channel.close()

    async def _call(self, what: str, fn: Callable[[_Conn], Awaitable[T]]) -> T:
        """One unary call; on UNAVAILABLE it is repeated on each other endpoint in turn."""
        tries = len(self.target.endpoints)
        reauthed = False
        while True:
            conn = await self._connected()
            try:
                with self._mapped(what):
                    try:
                        return await fn(conn)
                    except grpc.aio.AioRpcError as e:
                        if e.code() == grpc.StatusCode.UNAUTHENTICATED and _TOKEN_EXPIRED in (e.details() or ""):
                            if not reauthed and self.target.user is not None:
                                reauthed = True
                                conn.authenticated = False
                                continue
                        raise
            except StoreUnavailable as e:
                self._rotate(conn, str(e))
                tries -= 1
                # A timed-out call may have been applied: only an UNAVAILABLE one is repeated.
                if (
                    tries <= 0
                    or not isinstance(e.__cause__, grpc.aio.AioRpcError)
                    or (e.__cause__.code() != grpc.StatusCode.UNAVAILABLE)
                ):
                    raise

    @contextlib.contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        """One unary call: its gRPC errors as store errors, its outcome noted in `health`."""
        token = self.health.sent()
        try:
            yield
        except grpc.aio.AioRpcError as e:
            # grpc reports a call cancelled with its task as CANCELLED; that is the task's
            # cancellation, not a store error, and must not be swallowed by error handling.
            task = asyncio.current_task()
            if e.code() == grpc.StatusCode.CANCELLED and task is not None and task.cancelling():
                self.health.dropped(token)
                raise asyncio.CancelledError from e
            if e.code() in _UNAVAILABLE_CODES:
                self.health.unanswered(token)
            else:
                self.health.answered(token)
            raise _map_rpc_error(e, what) from e
        except BaseException:
            self.health.dropped(token)
            raise
        self.health.answered(token)

    def responsive(self) -> bool:
        return self.health.responsive()

    # -- KVStore ---------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        request = rpc.RangeRequest(key=key.encode())
        resp = await self._call("get", lambda c: c.kv.Range(request, timeout=self.timeout_s, metadata=c.metadata))
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def range_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        key, end = _prefix_range(prefix)
        # Without sort options etcd returns keys in ascending byte order, which for UTF-8
        # is code-point order, so it matches sorting the decoded strings.
        request = rpc.RangeRequest(key=key, range_end=end)
        resp = await self._call("range", lambda c: c.kv.Range(request, timeout=self.timeout_s, metadata=c.metadata))
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

    async def range_page(
        self, prefix: str, after: str | None, limit: int, revision: int
    ) -> tuple[list[KeyValue], int, bool]:
        key, end = _prefix_range(prefix)
        if after is not None:
            key = after.encode() + b"\0"  # the next key after `after`
        request = rpc.RangeRequest(key=key, range_end=end, limit=limit, revision=revision)
        try:
            resp = await self._call("range", lambda c: c.kv.Range(request, timeout=self.timeout_s, metadata=c.metadata))
        except StoreError as e:
            if "has been compacted" in str(e):
                raise Compacted(revision) from None
            raise
        # Read at a past revision, the header still carries the current one: keep ours.
        return [_kv(kv) for kv in resp.kvs], revision or int(resp.header.revision), bool(resp.more)

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        request = rpc.PutRequest(key=key.encode(), value=value, lease=lease)
        resp = await self._call("put", lambda c: c.kv.Put(request, timeout=self.timeout_s, metadata=c.metadata))
        return int(resp.header.revision)

    async def txn(self, compares: Sequence[Compare], ops: Sequence[Op]) -> TxnResult:
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
        resp = await self._call("txn", lambda c: c.kv.Txn(request, timeout=self.timeout_s, metadata=c.metadata))
        return TxnResult(succeeded=bool(resp.succeeded), revision=int(resp.header.revision))

    async def grant_lease(self, ttl_s: int) -> int:
        request = rpc.LeaseGrantRequest(TTL=ttl_s)
        resp = await self._call(
            "lease grant", lambda c: c.lease.LeaseGrant(request, timeout=self.timeout_s, metadata=c.metadata)
        )
        if resp.error:
            raise StoreError(f"etcd lease grant: {resp.error}")
        return int(resp.ID)

    async def keep_alive(self, lease_id: int, timeout_s: float | None = None) -> int:
        deadline = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)

        async def once(conn: _Conn) -> Any:
            # LeaseKeepAlive is a bidi stream; one request and its one reply make a refresh.
            call = conn.lease.LeaseKeepAlive(
                iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]), timeout=deadline, metadata=conn.metadata
            )
            try:
                return await call.read()
            finally:
                call.cancel()

        reply = await self._call("lease keep-alive", once)
        if reply is grpc.aio.EOF:
            raise StoreUnavailable("etcd lease keep-alive: stream ended without a reply")
        ttl = int(reply.TTL)
        if ttl <= 0:
            raise LeaseExpired(f"lease {lease_id:x} expired or unknown")
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        request = rpc.LeaseRevokeRequest(ID=lease_id)
        try:
            await self._call(
                "lease revoke", lambda c: c.lease.LeaseRevoke(request, timeout=self.timeout_s, metadata=c.metadata)
            )
        except LeaseExpired:
            pass  # revoking an absent lease is a no-op by contract

    async def lease_ttl(self, lease_id: int) -> LeaseTTL | None:
        request = rpc.LeaseTimeToLiveRequest(ID=lease_id)
        try:
            resp = await self._call(
                "lease time-to-live",
                lambda c: c.lease.LeaseTimeToLive(request, timeout=self.timeout_s, metadata=c.metadata),
            )
        except LeaseExpired:
            return None
        if resp.TTL < 0:  # etcd's word for an unknown (expired or revoked) lease
            return None
        return LeaseTTL(remaining_s=int(resp.TTL), granted_s=int(resp.grantedTTL))

    async def compact(self, revision: int) -> None:
        request = rpc.CompactionRequest(revision=revision)
        try:
            await self._call("compact", lambda c: c.kv.Compact(request, timeout=self.timeout_s, metadata=c.metadata))
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
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.channel.close()
        for task in list(self._retired):
            await task

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
            conn: _Conn | None = None
            try:
                conn = await self._connected()
                call = conn.watch()
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
                    self.health.answered()
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
                if conn is not None and _TOKEN_EXPIRED in detail:
                    conn.authenticated = False  # authenticate again before re-creating it
                elif conn is not None:
                    self._rotate(conn, f"watch: {detail}")
            except asyncio.CancelledError:
                # A cancellation of the consuming task itself must propagate. Otherwise the
                # stream was cancelled under us: by close() (end quietly) or by a channel
                # retired after a move to another endpoint (resume there).
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                if self._closed:
                    return
                log.info("etcd watch %r stream cancelled; resuming from %d", prefix, next_rev)
            finally:
                if call is not None:
                    call.cancel()
                    self._watch_calls.discard(call)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):  # wait_for could swallow a cancel here
                    await self._closed_event.wait()
            backoff = min(backoff * 2, BACKOFF_MAX_S)
