"""`python -m sim llm`: copies of one language model on the virtual clock, routed by the daemon's
own rules (sim/llm.py), with fake_llm's engine (sim/llm_engine.py)."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

from meshd.adapter.llm.load import READ_EVERY_S
from meshd.decisions.placement import llm as rules
from meshd.decisions.placement import serving
from meshd.testing import fake_llm
from sim import llm
from sim.__main__ import main
from sim.llm_engine import Call, PrefixCache

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
PRESET_SEEDS = (1, 2, 3)


def test_the_engine_is_fake_llm_s() -> None:
    """The same prompts give the same prefix-cache hits, call by call, in the sim's engine and in
    fake_llm's (bench/llm_routing.py's), and the sim reads engines as often as the runtime does."""
    assert llm.READ_EVERY_MS == READ_EVERY_S * 1000
    ours, theirs = PrefixCache(2048), fake_llm.Engine(cache_tokens=2048)
    found = [(ours.cached(c.tokens), theirs.cached(list(c.tokens))) for c in llm.calls_of(llm.Mix(), 1)]
    assert all(a == b for a, b in found)
    assert sum(a for a, _ in found) > 0 and (ours.hits, ours.queries) == (theirs.hits, theirs.queries)


def test_the_calls_are_the_routing_bench_s() -> None:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import llm_routing  # bench/ is not a package
    finally:
        sys.path.remove(str(BENCH_DIR))
    mix = llm.Mix(requests=50)
    bench_args = argparse.Namespace(requests=50, rate=mix.rate, system_words=mix.system_words, own_words=mix.own_words)
    assert llm.workload(mix, 1001) == [(c.at, c.prompt) for c in llm_routing.workload(bench_args, 1001)]


def test_an_engine_queues_past_max_running_and_prefills_one_at_a_time() -> None:
    """One copy, one call at a time, 1 ms a prompt token, answers of 3 tokens 20 ms apart: the
    second call of a prompt finds its blocks cached."""
    words = tuple(f"w{i}" for i in range(100))  # 6 whole blocks of 16
    calls = [Call(0.0, words, 3), Call(0.0, words, 3), Call(500.0, words[:50] + ("x",) * 50, 3)]
    mesh = llm.LlmMesh(llm.Setup(copies=1, max_running=1), "load")
    mesh.run(calls)
    assert [c.first_token_ms for c in calls] == [100.0, 140 + 4.0, 500 + 52.0]  # 100-96, then 100-48 uncached
    assert [c.done_ms for c in calls] == [140.0, 184.0, 592.0]
    two = [Call(0.0, words, 3), Call(0.0, words, 3)]
    llm.LlmMesh(llm.Setup(copies=1, max_running=2), "load").run(two)
    assert [c.first_token_ms for c in two] == [100.0, 104.0]  # both running, prefills in turn


def test_prefix_affinity_raises_the_hit_share_on_the_preset() -> None:
    mix, setup = llm.Mix(), llm.Setup()
    for seed in PRESET_SEEDS:
        by_load = llm.simulate(mix, setup, "load", seed)
        by_inflight = llm.simulate(mix, setup, "inflight", seed)
        assert by_load.hits > by_inflight.hits + 0.1, seed
        for o in (by_load, by_inflight):  # every call answered, every copy used
            assert len(o.ttft_ms) == mix.requests and all(t >= 0 for t in o.ttft_ms)
            assert sum(o.served) == mix.requests and min(o.served) > 0


def test_the_routing_is_the_daemon_s_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sim calls meshd.decisions.placement.llm itself: fed the loads the daemon feeds it, and a
    least-in-flight rule put in its place makes `load` give `inflight`'s figures exactly."""
    mix, setup = llm.Mix(requests=120), llm.Setup()
    by_inflight = llm.simulate(mix, setup, "inflight", 2)
    by_load = llm.simulate(mix, setup, "load", 2)
    assert (by_load.ttft_ms, by_load.served) != (by_inflight.ttft_ms, by_inflight.served)
    seen: list[tuple[int, dict[str, rules.EngineLoad], str | None]] = []
    real = rules.choose_llm_copy

    def watched(view: Any, copies: Any, inflight: Any, loads: Any, *rest: Any) -> str | None:
        seen.append((view.now_ms, dict(loads), rest[-1]))
        return real(view, copies, inflight, loads, *rest)

    monkeypatch.setattr(rules, "choose_llm_copy", watched)
    assert llm.simulate(mix, setup, "load", 2) == by_load
    assert len(seen) == mix.requests
    assert any(loads and all(x.waiting >= 0 and x.running >= 0 for x in loads.values()) for _, loads, _ in seen)
    assert sum(owner is not None for *_, owner in seen) > mix.requests // 3  # shared prompts find their copy
    seen.clear()  # the experiment without readings: none reaches the decision
    llm.simulate(mix, llm.Setup(readings=False), "load", 2)
    assert len(seen) == mix.requests and not any(loads for _, loads, _ in seen)

    def least_inflight(view: Any, copies: Any, inflight: Any, loads: Any, exclude: Any, *rest: Any) -> str | None:
        assume, local, _owner = rest
        return serving.choose_copy(view, copies, inflight, exclude, assume, local, False)

    monkeypatch.setattr(rules, "choose_llm_copy", least_inflight)
    control = llm.simulate(mix, setup, "load", 2)
    same = (control.ttft_ms, control.hits, control.served)
    assert same == (by_inflight.ttft_ms, by_inflight.hits, by_inflight.served)


def test_copies_are_added_when_queues_stay_deep(monkeypatch: pytest.MonkeyPatch) -> None:
    """From one copy, calls faster than it serves: the scaler's rule adds copies, which then
    serve; at a rate one copy keeps up with, or with the deep-queue rule off, none is added."""
    mix = llm.Mix(requests=400)
    setup = llm.Setup(copies=1, add_copies=True, load_ms=5_000)
    grown = llm.simulate(mix, setup, "load", 1)
    assert grown.added_s and len(grown.served) == 1 + len(grown.added_s) and min(grown.served) > 0
    assert all(t * 1000 % setup.rate_check_ms == 0 for t in grown.added_s)  # at rate checks
    assert not llm.simulate(llm.Mix(requests=100, rate=1.0), setup, "load", 1).added_s
    monkeypatch.setattr(rules, "queue_stays_deep", lambda readings, least, loading: False)
    assert not llm.simulate(mix, setup, "load", 1).added_s


def test_no_copy_is_added_for_a_queue_while_one_added_still_loads() -> None:
    """Loads longer than two rate checks: the queue stays deep until the added copy serves, and
    the next copy is asked for only after that (the daemon's rule, loops.scaler)."""
    setup = llm.Setup(copies=1, add_copies=True, load_ms=25_000)
    for seed in (1, 2):
        added = llm.simulate(llm.Mix(requests=600), setup, "load", seed).added_s
        assert len(added) >= 2, "the queue stayed deep after the first added copy served"
        assert all(later - earlier > setup.load_ms / 1000 for earlier, later in itertools.pairwise(added)), added


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["llm", "--seeds", "1,2", "--requests", "40"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| load |", "| inflight |"))]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "2", "median"] * 2
    assert main(["llm", "--seeds", "1", "--requests", "300", "--copies", "1", "--add-copies", "--load-s", "5"]) == 0
    assert "s) |" in capsys.readouterr().out  # when copies were added
    assert main(["llm", "--seeds", "1", "--requests", "40", "--routing", "load", "--no-readings"]) == 0
    assert "| load | 1 |" in capsys.readouterr().out
    for argv in (["--copies", "7"], ["--routing", "nope"], ["--seeds", "x"], ["--rate", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["llm", *argv])
        assert e.value.code == 2
