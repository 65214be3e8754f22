"""Leader election among instances over the KVStore seam (etcd's concurrency-election scheme).

Scheme
------
* Every candidate creates `<prefix><candidate id>` once (create-if-absent: Compare on
  mod_revision 0) on its lease, and never updates it. The key's create_revision is its
  place in line.
* The leader is the candidate whose key has the lowest create_revision (`leader_of`, a
  pure function of the keys). Every candidate mirrors the prefix through a watch and
  re-evaluates after each revision, so all views at one revision name the same leader.
* A candidate leads only while (a) its mirror says so, (b) the key in the mirror is the one
  *it* created (same create_revision; a key with its id left on another lease by an earlier
  incarnation is waited out, one on its current lease adopted), and (c) it confirmed the key
  less than one TTL ago. Confirming = reading the key, then keeping its lease alive: a
  keep-alive sent at t that succeeds keeps the key until at least t + TTL, so while (c)
  holds no one else can have seen the key go (barring clock-rate drift against etcd's).
* The own key is checked every TTL/3 and at once when the watch shows it deleted. When it is
  gone (its lease expired while the process was frozen or cut off), the candidate creates
  it again on its current lease, and so goes to the back of the line. A shared
  `LeaseKeeper`'s re-grant is picked up from its `lease_id` at the next check.

Stepping down after a freeze: leadership lasts one TTL past the last confirmation unless
renewed, whatever else happens. A process frozen past its TTL resumes with `is_leader`
already False (the property checks the clock), a timer fires `on_change(False)` first
thing, and the check then finds the key gone (etcd expired the lease) and re-joins at the
back of the line; the resumed watch delivers the deletion as well. The same guard turns a
store outage (or a hung store call) longer than the TTL into lost leadership; it comes back
once the key is confirmed again. Leader-only writes that must not race a successor can add
`fence()` (a Compare on the leader's own key) to their transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable

from meshd.kv.lease import LeaseKeeper
from meshd.kv.store import (
    Compacted,
    Compare,
    Event,
    KeyValue,
    KVStore,
    LeaseExpired,
    StoreError,
    StoreUnavailable,
    delete_if,
    put_if,
)

log = logging.getLogger(__name__)

_MIN_CHECK_INTERVAL_S = 0.2
_BACKOFF_MAX_S = 2.0


def leader_of(kvs: Iterable[KeyValue], prefix: str = "") -> str | None:
    """The candidate id whose key directly under `prefix` was created first (ties: by key)."""
    best: KeyValue | None = None
    for kv in kvs:
        if not kv.key.startswith(prefix):
            continue
        cid = kv.key[len(prefix) :]
        if not cid or "/" in cid:
            continue
        if best is None or (kv.create_revision, kv.key) < (best.create_revision, best.key):
            best = kv
    return best.key[len(prefix) :] if best is not None else None


class Election:
    """One candidate in the election under `prefix`.

    `lease`: share the instance's `LeaseKeeper` (already started; the owner starts and
    stops it, and its TTL is the one that counts); without it the election keeps its own
    lease of `ttl_s` seconds. `on_change(leading)` runs whenever this candidate's
    leadership changes, from the event loop: the election's tasks and timer, or
    `start()`/`resign()`/`stop()`.
    """

    def __init__(
        self,
        store: KVStore,
        prefix: str,
        candidate_id: str,
        value: bytes,
        ttl_s: int,
        lease: LeaseKeeper | None = None,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not candidate_id or "/" in candidate_id:
            raise ValueError(f"invalid candidate id {candidate_id!r} (non-empty, no '/')")
        self.store = store
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.candidate_id = candidate_id
        self.key = self.prefix + candidate_id
        self.value = value
        self._own_lease = lease is None
        self.lease = lease if lease is not None else LeaseKeeper(store, ttl_s, on_new_lease=self._on_new_lease)
        self.ttl_s = float(self.lease.ttl_s)
        self.on_change = on_change
        self._clock = clock
        self._interval = max(self.ttl_s / 3, _MIN_CHECK_INTERVAL_S)

        self._mirror: dict[str, KeyValue] = {}  # key -> kv (create_revision tracked from events)
        self._revision = 0  # revision the mirror reflects
        self._own_rev = 0  # create_revision of the key this candidate holds (0: none)
        self._stale_rev = 0  # a key of ours to delete (resign/stop whose delete failed)
        self._confirmed_at = float("-inf")  # when the own key was last confirmed in the store
        self._campaigning = False
        self._running = False
        self._leading = False
        self._changed = asyncio.Event()  # replaced and set on every evaluation
        self._kick = asyncio.Event()
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._expiry: asyncio.TimerHandle | None = None

    # ---- state ---------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        """True only while this candidate leads and confirmed its key less than a TTL ago."""
        return self._leading and self._clock() - self._confirmed_at < self.ttl_s

    @property
    def leader_id(self) -> str | None:
        """Who the keys say leads (in this candidate's mirror), whether or not it is alive."""
        return leader_of(self._mirror.values(), self.prefix)

    @property
    def candidates(self) -> list[str]:
        """Candidate ids in line order (creation order), as this candidate's mirror has them."""
        kvs = sorted(self._mirror.values(), key=lambda kv: (kv.create_revision, kv.key))
        ids = [kv.key[len(self.prefix) :] for kv in kvs]
        return [cid for cid in ids if cid and "/" not in cid]

    @property
    def leader_value(self) -> bytes | None:
        leader = self.leader_id
        return self._mirror[self.prefix + leader].value if leader is not None else None

    @property
    def revision(self) -> int:
        return self._revision

    def fence(self) -> Compare | None:
        """A Compare that holds only while this candidate's key is unchanged (None: not leader)."""
        return Compare(self.key, self._own_rev) if self.is_leader else None

    async def wait_until_leader(self) -> None:
        """Return once this candidate leads; RuntimeError if the election is (or gets) stopped."""
        while not self.is_leader:
            if not self._running:
                raise RuntimeError("election is not running")
            await self._changed.wait()

    # ---- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        """Join the election. Store errors propagate (startup fails fast)."""
        if self._own_lease:
            await self.lease.start()
        elif not self.lease.lease_id:
            raise RuntimeError("a shared LeaseKeeper must be started before the election")
        self._running = True
        self._campaigning = True
        try:
            async with self._lock:
                await self._check_own_key()
            await self._relist()
        except BaseException:
            self._running = self._campaigning = False
            if self._own_rev:
                with contextlib.suppress(StoreError):
                    await delete_if(self.store, self.key, self._own_rev)
                self._own_rev = 0
            if self._own_lease:
                await self.lease.stop(revoke=True)
            raise
        self._evaluate()
        self._tasks = [
            asyncio.create_task(self._watch(), name=f"election watch {self.key}"),
            asyncio.create_task(self._tend(), name=f"election check {self.key}"),
        ]

    async def resign(self, rejoin: bool = False) -> None:
        """Step down at once and delete the own key, so the next in line leads.

        Without `rejoin` the candidate leaves the election (it keeps following who leads);
        with it, a fresh key puts it at the back of the line. If the store fails, the
        error propagates and the delete is retried in the background.
        """
        if not self._running:
            raise RuntimeError("election is not running")
        self._campaigning = rejoin
        if self._own_rev:
            self._stale_rev, self._own_rev = self._own_rev, 0
        self._evaluate()  # step down before anyone else can see the key gone
        async with self._lock:
            await self._tend_once()
        self._evaluate()

    async def stop(self) -> None:
        """Leave the election: stop the tasks, delete the own key, release an own lease."""
        self._running = False
        self._campaigning = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._mirror.clear()
        rev, self._own_rev = self._own_rev, 0
        self._evaluate()
        for r in (rev, self._stale_rev):
            if r:
                with contextlib.suppress(StoreError):
                    await delete_if(self.store, self.key, r)
        self._stale_rev = 0
        if self._own_lease:
            await self.lease.stop(revoke=True)

    # ---- decisions -----------------------------------------------------------------
    def _decide(self) -> bool:
        if not self._running or not self._own_rev:
            return False
        mine = self._mirror.get(self.key)
        return (
            mine is not None
            and mine.create_revision == self._own_rev
            and leader_of(self._mirror.values(), self.prefix) == self.candidate_id
            and self._clock() - self._confirmed_at < self.ttl_s
        )

    def _evaluate(self) -> None:
        leading = self._decide()
        if leading != self._leading:
            self._leading = leading
            log.info(
                "%s %s leadership of %s (leader: %s, revision %d)",
                self.candidate_id,
                "took" if leading else "lost",
                self.prefix,
                self.leader_id,
                self._revision,
            )
            if self.on_change is not None:
                try:
                    self.on_change(leading)
                except Exception:
                    log.exception("election on_change hook failed")
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._leading:  # re-evaluate when the confirmation runs out, even if a store call hangs
            remaining = self._confirmed_at + self.ttl_s - self._clock()
            self._expiry = asyncio.get_running_loop().call_later(max(remaining, 0.0), self._evaluate)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _lost_key(self, revision: int) -> None:
        """The own key is absent at `revision`; it is lost if it existed by then."""
        if self._own_rev and revision >= self._own_rev:
            log.warning("%s: election key %s is gone (revision %d)", self.candidate_id, self.key, revision)
            self._own_rev = 0
            self._kick.set()

    # ---- own key ---------------------------------------------------------------------
    async def _on_new_lease(self, lease_id: int) -> None:
        self._kick.set()

    async def _tend_once(self) -> None:
        if self._stale_rev:
            await delete_if(self.store, self.key, self._stale_rev)  # no-op if already replaced
            self._stale_rev = 0
        if self._campaigning:
            await self._check_own_key()

    async def _check_own_key(self) -> None:
        """Confirm the own key in the store, or (re-)create it on the current lease."""
        own_rev = self._own_rev
        kv = await self.store.get(self.key)
        if self._own_rev != own_rev:
            return  # the watch changed our state meanwhile; look again next time
        if kv is not None and (
            (own_rev and kv.create_revision == own_rev)
            # On our current lease, so this process's key (e.g. an earlier Election's): adopt it.
            or (self.lease.lease_id and kv.lease == self.lease.lease_id)
        ):
            self._own_rev = kv.create_revision
            await self._confirm(kv.create_revision, kv.lease)
            return
        if own_rev:
            log.warning("%s: election key %s is gone or replaced", self.candidate_id, self.key)
            self._own_rev = 0
        if kv is not None:
            return  # held by an earlier incarnation on another lease: wait for it to expire
        lease_id = self.lease.lease_id
        res = await put_if(self.store, self.key, self.value, 0, lease=lease_id)
        if not res.succeeded:
            self._kick.set()  # created by someone meanwhile: look at it again
        elif self._campaigning:
            self._own_rev = res.revision
            await self._confirm(res.revision, lease_id)
        else:  # resigned while the create was in flight: take it back
            self._stale_rev = res.revision
            self._kick.set()

    async def _confirm(self, rev: int, lease_id: int) -> None:
        """Keep alive the lease of the own key (known to exist, created at `rev`).

        A keep-alive sent at t that succeeds means the lease, and so the key, lives until at
        least t + TTL (only an explicit delete could remove it sooner): that is how long the
        leadership may be trusted without hearing from the store again.
        """
        sent = self._clock()
        if lease_id:
            try:
                await self.store.keep_alive(lease_id)
            except LeaseExpired:
                if self._own_rev == rev:
                    log.warning("%s: the lease of election key %s expired", self.candidate_id, self.key)
                    self._own_rev = 0
                    self._kick.set()
                return
        if self._own_rev == rev:
            self._confirmed_at = sent

    async def _tend(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._kick.wait()
            self._kick.clear()
            self._evaluate()  # first: a resumed process drops stale leadership at once
            try:
                async with self._lock:
                    await self._tend_once()
            except StoreError as e:
                log.debug("election check of %s failed: %s", self.key, e)
            except Exception:
                log.exception("election check of %s failed", self.key)
            self._evaluate()

    # ---- mirror ----------------------------------------------------------------------
    def _apply(self, ev: Event) -> None:
        if ev.kind == "delete":
            self._mirror.pop(ev.key, None)
            if ev.key == self.key:
                self._lost_key(ev.mod_revision)
            return
        old = self._mirror.get(ev.key)
        created = old.create_revision if old is not None else ev.mod_revision
        self._mirror[ev.key] = KeyValue(ev.key, ev.value, ev.mod_revision, created)

    async def _relist(self) -> None:
        kvs, revision = await self.store.range_prefix(self.prefix)
        self._mirror = {kv.key: kv for kv in kvs}
        self._revision = revision
        mine = self._mirror.get(self.key)
        if mine is None or mine.create_revision != self._own_rev:
            self._lost_key(revision)

    async def _watch(self) -> None:
        backoff = 0.1
        while True:
            try:
                watch = self.store.watch_prefix(self.prefix, self._revision + 1)
                try:
                    async for events in watch:
                        for ev in events:
                            self._apply(ev)
                        if events:
                            self._revision = events[-1].mod_revision
                        self._evaluate()
                        backoff = 0.1
                finally:
                    aclose = getattr(watch, "aclose", None)
                    if aclose is not None:
                        await aclose()
            except Compacted:
                log.warning("election watch on %s compacted; re-listing", self.prefix)
                await self._relist_until_ok()
            except StoreUnavailable as e:
                log.warning("election watch on %s interrupted: %s", self.prefix, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("election watch on %s failed; re-listing", self.prefix)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                await self._relist_until_ok()
            else:
                return  # the store closed the watch (shutdown)

    async def _relist_until_ok(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._relist()
                self._evaluate()
                return
            except StoreError:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
