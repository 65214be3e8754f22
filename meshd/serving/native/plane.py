"""The native data plane's control loop: HAProxy's maps kept equal to what this instance knows.

Every `interval_s` (and soon after a change of local copies) the plane computes the routes
(`routes`) and sends HAProxy only the differences; each poll of the counters table feeds
the requests HAProxy carried to the local runtime back to the cache (last use, and uses for
the counting orders) and to the rates copy scaling reads; a poll of the arrivals table feeds
those that came from clients (carried here or to a peer) to the load queue's popularity, as
the Python path counts its own. An eviction calls `withdraw` before it unloads: the route
goes first, then the copy's native requests in flight finish (bounded), then the
runtime unloads. If HAProxy exits, the plane starts it again and re-sends every map.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from meshd.core import hostport
from meshd.core.records import ModelRecord, VModelRecord
from meshd.decisions.cache import State
from meshd.decisions.placement.view import ClusterView
from meshd.kv.table import Table
from meshd.serving.invocations import LOCAL
from meshd.serving.local import LocalModels
from meshd.serving.native.haproxy import HAProxy, HAProxyError
from meshd.serving.native.haproxy_config import (
    ARRIVALS_TABLE,
    COUNTERS_TABLE,
    PEER_BACKEND,
    Layout,
    map_key_ok,
    parse_table,
)
from meshd.serving.native.routes import (
    LocalCopy,
    assign_slots,
    carried_since,
    local_routes,
    map_changes,
    native_peers,
    peer_routes,
    runtime_api_commands,
)

log = logging.getLogger("meshd.native")

SYNC_INTERVAL_S = 0.25
COUNTERS_EVERY = 4  # polls of the counters table: one per this many syncs (1 s)
WITHDRAW_WAIT_S = 30.0  # the Python path's bound on an unload waiting for requests in flight
WITHDRAW_POLL_S = 0.02
MAX_WANTED = 50_000  # models asked of this instance that peer routes are kept for
PEER_ROUTES_EVERY_S = 1.0  # peer routes made again at least this often (copies age into "loaded")
RESTART_BACKOFF_S = 1.0


@dataclass
class NativeCounts:
    """What the native data plane did, for tests, logs and benchmarks."""

    carried: int = 0  # requests the counters say HAProxy carried to the local runtime
    syncs: int = 0
    map_commands: int = 0
    restarts: int = 0
    withdrawn: int = 0


def split_address(address: str) -> tuple[str, int] | None:
    """(ip, port) of a peer's native port (`ip:port`, `[v6]:port`, or `v6:port` as an older
    record may hold it); None when HAProxy could not dial it without DNS."""
    try:
        host, port = hostport.split(address)
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host, port


class NativePlane:
    def __init__(
        self,
        haproxy: HAProxy,
        layout: Layout,
        local: LocalModels,
        models: Table[ModelRecord],
        vmodels: Table[VModelRecord],
        view: Callable[[], ClusterView],
        native_methods: Callable[[], Mapping[str, str]],
        assume_loaded_ms: Callable[[str], int],
        clock: Callable[[], int],
        interval_s: float = SYNC_INTERVAL_S,
    ) -> None:
        self.haproxy = haproxy
        self.layout = layout
        self.local = local
        self.models = models
        self.vmodels = vmodels
        self.view = view
        self.native_methods = native_methods
        self.assume_loaded_ms = assume_loaded_ms  # model type -> horizon now (LoadQueue.assume_loaded)
        self.clock = clock
        self.interval_s = interval_s
        self.counts = NativeCounts()
        self.describe = "HAProxy"  # for the start-up line: version, executable, port
        self._maps: dict[str, dict[str, str]] = {}  # map file -> what HAProxy holds
        self._slots: dict[str, str] = {}  # peer slot -> instance id
        self._slot_addr: dict[str, str] = {}  # peer slot -> address set on its server
        self._vmodels_revision = -1
        self._requests: dict[str, int] = {}  # model -> http_req_cnt at the last poll
        self._arrived: dict[str, int] = {}  # the same, of the arrivals table
        self._wanted: OrderedDict[str, None] = OrderedDict()
        self._wanted_changes = 0  # bumped when a model joins `_wanted`
        self._peer_key: object = None  # what the peer routes were last made from
        self._peer_at = 0.0
        self._lock = asyncio.Lock()
        self._kicked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._polls = 0

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        await self.haproxy.start()
        self._reset()
        await self.sync()
        self._task = asyncio.create_task(self._run(), name="native data plane")

    async def stop(self) -> None:
        """Stop carrying: HAProxy stops listening and finishes the streams in flight."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.haproxy.stop()

    def _reset(self) -> None:
        paths = (self.layout.methods_map, self.layout.local_map, self.layout.peers_map, self.layout.vmodels_map)
        self._maps = {p: {} for p in paths}
        self._slots = {}
        self._slot_addr = {}
        self._vmodels_revision = -1
        self._requests = {}
        self._arrived = {}
        self._peer_key = None

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kicked.wait(), self.interval_s)
            self._kicked.clear()
            try:
                if not self.haproxy.running:
                    log.warning("haproxy exited (code %s); starting it again", self._exit_code())
                    self.counts.restarts += 1
                    await asyncio.sleep(RESTART_BACKOFF_S)
                    await self.haproxy.start()
                    self._reset()
                await self.sync()
                self._polls += 1
                if self._polls % COUNTERS_EVERY == 0:
                    await self.poll_counters()
            except (OSError, HAProxyError) as e:
                log.warning("native data plane: %s", e)
            except Exception:  # the loop must outlive any one bad round: routes would freeze
                log.exception("native data plane: a sync failed")

    def _exit_code(self) -> int | None:
        return self.haproxy.proc.returncode if self.haproxy.proc is not None else None

    def served_by(self, backend: str) -> str:
        """Who served a carried call, from the backend HAProxy logged: LOCAL or a peer's id."""
        if backend.startswith(PEER_BACKEND):
            return self._slots.get(backend[len(PEER_BACKEND) :], "peer")
        return LOCAL

    # ---- what the Python path tells the plane -----------------------------------------
    def kick(self) -> None:
        """Local copies changed: sync soon."""
        self._kicked.set()

    def noticed(self, model_id: str) -> None:
        """The Python path was asked for `model_id` and had no local copy to serve it."""
        wanted = self._wanted
        if model_id in wanted:
            wanted.move_to_end(model_id)
            return
        wanted[model_id] = None
        self._wanted_changes += 1
        if len(wanted) > MAX_WANTED:
            wanted.popitem(last=False)
        self._kicked.set()

    async def withdraw(self, model_id: str) -> None:
        """Before an unload: no new native request for the copy, then those in flight end
        (whether the route went here or in a sync that saw the copy leave the cache)."""
        async with self._lock:
            local = self._maps.get(self.layout.local_map, {})
            if model_id in local:
                try:
                    await self.haproxy.commands([f"del map {self.layout.local_map} {model_id}"])
                except (OSError, HAProxyError) as e:
                    log.warning("native data plane: could not withdraw %s: %s", model_id, e)
                    return
                del local[model_id]
                self.counts.withdrawn += 1
        if not map_key_ok(model_id):
            return  # never carried natively
        deadline = time.monotonic() + WITHDRAW_WAIT_S
        while time.monotonic() < deadline:
            try:
                row = parse_table(await self.haproxy.command(f"show table {COUNTERS_TABLE} key {model_id}"))
            except (OSError, HAProxyError):
                return  # HAProxy is gone: nothing of it is in flight
            counters = row.get(model_id)
            if counters is None or counters.inflight == 0:
                return
            await asyncio.sleep(WITHDRAW_POLL_S)

    # ---- sync -------------------------------------------------------------------------
    async def sync(self) -> None:
        async with self._lock:
            self.counts.syncs += 1
            layout = self.layout
            local = self.local
            copies = (LocalCopy(e.model_id, e.state is State.LOADED, e.gate is not None) for e in local.cache.entries())
            here = local_routes(copies, local.runtime_up)
            desired: dict[str, Mapping[str, str]] = {
                layout.methods_map: {m: how for m, how in self.native_methods().items() if map_key_ok(m)},
                layout.local_map: {m: "1" for m in here},
            }
            view = self.view()
            natives = native_peers(view, lambda address: split_address(address) is not None)
            await self._set_slots(assign_slots(self._slots, natives, layout.peer_slots), natives)
            slot_of = {inst: slot for slot, inst in self._slots.items()}
            # Peer routes cost a placement decision per model asked of this instance: made again
            # when something they read changed, else once a second (copies age into "loaded").
            inputs = (self.models.revision, self._wanted_changes, tuple(sorted(slot_of.items())), view.unreachable)
            now = time.monotonic()
            if inputs != self._peer_key or now - self._peer_at >= PEER_ROUTES_EVERY_S:
                self._peer_key, self._peer_at = inputs, now
                desired[layout.peers_map] = peer_routes(
                    list(self._wanted), _Records(self.models), view, natives, slot_of, self.assume_loaded_ms, here
                )
            else:  # only the local copies changed: a model served here needs no peer route
                desired[layout.peers_map] = {m: b for m, b in self._maps[layout.peers_map].items() if m not in here}
            if self.vmodels.revision != self._vmodels_revision:
                self._vmodels_revision = self.vmodels.revision
                desired[layout.vmodels_map] = {
                    vid: v.active_model
                    for vid, v in self.vmodels.items()
                    if map_key_ok(vid) and map_key_ok(v.active_model)
                }
            commands: list[str] = []
            for path, want in desired.items():
                current = self._maps[path]
                changes = map_changes(current, want)
                if changes:
                    commands += runtime_api_commands(path, current, changes)
                    for key in changes.delete:
                        del current[key]
                    current.update(changes.put)
            if commands:
                self.counts.map_commands += len(commands)
                await self.haproxy.commands(commands)

    async def _set_slots(self, slots: dict[str, str], natives: Mapping[str, str]) -> None:
        commands: list[str] = []
        for slot in sorted(set(self._slots) | set(slots), key=int):
            server = f"{PEER_BACKEND}{slot}/peer"
            inst = slots.get(slot)
            if inst is None:
                commands.append(f"set server {server} state maint")
                self._slot_addr.pop(slot, None)
                continue
            address = natives[inst]
            if self._slot_addr.get(slot) != address:
                host, port = split_address(address) or ("127.0.0.1", 1)
                commands += [f"set server {server} addr {host} port {port}", f"set server {server} state ready"]
                self._slot_addr[slot] = address
        self._slots = slots
        if commands:
            answer = await self.haproxy.command(";".join(commands))
            if "unknown" in answer.lower() or "no such" in answer.lower():
                raise HAProxyError(f"haproxy refused a peer address: {answer.strip()[:200]}")

    # ---- counters ---------------------------------------------------------------------
    async def poll_counters(self) -> None:
        """Requests carried natively since the last poll: uses for the cache, load for the rates,
        arrivals for the load queue's popularity."""
        rows = parse_table(await self.haproxy.command(f"show table {COUNTERS_TABLE}"))
        arrivals = parse_table(await self.haproxy.command(f"show table {ARRIVALS_TABLE}"))
        now = self.clock()
        local = self.local
        counted = {m: r.requests for m, r in rows.items()}
        for model_id, delta in carried_since(self._requests, counted).items():
            self.counts.carried += delta
            local.counters.requests += delta
            local.counters.hits += delta
            local.counters.served += delta
            entry = local.cache.get(model_id)
            if entry is not None:
                entry.served += delta
                local.cache.touch(model_id, now, uses=delta)
        self._requests = counted
        arrived = {m: r.requests for m, r in arrivals.items()}
        for model_id, delta in carried_since(self._arrived, arrived).items():
            local.popularity.count(model_id, delta)
        self._arrived = arrived


class _Records(Mapping[str, ModelRecord]):
    """The models table as a read-only mapping (no copy of the whole table)."""

    def __init__(self, table: Table[ModelRecord]) -> None:
        self.table = table

    def __getitem__(self, key: str) -> ModelRecord:
        record = self.table.get(key)
        if record is None:
            raise KeyError(key)
        return record

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(k for k, _ in self.table.items())

    def __len__(self) -> int:
        return len(self.table)
