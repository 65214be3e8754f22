"""Placement by price (issue 33): a load goes to one of the few instances whose next victim is
worth least, on condition that the one chosen still evicts no more when the load arrives."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

from meshd.decisions.placement.rank import (
    PRICED_CHOICES,
    LoadRequest,
    Placement,
    PriceOffer,
    cheapest,
    choose_load,
    choose_load_target,
    load_price,
    price,
    stays,
    under_ceiling,
)
from tests.decisions.placement.factories import CAP, UNITS, inst, view


def priced(iid: str, value: float | None, free: int = 0, **kw: object) -> object:
    """A full instance (`free` units left) whose next victim is worth `value` (log2)."""
    return inst(iid, used=CAP - free, victim_value=value, **kw)  # type: ignore[arg-type]


def soonest(**kw: object) -> LoadRequest:
    return LoadRequest(model_id="m", model_type="t", size_units=UNITS, start_soonest=True, **kw)  # type: ignore[arg-type]


def test_room_costs_nothing_and_a_full_instance_costs_its_next_victim() -> None:
    assert load_price(UNITS, 3.0, UNITS) == -math.inf
    assert load_price(UNITS - 1, 3.0, UNITS) == 3.0
    assert load_price(0, None, UNITS) is None
    assert price(priced("a", 2.5), UNITS) == 2.5  # type: ignore[arg-type]


def test_the_cheapest_few_are_chosen_among_and_the_limit_is_the_dearest_of_them() -> None:
    cands = [priced(f"i{n}", float(n)) for n in range(6)]
    chosen, limit = cheapest(cands, UNITS, random.Random(1))  # type: ignore[arg-type]
    assert sorted(c.instance_id for c in chosen) == ["i0", "i1", "i2"][:PRICED_CHOICES]
    assert limit == float(PRICED_CHOICES - 1)


def test_instances_with_room_tie_and_are_taken_in_random_order() -> None:
    cands = [priced(f"r{n}", 9.0, free=CAP) for n in range(5)] + [priced("full", 0.0)]
    seen: Counter[str] = Counter()
    for seed in range(300):
        chosen, limit = cheapest(cands, UNITS, random.Random(seed))  # type: ignore[arg-type]
        assert limit == -math.inf and "full" not in {c.instance_id for c in chosen}
        seen.update(c.instance_id for c in chosen)
    assert set(seen) == {f"r{n}" for n in range(5)}  # each roomy one gets its turn


def test_without_a_price_from_every_candidate_nothing_is_priced() -> None:
    """An instance under LRU or GDSF (or an older meshd) publishes no value: the old rules apply."""
    cands = [priced("a", 1.0), priced("b", None), priced("c", 2.0)]
    chosen, limit = cheapest(cands, UNITS, random.Random(1))  # type: ignore[arg-type]
    assert limit is None and chosen == cands


def test_a_priced_load_stays_only_where_it_evicts_no_more_and_a_thread_is_free() -> None:
    assert stays(1.0, None, 5, 1)  # not placed by price: taken as before
    assert stays(1.0, 1.0, 0, 2) and stays(-math.inf, -math.inf, 1, 2)
    assert not stays(1.5, 1.0, 0, 2)  # it would evict more than the sender counted on
    assert not stays(1.0, 1.0, 2, 2)  # every thread busy: it would queue
    assert not stays(None, 1.0, 0, 2)  # nothing it could evict (all loading): it would wait


def test_choose_load_sends_a_load_to_one_of_the_cheapest_with_their_limit() -> None:
    v = view(*(priced(f"i{n}", float(n)) for n in range(8)))  # type: ignore[arg-type]
    targets: Counter[str] = Counter()
    for seed in range(300):
        placed = choose_load(v, soonest(), random.Random(seed))
        assert placed is not None and placed.price_limit == float(PRICED_CHOICES - 1)
        targets[placed.target] += 1
    assert set(targets) == {f"i{n}" for n in range(PRICED_CHOICES)}


def test_prices_count_only_among_the_instances_where_the_load_starts_soonest() -> None:
    cheap_but_busy = priced("busy", -5.0, loading_in_progress=3)
    rest = [priced(f"i{n}", float(n)) for n in range(4)]
    v = view(cheap_but_busy, *rest)  # type: ignore[arg-type]
    for seed in range(50):
        placed = choose_load(v, soonest(), random.Random(seed))
        assert placed is not None and placed.target != "busy"


def test_upstreams_placement_and_unpriced_fleets_place_unconditionally() -> None:
    v = view(*(priced(f"i{n}", float(n)) for n in range(4)))  # type: ignore[arg-type]
    upstream = LoadRequest(model_id="m", model_type="t", size_units=UNITS)
    placed = choose_load(v, upstream, random.Random(1))
    assert placed is not None and placed.price_limit is None
    plain = view(*(inst(f"i{n}", used=CAP) for n in range(4)))
    placed = choose_load(plain, soonest(), random.Random(1))
    assert isinstance(placed, Placement) and placed.price_limit is None
    assert choose_load_target(plain, soonest(), random.Random(1)) == placed.target


def test_the_deciding_instance_prices_itself_as_it_is_now() -> None:
    v = view(priced("me", 9.0), priced("a", 1.0))  # type: ignore[arg-type]
    live = v.with_own_cache(used=0, victim_value=9.0)  # its record is stale: it has room now
    assert price(live.instances["me"], UNITS) == -math.inf and price(v.instances["me"], UNITS) == 9.0
    assert live.instances["a"] is v.instances["a"]
    assert v.with_own_cache(used=CAP, victim_value=9.0) is v  # nothing changed: the same view
    assert v.with_own_cache(used=0, victim_value=None) is v  # no value to price with: records as they are


def test_a_view_with_the_own_state_differs_from_its_record_in_those_fields_alone() -> None:
    """`with_loads` and `with_own_cache` copy views without `dataclasses.replace` (for speed):
    every other field, of the instance and of the view, is the record's."""
    me = inst("me", used=CAP, count=7, zone="z", labels={"gpu"}, native="me:9", evicted=5, clock=2.5)
    me = dataclasses.replace(me, victim_value=3.0, regret=(1.0, 2.0, 3.0, 4.0), rpm=60, version=2)
    base = dataclasses.replace(
        view(me, inst("a")), departed={"d": inst("d")}, unreachable=frozenset({"u"}), lapsed=frozenset({"l"})
    )
    live = base.with_loads({"me": 3}).with_own_cache(used=10, victim_value=1.5)
    assert live.instances["me"] == dataclasses.replace(me, loading_in_progress=3, used=10, victim_value=1.5)
    assert live == dataclasses.replace(base, instances={**base.instances, "me": live.instances["me"]})
    assert base.instances["me"] is me and me.used == CAP  # the record's view is left as it was


def test_no_more_candidates_than_choices_is_not_priced() -> None:
    """Three instances and three choices: the price would choose nothing, and its check at the
    target would only add calls between instances."""
    few = [priced(f"i{n}", float(n)) for n in range(PRICED_CHOICES)]
    assert cheapest(few, UNITS, random.Random(1)) == (few, None)  # type: ignore[arg-type]
    v = view(*few)  # type: ignore[arg-type]
    placed = choose_load(v, soonest(), random.Random(1))
    assert placed is not None and placed.price_limit is None


def test_a_fleet_that_publishes_no_price_is_not_priced_even_where_all_have_room() -> None:
    """Under LRU or GDSF no record has a value: room alone prices nothing (meshd's rule of a
    quarter free first applies, `test_loading`); an empty instance of a priced fleet costs nothing."""
    roomy = [inst(f"r{n}", used=0) for n in range(4)]
    assert cheapest(roomy, UNITS, random.Random(1)) == (roomy, None)
    empty = inst("empty", used=0)  # nothing loaded, so no value of its own
    others = [priced("a", 1.0), priced("b", 2.0), priced("c", 3.0)]
    chosen, limit = cheapest([empty, *others], UNITS, random.Random(1))  # type: ignore[list-item]
    assert limit == 2.0 and {c.instance_id for c in chosen} == {"empty", "a", "b"}


def test_a_load_its_target_refused_goes_among_those_at_most_its_old_limit_without_a_new_one() -> None:
    cands = [priced("a", 9.0), priced("b", 1.0), priced("c", 2.0)]  # b, the target, is excluded
    assert [c.instance_id for c in under_ceiling(cands, UNITS, 2.0)] == ["b", "c"]  # type: ignore[misc]
    v = view(*cands)  # type: ignore[arg-type]
    for seed in range(50):
        placed = choose_load(v, soonest(price_ceiling=2.0, exclude=frozenset({"b"})), random.Random(seed))
        assert placed == Placement("c")  # not a, dearer than the limit; no limit this time
    # None under the ceiling (all dearer now): placed without prices, anywhere.
    assert choose_load(view(priced("a", 9.0)), soonest(price_ceiling=2.0), random.Random(1)) == Placement("a")  # type: ignore[arg-type]


def test_a_request_offers_a_price_once_and_a_refusal_makes_it_the_ceiling() -> None:
    """`PriceOffer`, as the router and the simulator follow it."""
    offer = PriceOffer()
    assert offer.limit_for(Placement("me", 1.0), "me") is None  # a load here needs no limit
    assert offer.limit_for(Placement("a", None), "me") is None  # nothing priced: still to offer
    assert offer.limit_for(Placement("a", 1.0), "me") == 1.0
    assert offer.ceiling is None
    offer.refused(1.0)
    assert offer.ceiling == 1.0
    assert offer.limit_for(Placement("b", 2.0), "me") is None  # once per request
