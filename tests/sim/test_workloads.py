"""Workload generators and CSV trace replay."""

from __future__ import annotations

import collections
import itertools
import random
from pathlib import Path

import pytest

from sim import workloads as w
from sim.engine import Fleet, simulate
from sim.policies import UPSTREAM


def test_generators_are_deterministic_sorted_and_in_range() -> None:
    cat = w.catalogue(50, random.Random(1), size_sigma=0.5)
    for make in (w.zipf, w.shifting, w.bursts, w.daily, w.new_models, w.switching):
        a = make(cat, 2000, 1.0, 50.0, seed=3)  # type: ignore[operator]
        b = make(cat, 2000, 1.0, 50.0, seed=3)  # type: ignore[operator]
        assert list(a.models) == list(b.models) and list(a.times_ms) == list(b.times_ms)
        assert len(a) == 2000 and all(0 <= m < 50 for m in a.models)
        assert list(a.times_ms) == sorted(a.times_ms)


def test_csv_round_trip_and_defaults(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("timestamp,model_id,size_bytes,latency_ms\n2.5,b,16384,4\n1.0,a,,\n# note\n\n3,a,8192,2\n")
    wl = w.read_csv(path)
    assert wl.catalogue.ids == ("a", "b")  # in order of first request
    assert list(wl.times_ms) == [0, 1500, 2000]
    assert list(wl.models) == [0, 1, 0]
    assert wl.catalogue.units == (1, 2)  # a: the first size given for it
    assert wl.catalogue.service_ms == (2.0, 4.0)
    out = tmp_path / "out.csv"
    w.write_csv(wl, out)
    again = w.read_csv(out)
    assert list(again.models) == list(wl.models) and again.catalogue.units == wl.catalogue.units


def test_a_header_may_follow_comment_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("# exported 2026-11-22\ntimestamp,model_id\n0,a\n1.5,b\n")
    workload = w.read_csv(path)
    assert list(workload.times_ms) == [0, 1500] and workload.catalogue.ids == ("a", "b")


def test_hours_of_silence_in_a_trace_are_crossed_quickly(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("0,a\n1,a\n31536000,a\n31536001,b\n")  # a year apart: 15 million 2 s ticks
    result = simulate(w.read_csv(path), Fleet(2, 10_000), UPSTREAM)
    assert result.requests == 4 and result.failed == 0 and result.loads >= 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1,a\nx,b\n", "t.csv:2: timestamp 'x' is not a number"),
        ("1,\n", "t.csv:1: missing model id"),
        ("1,a,-5\n", "t.csv:1: size_bytes must be a positive number"),
        ("1,a,1,zz\n", "t.csv:1: latency_ms 'zz' is not a number"),
        ("timestamp,model_id\n", "no requests"),
        ("0,a\n1e300,b\n", "spans .* days; at most 366"),
        ("0,a,1e300\n", "size_bytes '1e300' is over 1 PiB"),
        (b"0,a\n1,\xff\xfe\n", "not UTF-8 text"),
        ('0,"a\n', "not CSV"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path: Path, text: str | bytes, message: str) -> None:
    path = tmp_path / "t.csv"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(w.TraceError, match=message):
        w.read_csv(path)


def test_generators_say_what_popularity_each_request_was_drawn_from() -> None:
    cat = w.catalogue(200, random.Random(3))
    for gen in (w.zipf, w.shifting, w.bursts, w.daily, w.new_models):
        wl = gen(cat, 30_000, 1.0, 5.0, seed=2)
        starts = [epoch.start for epoch in wl.popularity]
        assert starts[0] == 0 and starts == sorted(set(starts)), gen.__name__
        for epoch, end in zip(wl.popularity, [*starts[1:], len(wl)], strict=True):
            probs = [epoch.p(m) for m in range(len(cat))]
            assert sum(probs) == pytest.approx(1.0), gen.__name__
            assert all(probs[m] > 0 for m in wl.models[epoch.start : end]), gen.__name__  # drawn from it
            if end - epoch.start >= 2000:  # the most probable model is the most requested
                counts = collections.Counter(wl.models[epoch.start : end])
                assert counts.most_common(1)[0][0] == max(range(len(probs)), key=probs.__getitem__), gen.__name__


def test_epochs_start_at_the_first_request_after_each_change() -> None:
    cat = w.catalogue(200, random.Random(3))
    shifting = w.shifting(cat, 30_000, 1.0, 5.0, seed=2)
    times = shifting.times_ms
    assert len(shifting.popularity) == 1 + int(times[-1] // 600_000)  # one epoch per re-deal
    for epoch in shifting.popularity[1:]:
        assert times[epoch.start] // 600_000 == times[epoch.start - 1] // 600_000 + 1
    bursts = w.bursts(cat, 30_000, 1.0, 5.0, seed=2)
    times = bursts.times_ms

    def burst_at(i: int) -> int:  # the burst a request falls in, -1 for none (as the generator says)
        k, into = divmod(times[i], 120_000)
        return k if k > 0 and into < 20_000 else -1

    for epoch, after in itertools.pairwise(bursts.popularity):
        assert (epoch.hot >= 0) != (after.hot >= 0)  # background and bursts alternate
        assert burst_at(after.start) != burst_at(after.start - 1) == burst_at(epoch.start)
        if epoch.hot >= 0:  # a burst's model is its most requested, with a share over 0.3
            assert collections.Counter(bursts.models[epoch.start : after.start]).most_common(1)[0][0] == epoch.hot
            assert epoch.p(epoch.hot) > 0.3 and epoch.probs is bursts.popularity[0].probs  # shared, not copied
    arriving = w.new_models(cat, 30_000, 1.0, 5.0, seed=2)
    newest = [epoch.newest for epoch in arriving.popularity]
    assert newest == list(range(99, 200))  # half the catalogue at first, then one arrival per epoch
    for epoch in arriving.popularity:
        assert epoch.p(epoch.newest) == max(epoch.p(m) for m in range(200))  # the newest is the hottest
        assert all(epoch.p(m) == 0 for m in range(epoch.newest + 1, 200))  # not there yet
    # Changes between two requests give one epoch, not two at the same request.
    sparse = [w.shifting(cat, 50, 1.0, 0.01, seed=1), w.bursts(cat, 50, 1.0, 0.01, seed=1)]
    for wl in sparse:
        starts = [epoch.start for epoch in wl.popularity]
        assert len(starts) > 5 and starts == sorted(set(starts))


def test_the_large_models_preset_has_the_held_back_traces_shape() -> None:
    """Issue 33: under a hundred models, each about a third of an instance at 10 % on three
    instances, 10-40 s loads, 10-60 s service, requests in sessions over weeks, and a
    catalogue that grows (a model's first request comes later the later it arrives)."""
    wl = w.large_models(10_000, 1.0, seed=2)
    again = w.large_models(10_000, 1.0, seed=2)
    assert list(wl.models) == list(again.models) and list(wl.times_ms) == list(again.times_ms)
    cat = wl.catalogue
    assert len(cat) < 100 and len(wl) == 10_000 and list(wl.times_ms) == sorted(wl.times_ms)
    instance = cat.total_units * 0.1 / 3
    shares = sorted(u / instance for u in cat.units)
    assert 0.25 < shares[len(shares) // 2] < 0.45 and shares[-1] < 1
    assert min(cat.load_ms) == 10_000 and max(cat.load_ms) == 40_000
    assert all(10_000 <= s <= 60_000 for s in cat.service_ms)
    assert wl.times_ms[-1] > 7 * w.DAY_MS  # weeks
    first = {}
    for t, m in zip(wl.times_ms, wl.models, strict=True):
        first.setdefault(m, t)
    early = [first[m] for m in range(len(cat) // 2) if m in first]
    late = [first[m] for m in range(3 * len(cat) // 4, len(cat)) if m in first]
    assert late and max(early[:5]) < min(late)  # the last quarter arrives after the start
    # Sessions: most requests follow one for the same model.
    repeats = sum(a == b for a, b in itertools.pairwise(wl.models))
    assert repeats > 0.3 * len(wl)


def test_switching_is_zipf_then_a_ranking_re_dealt_every_minute() -> None:
    cat = w.catalogue(50, random.Random(1), size_sigma=0.5)
    wl = w.switching(cat, 4000, 1.0, 10.0, seed=2)
    # The first half is zipf's stream; the second starts where it ends, its epochs after it.
    first = w.zipf(cat, 2000, 1.0, 10.0, seed=2)
    assert list(wl.models[:2000]) == list(first.models) and wl.times_ms[2000] >= wl.times_ms[1999]
    starts = [e.start for e in wl.popularity]
    assert starts[0] == 0 and starts[1] == 2000 and starts == sorted(starts)
    # Two minutes at 10 rps: the ranking is re-dealt about every 600 requests after the switch.
    assert 2 <= len(starts) - 2 <= 4
