"""The simulator against a real mesh: three meshd instances with reference runtimes play a
short Zipf trace; the simulator replays the same trace (same arrival times, same instance
for each request) on the same fleet; their loads agree within a fixed band (`agrees`). A
negative control runs in the suite: the LRU, adaptive and capped meshes' runs replayed on a fleet
with one model's more room per instance (a quarter more cache) must not agree.

The real run's figures are counted, not estimated: loads are the runtimes' own count of
models loaded, and a request is a miss when a load finished while it was in flight
(requests go one at a time, so that load was the one it waited for). The hit ratio is
printed, not asserted: with one request at a time it is the loads over the requests again."""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from array import array

import pytest

from meshd._proto.meshd import admin_pb2 as admin
from meshd._proto.meshd import admin_pb2_grpc as admin_grpc
from meshd.decisions.cache import Eviction, to_units
from meshd.runtimes.echo import SERVICE as ECHO
from meshd.runtimes.models import generate_models
from meshd.testing.procs import wait_until
from sim.engine import Fleet, Result, simulate
from sim.policies import as_configured
from sim.workloads import Catalogue, Workload, zipf

from .conftest import MODEL_SIZE, Client, NodeFactory, close_enough, expected

pytestmark = pytest.mark.slow

MODELS = 30
PER_INSTANCE = 4  # room for 4 of the 30 models on each of the 3 instances
REQUESTS = 1200
LOAD_DELAY_MS = 80
SEEDS = 5  # the simulator's random picks (near-best placement) averaged over this many runs
# One request at a time, at most one per 20 ms: the hottest model stays far below the copy
# scale-up threshold (2000 rpm), so neither side adds copies and the runs compare placement
# and eviction alone.
MIN_GAP_S = 0.02
ROWS = [[1.0, 2.0, 3.0, 4.0]]


def loads(clients: list[Client]) -> int:
    total = 0
    for c in clients:
        raw = c.runtime_channel.unary_unary(f"/{ECHO}/Stats")(b"", timeout=10)
        total += int(json.loads(raw)["loads"])
    return total


def instances(c: Client) -> list[str]:
    stub = admin_grpc.MeshAdminStub(c.channel)
    return [i.instanceId for i in stub.listInstances(admin.ListInstancesRequest(), timeout=10).instances]


# How far one real run may sit from the simulated mean, as a share of the real run: the real
# run is one draw of random placement picks and of timing the replay does not reproduce.
# With 600 requests the real runs spread too widely for one draw: GDSF's went 175-195 loads
# against 184-198 simulated, and CI saw real 178 against 198 (-11 %, 2026-11-29). With 1,200
# (2026-11-29, 12 real runs over the five orders): real minus simulated mean -2.8 % to
# +2.5 %, root mean square 1.4 %. 10 % is about seven times that; the negative control below
# stays well outside it (LRU real 450 against 348-368 with a quarter more cache, -21 %;
# adaptive 362 against 293-309, -17 %).
REAL_RUN_BAND = 0.10
SEED_ERRORS = 1.0  # ... plus this many standard errors of the simulated mean (its seeds)


def agrees(real: float, simulated: list[float]) -> bool:
    """Whether the simulated runs' mean is within `REAL_RUN_BAND` of the real run plus
    `SEED_ERRORS` standard errors of that mean. Fixed: noisier seeds do not widen it beyond
    their mean's own uncertainty (the seeds' spread itself is not the real run's)."""
    mean = statistics.fmean(simulated)
    standard_error = statistics.stdev(simulated) / math.sqrt(len(simulated))
    return abs(mean - real) <= REAL_RUN_BAND * real + SEED_ERRORS * standard_error


@pytest.mark.parametrize("eviction", list(Eviction), ids=[e.value for e in Eviction])
def test_the_simulator_and_a_real_mesh_agree_on_loads_and_hit_ratio(
    start_node: NodeFactory, tmp_path: object, eviction: Eviction
) -> None:
    runtime_args = ["--load-delay-ms", str(LOAD_DELAY_MS), "--default-model-size", str(MODEL_SIZE)]
    clients = [start_node(f"inst-{n}", PER_INSTANCE, runtime_args, {"eviction": eviction.value}) for n in "abc"]
    models = generate_models(tmp_path / "models", MODELS, size_bytes=MODEL_SIZE)  # type: ignore[operator]
    for m in models:
        clients[0].register(m)
    # Every instance sees the other two before traffic starts, as the simulated fleet does.
    wait_until(lambda: all(len(instances(c)) == 3 for c in clients), 30, "every instance to see all three")
    units = to_units(MODEL_SIZE)
    cat = Catalogue(
        ids=tuple(m.id for m in models),
        units=(units,) * MODELS,
        load_ms=(float(LOAD_DELAY_MS),) * MODELS,
        service_ms=(1.0,) * MODELS,
    )
    trace = zipf(cat, REQUESTS, alpha=0.9, rate_rps=50, seed=7)
    rng = random.Random(11)
    ingress = [rng.randrange(3) for _ in range(REQUESTS)]

    times = array("q")
    misses = 0
    miss_ms: list[float] = []
    at_start = before = loads(clients)
    start = time.monotonic()
    for i, mi in enumerate(trace.models):
        sent = time.monotonic()
        times.append(int((sent - start) * 1000))
        m = models[mi]
        assert close_enough(clients[ingress[i]].infer(m.id, ROWS), expected(m, ROWS))
        took = time.monotonic() - sent
        after = loads(clients)
        if after > before:
            misses += 1
            miss_ms.append(took * 1000)
        before = after
        time.sleep(max(0.0, MIN_GAP_S - (time.monotonic() - sent)))
    real_loads = loads(clients) - at_start
    real_hit_ratio = 1 - misses / REQUESTS

    # The simulator gets what a user would calibrate it with: the fleet, the sizes, the
    # load time the runtime showed (the mean wait of a miss), the trace as it was played.
    load_ms = sum(miss_ms) / len(miss_ms)
    calibrated = Catalogue(cat.ids, cat.units, (load_ms,) * MODELS, cat.service_ms)
    replay = Workload("replay", calibrated, times, trace.models)
    runs: list[Result] = [
        simulate(
            replay,
            Fleet(3, PER_INSTANCE * units, load_jitter=0.0, default_model_units=units, seed=seed),
            as_configured(eviction),
            ingress=ingress,
        )
        for seed in range(SEEDS)
    ]
    sim_loads = statistics.fmean(r.loads for r in runs)
    sim_hit_ratio = statistics.fmean(r.hit_ratio for r in runs)
    failed = sum(r.failed for r in runs)

    report = (
        f"real: {real_loads} loads, hit ratio {real_hit_ratio:.3f}; "
        f"simulated (mean of {SEEDS}): {sim_loads:.1f} loads, hit ratio {sim_hit_ratio:.3f} (failed {failed}); "
        f"per seed: {[r.loads for r in runs]} loads"
    )
    print(report)
    assert failed == 0, report
    assert agrees(real_loads, [r.loads for r in runs]), report
    if eviction in (Eviction.LRU, Eviction.ADAPTIVE, Eviction.CAPPED):
        # The negative control: the same real run against a simulator whose fleet is wrong by
        # one model's room per instance (5 in place of 4) must not agree, or the band could
        # pass anything. (A wrong policy is not the control: RATE's loads are only 10-20 % below
        # LRU's, too near the band for one real run to tell them apart.)
        # ADAPTIVE too (issue 44): it learns from what the fleet reloads, so a simulator with
        # the wrong fleet must not agree with it either. CAPPED too: its order moves with the
        # cache's clock, so a fleet with the wrong room must not pass. Figures: the note at
        # REAL_RUN_BAND.
        wrong = [
            simulate(
                replay,
                Fleet(3, (PER_INSTANCE + 1) * units, load_jitter=0.0, default_model_units=units, seed=seed),
                as_configured(eviction),
                ingress=ingress,
            ).loads
            for seed in range(SEEDS)
        ]
        print(f"a quarter more cache replayed: {wrong} loads")
        assert not agrees(real_loads, wrong), (
            f"{report}; a quarter more cache replayed: {wrong} loads, which should not agree"
        )
