"""Copies of one language model on the virtual clock, routed by the daemon's own rules (issue
43): `python -m sim llm`.

    python -m sim llm                                   # 3 copies, load against inflight, seeds 1-3
    python -m sim llm --copies 1 --add-copies --requests 600   # copies added when queues stay deep

One front instance routes every call, as each of bench/llm_routing.py's fronts does, to copies
on instances of their own, each copy an engine of `sim.llm_engine` (fake_llm's). The decisions
are meshd's, called as the daemon calls them:

- `load` (MESHD_LLM_ROUTING=load, the default): `placement.llm.choose_llm_copy` with the
  front's calls in flight to each copy, the copies' engine readings that are fresh
  (`placement.llm.fresh`), and the prefix's last copy (`placement.llm.PrefixOwners`, keyed by
  `placement.llm.prefix_key` of the call's body);
- `inflight` (MESHD_LLM_ROUTING=inflight, meshd before): `placement.serving.choose_copy`, the
  fewest calls in flight, ties to the oldest last use in the instances' records (published by
  `publishing.publish_due`: a last use alone at most every 40 s);
- with `--add-copies`, at each rate check every loaded copy runs the scaler's rule: its rate
  (`scaling.copy_rpm`) counts as at the threshold when `placement.llm.queue_stays_deep` says
  its engine's queue stayed deep and no copy is loading (`placement.llm.copies_loading`, with
  the daemon's guess of a load's end: here exactly `--load-s`), then `scaling.decide_copies`
  (which adds none while another copy's load began within 2 checks + 2 x `--load-s`);
  an added copy goes to an instance holding none and serves after `--load-s`.

Readings are as fresh as the daemon's: each engine's metrics are read every `READ_EVERY_MS`
(the runtime's `READ_EVERY_S`); a reading reaches the front only with a call it sends to that
copy (the peer's `meshd-engine-load` when it accepts the call: the calls in flight to the copy
then, and the engine's reading that the copy's runtime sent with its last first answer, while
that is no older than `FRESH_MS`), and the front drops it after `FRESH_MS`. The holder counts
that reading of its engine's queue, at each first answer, for copy scaling.

Simplified: one front (calls entering at several would each keep their own counts, readings
and prefix memory); no time for hops, the runtime and the HTTP relay (the bench's figures
include them: a few ms); a copy counts as loaded at the front exactly when its load ends (the
daemon guesses, a third of the loading timeout after it began); records are checked for
publication on a 2 s grid (the daemon checks every 0.5 s, at least 2 s apart).
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshd.core.records import InstanceRecord
from meshd.decisions.placement import llm as rules
from meshd.decisions.placement import scaling, serving
from meshd.decisions.placement.view import ClusterView, InstanceView
from meshd.decisions.publishing import PUBLISH_MIN_INTERVAL_MS, publish_due
from sim.args import positive_float, positive_int
from sim.llm_engine import BLOCK_TOKENS, Call, Engine, PrefixCache, Reading

READ_EVERY_MS = 250  # meshd.adapter.llm.load.READ_EVERY_S (a test holds them equal)
ROUTINGS = ("load", "inflight")
FRONT = "front"
MODEL = "chat"
SYSTEM_PROMPTS = 8  # bench/llm_routing.py's mix
SHARED = 0.6
QUESTION_WORDS = 16


@dataclass(frozen=True, slots=True)
class Mix:
    """The calls: bench/llm_routing.py's workload (the same prompts and times for a seed)."""

    requests: int = 180
    rate: float = 6.0  # calls per second, Poisson
    system_words: int = 300
    own_words: int = 150
    tokens: int = 32  # max_tokens of each answer


@dataclass(frozen=True, slots=True)
class Setup:
    """The copies and their engines (bench/llm_routing.py's engine flags by default)."""

    copies: int = 3
    instances: int = 6  # instances that could hold a copy, one each
    add_copies: bool = False  # copy scaling (the bench keeps its 3 copies)
    load_ms: float = 20_000.0  # an added copy's load
    max_running: int = 4
    prefill_ms_per_token: float = 1.0
    token_ms: float = 20.0
    cache_tokens: int = 2048
    rate_check_ms: int = scaling.RATE_CHECK_INTERVAL_MS
    readings: bool = True  # False: the front routes by its own counts only (an experiment, not a setting)


@dataclass
class Outcome:
    routing: str
    seed: int
    ttft_ms: list[float]
    hits: float  # prompt tokens found in the engines' prefix caches / looked up
    served: list[int]  # calls each copy served, in the order the copies were placed
    added_s: list[float] = field(default_factory=list)  # when copy scaling added each copy (s)
    dropped: int = 0

    def pct(self, q: float) -> float:
        """bench/llm_routing.py's percentile."""
        values = sorted(self.ttft_ms)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1_000_000)}" for _ in range(n))


def workload(mix: Mix, seed: int) -> list[tuple[float, str]]:
    """(arrival s, prompt) of each call, drawn as bench/llm_routing.py's `workload` draws them."""
    rng = random.Random(seed)
    systems = [_words(rng, mix.system_words) for _ in range(SYSTEM_PROMPTS)]
    at, calls = 0.0, []
    for _ in range(mix.requests):
        at += rng.expovariate(mix.rate)
        if rng.random() < SHARED:
            prompt = rng.choice(systems) + " " + _words(rng, QUESTION_WORDS)
        else:
            prompt = _words(rng, mix.own_words)
        calls.append((at, prompt))
    return calls


def calls_of(mix: Mix, seed: int) -> list[Call]:
    out = []
    for at, prompt in workload(mix, seed):
        words = tuple(prompt.split())
        body = {"model": MODEL, "prompt": prompt, "max_tokens": mix.tokens, "stream": True}
        out.append(Call(at * 1000, words, min(mix.tokens, len(words)), rules.prefix_key(body)))
    return out


# Event kinds (at one instant, events run in the order they were scheduled).
_ARRIVE, _ENGINE_IN, _PREFILLED, _DONE, _READ, _PUBLISH, _CHECK = range(7)


@dataclass
class _Copy:
    iid: str
    engine: Engine
    started_ms: int  # its load began (the model record's date)
    ready_ms: float
    sampled: Reading = field(default_factory=lambda: Reading(0, 0, 0.0))  # its engine's metrics, last read
    noted: rules.Reading | None = None  # at its holder: the runtime's last reading
    depth: tuple[int, int] = (0, 0)  # queue readings at its holder since the last check, fewest waiting
    served_at_check: int = 0
    last_used_ms: int = 0
    record: InstanceRecord | None = None  # its instance's record as last published, and when
    record_ms: int = 0
    dropped: bool = False


@dataclass
class LlmMesh:
    setup: Setup
    routing: str
    copies: dict[str, _Copy] = field(default_factory=dict)
    inflight: dict[str, int] = field(default_factory=dict)  # the front's calls in flight per copy
    readings: dict[str, rules.Reading] = field(default_factory=dict)  # at the front
    owners: rules.PrefixOwners = field(default_factory=rules.PrefixOwners)
    added_ms: list[float] = field(default_factory=list)
    dropped: int = 0
    _events: list[tuple[float, int, int, object]] = field(default_factory=list)  # (ms, seq, kind, data)
    _seq: int = 0
    _open: int = 0  # calls not yet answered

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r} (choose from {', '.join(ROUTINGS)})")
        for _ in range(self.setup.copies):
            self._add_copy(-self.setup.load_ms - 1)

    def run(self, calls: Sequence[Call]) -> None:
        for call in calls:
            self._at(call.arrival_ms, _ARRIVE, call)
        self._open = len(calls)
        self._at(0.0, _READ, None)
        self._at(0.0, _PUBLISH, None)
        if self.setup.add_copies:
            self._at(float(self.setup.rate_check_ms), _CHECK, None)
        while self._events:
            now, _, kind, data = heapq.heappop(self._events)
            if kind == _ARRIVE:
                assert isinstance(data, Call)
                self._route(data, now)
            elif kind == _ENGINE_IN:
                assert isinstance(data, Call)
                self._engine_in(data, now)
            elif kind == _PREFILLED:
                assert isinstance(data, str)
                self._prefilled(self.copies[data], now)
            elif kind == _DONE:
                assert isinstance(data, Call)
                self._done(data, now)
            elif self._open:  # the periodic ones, while calls remain
                self._periodic(kind, now)

    # ---- the front ----------------------------------------------------------------------
    def _view(self, self_id: str, now: float) -> ClusterView:
        """Instances as their records say: one unit of room each (the front none), the
        copy's last use as last published."""
        instances = {FRONT: InstanceView(FRONT)}
        for i in range(1, self.setup.instances + 1):
            iid = f"llm-{i}"
            c = self.copies.get(iid)
            holds = c is not None and not c.dropped
            lru = c.record.lru_time if c is not None and c.record is not None else 0
            instances[iid] = InstanceView(iid, capacity=1, used=int(holds), count=int(holds), lru_time=lru)
        return ClusterView(self_id, int(now), instances)

    def _route(self, call: Call, now: float) -> None:
        view = self._view(FRONT, now)
        held = {iid: c.started_ms for iid, c in self.copies.items() if not c.dropped}
        assume = int(self.setup.load_ms)
        none: frozenset[str] = frozenset()
        if self.routing == "load":
            inflight = {**self.inflight, FRONT: 0}
            loads = rules.fresh(self.readings, int(now), inflight) if self.setup.readings else {}
            owner = self.owners.get(MODEL, call.prefix) if call.prefix is not None else None
            target = rules.choose_llm_copy(view, held, inflight, loads, none, assume, False, owner)
            if target is not None and call.prefix is not None:
                self.owners.served(MODEL, call.prefix, target)
        else:
            target = serving.choose_copy(view, held, self.inflight, none, assume, False, False)
        assert target is not None, "a copy is always held"
        c = self.copies[target]
        call.copy = target
        c.last_used_ms = int(now)
        self.inflight[target] = self.inflight.get(target, 0) + 1
        if now < c.ready_ms:  # sent to a copy still loading: it waits there
            self._at(c.ready_ms, _ENGINE_IN, call)
        else:
            self._engine_in(call, now)
        # The peer's answer on accepting the call (Router.engine_load_here): its calls in flight
        # to the copy, with the engine's reading its runtime last sent while that is fresh, as
        # of now; the front keeps it with its own calls to the copy (all of them, here).
        own = self.inflight[target]
        load = rules.EngineLoad(own)
        if c.noted is not None and now - c.noted.at_ms <= rules.FRESH_MS:
            load = rules.load_now(c.noted, own)
        self.readings[target] = rules.Reading(load, int(now), own)

    # ---- the engines --------------------------------------------------------------------
    def _engine_in(self, call: Call, now: float) -> None:
        ends = self.copies[call.copy].engine.arrive(call, now)
        if ends is not None:
            self._at(ends, _PREFILLED, call.copy)

    def _prefilled(self, c: _Copy, now: float) -> None:
        call, ends = c.engine.prefill_done(now)
        self._at(call.done_ms, _DONE, call)
        if ends is not None:
            self._at(ends, _PREFILLED, c.iid)
        # The runtime's load with the first answer (its engine's last read): the holder keeps it,
        # and counts it as a reading of the engine's queue for copy scaling.
        r, own = c.sampled, self.inflight[c.iid]
        c.noted = rules.Reading(rules.EngineLoad(own, r.waiting, r.running, r.kv_use), int(now), own)
        readings, least = c.depth
        c.depth = (readings + 1, min(least, c.sampled.waiting) if readings else c.sampled.waiting)

    def _done(self, call: Call, now: float) -> None:
        c = self.copies[call.copy]
        ends = c.engine.finish(call, now)
        if ends is not None:
            self._at(ends, _PREFILLED, c.iid)
        self.inflight[call.copy] -= 1
        self._open -= 1

    # ---- reads, records, copy scaling ---------------------------------------------------
    def _periodic(self, kind: int, now: float) -> None:
        if kind == _READ:
            for c in self.copies.values():
                c.sampled = c.engine.reading()
            self._at(now + READ_EVERY_MS, _READ, None)
        elif kind == _PUBLISH:
            for c in self.copies.values():  # a last use alone publishes at most every 40 s
                loading = int(now < c.ready_ms)
                held = int(not c.dropped)
                new = InstanceRecord(c.last_used_ms, held, 1, held, 1, loading)
                if publish_due(c.record, new, c.record_ms, int(now), False):
                    c.record, c.record_ms = new, int(now)
            self._at(now + PUBLISH_MIN_INTERVAL_MS, _PUBLISH, None)
        elif kind == _CHECK:
            self._rate_check(now)
            self._at(now + self.setup.rate_check_ms, _CHECK, None)

    def _rate_check(self, now: float) -> None:
        """loops.scaler's check at each loaded copy's instance."""
        threshold = scaling.DEFAULT_SCALE_UP_RPM_THRESHOLD
        for c in list(self.copies.values()):
            if c.dropped or now < c.ready_ms:
                continue
            depth, c.depth = c.depth, (0, 0)
            rpm = scaling.copy_rpm(c.engine.done, c.served_at_check, self.setup.rate_check_ms)
            c.served_at_check = c.engine.done
            holders = {iid: h.started_ms for iid, h in self.copies.items() if not h.dropped}
            loading = rules.copies_loading(holders, c.iid, int(now), int(self.setup.load_ms))
            if rules.queue_stays_deep(*depth, loading):
                rpm = max(rpm, threshold)
            decision = scaling.decide_copies(
                self._view(c.iid, now),
                holders=holders,
                policy=scaling.DEFAULT_POLICY,
                rpm=rpm,
                threshold_rpm=threshold,
                last_used_ms=c.last_used_ms,
                prior_use_ms=None,
                default_model_units=1,
                recent_load_ms=scaling.recent_load_window_ms(self.setup.rate_check_ms, int(self.setup.load_ms)),
            )
            if decision.drop:
                c.dropped = True  # it finishes what it holds, takes nothing new
                self.dropped += 1
            for _ in range(decision.add):
                if self._add_copy(now) is None:
                    break
                self.added_ms.append(now)

    def _add_copy(self, now: float) -> str | None:
        """A copy on the first instance holding none (all alike): None when every one holds one."""
        for i in range(1, self.setup.instances + 1):
            iid = f"llm-{i}"
            if iid not in self.copies:
                s = self.setup
                engine = Engine(s.max_running, s.prefill_ms_per_token, s.token_ms, PrefixCache(s.cache_tokens))
                self.copies[iid] = _Copy(iid, engine, int(now), now + s.load_ms)
                self.inflight[iid] = 0
                return iid
        return None

    def _at(self, t: float, kind: int, data: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))


def simulate(mix: Mix, setup: Setup, routing: str, seed: int) -> Outcome:
    """One run: `mix`'s calls for `seed` through a front routing by `routing`."""
    mesh = LlmMesh(setup, routing)
    calls = calls_of(mix, seed)
    mesh.run(calls)
    queries = sum(c.engine.cache.queries for c in mesh.copies.values())
    hits = sum(c.engine.cache.hits for c in mesh.copies.values())
    return Outcome(
        routing,
        seed,
        [c.first_token_ms - c.arrival_ms for c in calls],
        hits / queries if queries else 0.0,
        [c.engine.done for c in mesh.copies.values()],
        [t / 1000 for t in mesh.added_ms],
        mesh.dropped,
    )


def table(mix: Mix, setup: Setup, outcomes: Sequence[Outcome]) -> str:
    """Markdown: a row per run, then each routing's medians over its seeds."""
    growth = f" (up to {setup.instances}, added when queues stay deep, {setup.load_ms / 1000:g} s a load)"
    lines = [
        f"## llm: {setup.copies} {'copy' if setup.copies == 1 else 'copies'} of one model"
        + (growth if setup.add_copies else "")
        + f"; engines: {setup.max_running} calls at a time, {setup.prefill_ms_per_token:g} ms a prompt token not "
        f"cached, {mix.tokens} tokens {setup.token_ms:g} ms apart, prefix cache {setup.cache_tokens} tokens in blocks "
        f"of {BLOCK_TOKENS}; {mix.requests} calls at {mix.rate:g}/s, {SHARED:.0%} behind one of {SYSTEM_PROMPTS} "
        f"system prompts of {mix.system_words} words",
        "",
        "| routing | seed | TTFT p50 ms | TTFT p99 ms | prefix hits | calls per copy | copies added |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for routing in dict.fromkeys(o.routing for o in outcomes):
        runs = [o for o in outcomes if o.routing == routing]
        for o in runs:
            lines.append(
                f"| {routing} | {o.seed} | {o.pct(0.5):.0f} | {o.pct(0.99):.0f} | {o.hits:.0%} | "
                f"{'/'.join(map(str, o.served))} | {_added(o)} |"
            )
        if len(runs) > 1:
            width = max(len(o.served) for o in runs)
            per_copy = "/".join(
                str(round(statistics.median(o.served[i] if i < len(o.served) else 0 for o in runs)))
                for i in range(width)
            )
            lines.append(
                f"| {routing} | median | {statistics.median(o.pct(0.5) for o in runs):.0f} | "
                f"{statistics.median(o.pct(0.99) for o in runs):.0f} | {statistics.median(o.hits for o in runs):.0%} | "
                f"{per_copy} | {statistics.median(len(o.added_s) for o in runs):g} |"
            )
    return "\n".join(lines)


def _added(o: Outcome) -> str:
    return f"{len(o.added_s)} (at {', '.join(f'{t:g}' for t in o.added_s)} s)" if o.added_s else "0"


def _seeds(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected seeds, got {text!r}")
    return values


def _routings(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [v for v in values if v not in ROUTINGS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(f"routings are {', '.join(ROUTINGS)}, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sim llm", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--routing", type=_routings, default=list(ROUTINGS), help="comma-separated: load, inflight")
    p.add_argument("--seeds", type=_seeds, default=[1, 2, 3])
    p.add_argument("--copies", type=positive_int, default=3, help="copies at the start")
    p.add_argument("--instances", type=positive_int, default=6, help="instances that could hold a copy")
    p.add_argument("--add-copies", action="store_true", help="copy scaling: add copies when queues stay deep")
    p.add_argument("--load-s", type=positive_float, default=20.0, help="an added copy's load")
    p.add_argument("--requests", type=positive_int, default=180)
    p.add_argument("--rate", type=positive_float, default=6.0, help="calls per second (Poisson)")
    p.add_argument("--system-words", type=positive_int, default=300, help="length of each shared system prompt")
    p.add_argument("--own-words", type=positive_int, default=150, help="length of a prompt of its own")
    p.add_argument("--tokens", type=positive_int, default=32, help="tokens per answer")
    p.add_argument("--token-ms", type=positive_float, default=20.0)
    p.add_argument("--max-running", type=positive_int, default=4, help="calls an engine runs at once")
    p.add_argument("--prefill-ms-per-token", type=positive_float, default=1.0)
    p.add_argument("--cache-tokens", type=positive_int, default=2048, help="each engine's prefix cache")
    p.add_argument(
        "--no-readings",
        action="store_true",
        help="load: the front ignores the engines' readings (its own counts only; an experiment)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.copies > a.instances:
        p.error(f"--copies ({a.copies}) is more than --instances ({a.instances})")
    mix = Mix(a.requests, a.rate, a.system_words, a.own_words, a.tokens)
    setup = Setup(
        a.copies,
        a.instances,
        a.add_copies,
        a.load_s * 1000,
        a.max_running,
        a.prefill_ms_per_token,
        a.token_ms,
        a.cache_tokens,
        readings=not a.no_readings,
    )
    outcomes = [simulate(mix, setup, routing, seed) for routing in a.routing for seed in a.seeds]
    print(table(mix, setup, outcomes))
    return 0
