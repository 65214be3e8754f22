"""Which copy of a language model serves a call: where it starts soonest, and where its long
prompt prefix was served last while that copy is not overloaded (issue 43; GIE's endpoint
picker does the same with its queue, KV-cache and prefix scorers). Pure.

Each engine's load is read by its runtime from the engine's own metrics (vLLM's
`num_requests_waiting`, `num_requests_running`, `kv_cache_usage_perc`) or, for an engine that
has none (llama-cpp-python), counted by the runtime as its calls in flight. It reaches meshd as
`meshd-engine-load` metadata (`format_load` / `parse_load`): the runtime's on each answer, a
peer's on each stream it accepts. A reading counts the deciding instance's own calls to that
copy as they were when it came; it is kept (a `Reading`) with that count, and used (`fresh`)
with those calls replaced by the instance's calls in flight now, which it always knows: calls
it sent or ended since are not counted twice or forgotten. A reading older than `FRESH_MS` is
not used: the instance's own count stands in for it.

A prefix is the first `PREFIX_CHARS` characters of the conversation (chat: each message's role
and text; completions: the prompt), hashed; shorter prompts have none. Engines cache the KV of
a prefix they served (vLLM's prefix caching, llama.cpp's slot cache), so its next call there
skips most of its prefill.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from meshd.decisions.placement.serving import choose_copy
from meshd.decisions.placement.view import ClusterView

LOAD_HEADER = "meshd-engine-load"
FRESH_MS = 1_000  # a reading older than this is not used (the issue: fresh within a second)
PREFIX_CHARS = 1_024  # about 256 tokens: a system prompt, or the start of a conversation
# How many more calls the copy that served a prefix may hold than the least loaded copy and
# still take the prefix's next call: a cached prefix saves its prefill (hundreds of ms for a
# long prompt), a call queued behind others waits for one of them to finish.
AFFINITY_SLACK = 2
KV_FULL = 0.9  # KV-cache use at which an engine starts queueing and preempting: overloaded
PREFIX_MEMORY = 4_096  # prefixes remembered per instance (least recently used forgotten)
# Copy scaling (loops.scaler, each rate check): a copy whose engine had at least DEEP_QUEUE
# requests waiting at every one of at least MIN_READINGS readings since the last check counts as
# at the load threshold, whatever its requests per minute, unless a copy of the model is still
# loading: long LLM calls queue at rates far below the 2,000 a minute that add copies of other
# models.
DEEP_QUEUE = 2
MIN_READINGS = 3


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's load: calls in flight at its runtime, and, where the engine says,
    requests waiting and running in it and its KV-cache use (0..1); -1: not known."""

    inflight: int
    waiting: int = -1
    running: int = -1
    kv_use: float = -1.0

    @property
    def queue(self) -> int:
        """Calls ahead of a new one or being served: the engine's count when it has one."""
        if self.waiting >= 0 and self.running >= 0:
            return max(self.inflight, self.waiting + self.running)
        return self.inflight


def format_load(load: EngineLoad) -> str:
    text = f"inflight={load.inflight}"
    if load.waiting >= 0:
        text += f" waiting={load.waiting}"
    if load.running >= 0:
        text += f" running={load.running}"
    if load.kv_use >= 0:
        text += f" kv={load.kv_use:.3f}"
    return text


def parse_load(text: str | bytes) -> EngineLoad | None:
    """`format_load`'s text; None when it is not (keys not known are ignored)."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    fields: dict[str, str] = {}
    for part in text.split():
        key, eq, value = part.partition("=")
        if eq:
            fields[key] = value
    try:
        inflight = int(fields["inflight"])
        waiting = int(fields.get("waiting", -1))
        running = int(fields.get("running", -1))
        kv = float(fields.get("kv", -1.0))
    except (KeyError, ValueError):
        return None
    if inflight < 0 or not (kv < 0 or 0.0 <= kv <= 1.5):
        return None
    return EngineLoad(inflight, waiting, running, min(kv, 1.0))


@dataclass(frozen=True, slots=True)
class Reading:
    """A copy's engine load as this instance last heard it, when (ms), and this instance's own
    calls in flight to that copy then (the load counts them)."""

    load: EngineLoad
    at_ms: int
    own: int


def load_now(reading: Reading, own_now: int) -> EngineLoad:
    """The reading's load with this instance's calls then replaced by its calls now.

    Calls in flight at the copy beyond this instance's then are other instances', taken as
    unchanged. The engine's own counts were read before that (up to a read interval, and kept
    up to FRESH_MS by the runtime): they are not added to the calls counted, only used to split
    them, as many running as ran then when some were waiting (its batch was full), else all.
    """
    load = reading.load
    inflight = own_now + max(0, load.inflight - reading.own)
    if load.waiting < 0 or load.running < 0:
        return EngineLoad(inflight, load.waiting, load.running, load.kv_use)
    waiting = max(0, inflight - load.running) if load.waiting > 0 else 0
    return EngineLoad(inflight, waiting, inflight - waiting, load.kv_use)


def fresh(readings: Mapping[str, Reading], now_ms: int, own: Mapping[str, int]) -> dict[str, EngineLoad]:
    """The readings (per instance) no older than FRESH_MS, each as `load_now` with `own`, this
    instance's calls in flight to each copy now."""
    return {iid: load_now(r, own.get(iid, 0)) for iid, r in readings.items() if now_ms - r.at_ms <= FRESH_MS}


def prefix_key(body: Mapping[str, Any]) -> str | None:
    """The hash of a call's first PREFIX_CHARS characters of conversation (None: shorter)."""
    messages = body.get("messages")
    text = ""
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # parts: the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            piece = f"{m.get('role', '')}:{content if isinstance(content, str) else ''}\n"
            parts.append(piece)
            size += len(piece)
            if size >= PREFIX_CHARS:
                break
        text = "".join(parts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else ""
    if len(text) < PREFIX_CHARS:
        return None
    return hashlib.blake2b(text[:PREFIX_CHARS].encode(errors="replace"), digest_size=8).hexdigest()


class PrefixOwners:
    """Which copy served each prefix last: a bounded memory, least recently used forgotten."""

    def __init__(self, capacity: int = PREFIX_MEMORY) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[tuple[str, str], str] = OrderedDict()

    def get(self, model_id: str, prefix: str) -> str | None:
        return self._owners.get((model_id, prefix))

    def served(self, model_id: str, prefix: str, instance_id: str) -> None:
        key = (model_id, prefix)
        self._owners[key] = instance_id
        self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)


def copies_loading(holders: Mapping[str, int], self_id: str, now_ms: int, assume_loaded_ms: int) -> int:
    """The copies in `holders` (instance -> its load's start, ms) not yet taken as loaded, this
    instance's aside: their load began `assume_loaded_ms` ago or less, so calls do not go there
    yet (`choose_llm_copy`)."""
    cutoff = now_ms - assume_loaded_ms
    return sum(1 for iid, started in holders.items() if iid != self_id and started >= cutoff)


def queue_stays_deep(readings: int, least_waiting: int, loading: int) -> bool:
    """Whether a copy's engine queue stayed deep over a rate check, asking for another copy:
    `readings` of its load since the last check, the fewest requests waiting in any of them.
    Not while a copy of the model is `loading` (`copies_loading`): the queue waits for that one,
    and asking at each check until it serves would add a copy every check."""
    return loading == 0 and readings >= MIN_READINGS and least_waiting >= DEEP_QUEUE


def overloaded(load: EngineLoad | None, queue: int, least: int) -> bool:
    """Too busy to keep a prefix: its KV cache nearly full, or AFFINITY_SLACK calls more than
    the least loaded copy."""
    if load is not None and load.kv_use >= KV_FULL:
        return True
    return queue > least + AFFINITY_SLACK


def choose_llm_copy(
    view: ClusterView,
    copies: Mapping[str, int],
    inflight: Mapping[str, int],
    loads: Mapping[str, EngineLoad],
    exclude: AbstractSet[str],
    assume_loaded_ms: int,
    local_loaded: bool,
    prefix_owner: str | None,
) -> str | None:
    """The copy a language model's call goes to, or None when there is no usable copy.

    `inflight`: calls this instance has in flight to each copy (its own included under its
    id); `loads`: the copies' fresh readings as of now (`fresh`); `prefix_owner`: the copy that
    served the call's prefix last (None: no prefix, or none remembered).

    Among the loaded copies (this instance's when `local_loaded`, the others' once their load
    started `assume_loaded_ms` ago): the prefix's copy while it is not `overloaded`; else the
    one where the call starts soonest: fewest waiting in the engine, then the shortest queue
    (the reading's count, or this instance's calls in flight when it has none), then the least
    KV-cache use, this instance first (no hop), then the smallest id. Copies still loading, or
    none loaded: `choose_copy`'s rules (the first to start loading).
    """
    me = view.self_id
    cutoff = view.now_ms - assume_loaded_ms
    unreachable = view.unreachable
    ready = [
        iid
        for iid, started in copies.items()
        if iid not in exclude
        and iid not in unreachable
        and ((iid == me and local_loaded) or (iid != me and view.live(iid) and started < cutoff))
    ]
    if local_loaded and me not in exclude and me not in ready:
        ready.append(me)  # loaded here before the record lists it
    if not ready:
        return choose_copy(view, copies, inflight, exclude, assume_loaded_ms, local_loaded, False)

    def queue(iid: str) -> int:
        load = loads.get(iid)
        own = inflight.get(iid, 0)
        return max(own, load.queue) if load is not None else own

    queues = {iid: queue(iid) for iid in ready}
    least = min(queues.values())
    if prefix_owner in queues and not overloaded(loads.get(prefix_owner), queues[prefix_owner], least):
        return prefix_owner

    def soonest(iid: str) -> tuple[int, int, float, bool, str]:
        load = loads.get(iid)
        waiting = max(0, load.waiting) if load is not None else 0
        kv = max(0.0, load.kv_use) if load is not None else 0.0
        return (waiting, queues[iid], kv, iid != me, iid)

    return min(ready, key=soonest)
