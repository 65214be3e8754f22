"""One language-model engine on the virtual clock: the engine `meshd.testing.fake_llm` is, so
the simulator (`sim.llm`) and bench/llm_routing.py model the same one.

`max_running` calls run at once, the rest wait first come first served (fake_llm's semaphore);
a running call's prompt is prefilled one call at a time (a GPU's prefill is compute-bound:
fake_llm's lock), `prefill_ms_per_token` per prompt token not found in the prefix cache; its
first token comes when its prefill ends, then one token every `token_ms`. The prefix cache
keeps the prompts' leading blocks of `BLOCK_TOKENS` tokens, least recently used dropped past
`cache_tokens` (`PrefixCache`, fake_llm's `Engine.cached`); KV-cache use is the tokens of the
running calls (prompt and answer) over `cache_tokens`, as fake_llm's `/metrics` says.

No routing here: the engine is told when a call arrives and says when things happen; the
caller (sim.llm) keeps the clock and the event queue.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK_TOKENS = 16  # fake_llm's (vLLM's default block size)


class PrefixCache:
    """Prompt prefixes in whole blocks, least recently used dropped: fake_llm's `Engine.cached`."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, found

    def cached(self, tokens: Sequence[str]) -> int:
        """The prompt's tokens found (its leading whole blocks in the cache); its blocks are
        cached from now on."""
        if not self.capacity_tokens:
            return 0
        hit, found = 0, True
        for i in range(len(tokens) // BLOCK_TOKENS):
            key = hash(tuple(tokens[: BLOCK_TOKENS * (i + 1)]))
            if found and key in self.blocks:
                hit += BLOCK_TOKENS
            else:
                found = False
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) * BLOCK_TOKENS > self.capacity_tokens:
            self.blocks.popitem(last=False)
        self.queries += len(tokens)
        self.hits += hit
        return hit


@dataclass(slots=True)
class Call:
    """One call: its prompt's tokens, the tokens it answers, and what happened to it (ms)."""

    arrival_ms: float
    tokens: tuple[str, ...]
    answer_tokens: int
    prefix: str | None = None  # decisions.placement.llm.prefix_key of its body
    copy: str = ""  # the copy that served it
    first_token_ms: float = -1.0
    done_ms: float = -1.0


@dataclass(frozen=True, slots=True)
class Reading:
    """What the engine's /metrics says: requests waiting and running, KV-cache use (0..1)."""

    waiting: int
    running: int
    kv_use: float


@dataclass
class Engine:
    max_running: int
    prefill_ms_per_token: float
    token_ms: float
    cache: PrefixCache
    waiting: deque[Call] = field(default_factory=deque)  # for a slot
    prefill_queue: deque[Call] = field(default_factory=deque)  # running, for the prefill
    prefilling: Call | None = None
    running: int = 0
    running_tokens: int = 0
    done: int = 0

    def reading(self) -> Reading:
        cap = self.cache.capacity_tokens
        kv = min(1.0, self.running_tokens / cap) if cap else 0.0
        return Reading(len(self.waiting), self.running, kv)

    def arrive(self, call: Call, now_ms: float) -> float | None:
        """A call comes; the time its prefill ends when it starts at once (None: it waits)."""
        if self.max_running and self.running >= self.max_running:
            self.waiting.append(call)
            return None
        return self._run(call, now_ms)

    def prefill_done(self, now_ms: float) -> tuple[Call, float | None]:
        """The prefilling call's first token is out: (that call, the time the next prefill
        ends if one starts now)."""
        call = self.prefilling
        assert call is not None
        call.first_token_ms = now_ms
        call.done_ms = now_ms + max(0, call.answer_tokens - 1) * self.token_ms
        self.prefilling = None
        return call, self._next_prefill(now_ms)

    def finish(self, call: Call, now_ms: float) -> float | None:
        """A call's last token is out: its slot goes to the next waiting call (the time that
        call's prefill ends when it starts at once)."""
        self.running -= 1
        self.running_tokens -= len(call.tokens) + call.answer_tokens
        self.done += 1
        if self.waiting:
            return self._run(self.waiting.popleft(), now_ms)
        return None

    def _run(self, call: Call, now_ms: float) -> float | None:
        self.running += 1
        self.running_tokens += len(call.tokens) + call.answer_tokens
        self.prefill_queue.append(call)
        return self._next_prefill(now_ms) if self.prefilling is None else None

    def _next_prefill(self, now_ms: float) -> float | None:
        if not self.prefill_queue:
            return None
        call = self.prefilling = self.prefill_queue.popleft()
        uncached = len(call.tokens) - self.cache.cached(call.tokens)
        return now_ms + uncached * self.prefill_ms_per_token
