# mypy: ignore-errors
"""The Ray Serve side of bench/peers.py: a local Ray cluster and one multiplexed deployment.

Runs in the Ray venv that bench/peers.py builds (never in meshd's), with the repository on
PYTHONPATH so every replica imports meshd.runtimes.model_work, the same model work as the
reference runtime's:

    python bench/peers_ray.py --port P --models-dir DIR --stats-dir DIR --ready-file F
                              [--grpc-port G] [--replicas 3] [--max-models K] [--max-ongoing N]

One deployment, `--replicas` replicas, `@serve.multiplexed(max_num_models_per_replica=K)`,
reached through Ray Serve's HTTP ingress on 127.0.0.1:P as its documentation shows:
`POST /` with the `serve_multiplexed_model_id` header and a JSON body `{"x": [[floats]]}`,
answered `{"model": id, "y": [[floats]]}`. With `--grpc-port G`, also through Serve's gRPC
ingress on 127.0.0.1:G, serving KServe V2 `inference.GRPCInferenceService/ModelInfer` (the
servicer meshd generates, registered with `gRPCOptions`) with the model id in the
`multiplexed_model_id` metadata, as Serve's gRPC guide shows: the same request and answer
bytes the meshd side sends and checks. A model is the model file bench/peers.py wrote
(meshd.runtimes.models format): its load takes `load_ms` and then allocates and writes
`size_bytes` (held until Ray evicts the model), each request takes `service_ms`.

Each replica counts loads and evictions in memory and a thread of its own writes them (and
`held`, loads less evictions) to `<stats-dir>/replica-<pid>.json` every 0.1 s: no file work
in `get_model`, which Serve runs under its per-replica multiplex lock (one load at a time). The ready file gets
this process's pid once the application serves. SIGTERM or SIGINT shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve
from starlette.requests import Request

from meshd.runtimes import model_work
from meshd.runtimes.models import decode_infer_request, make_infer_response

# Serve's gRPC proxy registers this servicer; calls to its ModelInfer reach Models.ModelInfer.
V2_SERVICER = "meshd._proto.inference.grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server"


def build_app(models_dir: str, stats_dir: str, replicas: int, max_models: int, max_ongoing: int) -> Any:
    @serve.deployment(
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": 0},  # 3 replicas on a 2-core machine, as meshd's 3 runtimes
    )
    class Models:
        def __init__(self) -> None:
            self.counts = {"loads": 0, "evictions": 0}
            self.stats_path = Path(stats_dir) / f"replica-{os.getpid()}.json"
            self._flush()
            # The bench's counters go to disk from a thread of their own, every 0.1 s: file work
            # inside get_model would run under Serve's multiplex lock and slow every load.
            threading.Thread(target=self._flusher, daemon=True).start()

        def _flusher(self) -> None:
            written: dict[str, int] = {}
            while True:
                time.sleep(0.1)
                if self.counts != written:
                    written = dict(self.counts)
                    self._flush()

        def _flush(self) -> None:
            counts = dict(self.counts)
            tmp = self.stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), **counts, "held": counts["loads"] - counts["evictions"]}))
            tmp.replace(self.stats_path)

        @serve.multiplexed(max_num_models_per_replica=max_models)
        async def get_model(self, model_id: str) -> Loaded:
            spec = json.loads((Path(models_dir) / f"{model_id}.json").read_text())
            work = model_work.Work(
                float(spec.get("load_ms", 0)),
                float(spec.get("service_ms", 0)),
                int(spec.get("size_bytes", 0)) if spec.get("hold_memory") else 0,
            )
            held = await model_work.load(work)
            self.counts["loads"] += 1
            return Loaded(self, spec, work, held)

        async def __call__(self, request: Request) -> dict[str, Any]:
            model_id = serve.get_multiplexed_model_id()
            model = await self.get_model(model_id)
            body = await request.json()
            return {"model": model_id, "y": await model.answer(body["x"])}

        async def ModelInfer(self, request: Any) -> Any:  # the RPC's name: Serve's gRPC routing calls it
            model_id = serve.get_multiplexed_model_id()
            model = await self.get_model(model_id)
            return make_infer_response(model_id, await model.answer(decode_infer_request(request)), len(model.bias))

    class Loaded:
        def __init__(self, owner: Any, spec: dict[str, Any], work: model_work.Work, held: model_work.Held) -> None:
            self.owner = owner
            self.weights = spec["weights"]
            self.bias = spec["bias"]
            self.work = work
            self.held: model_work.Held | None = held

        async def answer(self, rows: list[list[float]]) -> list[list[float]]:
            """The model's work for a request: its service time, then y = W x + b per row."""
            await model_work.serve(self.work)
            return [model_work.linear(self.weights, self.bias, row) for row in rows]

        def __del__(self) -> None:  # Ray calls it on eviction; the memory goes with `held`
            if self.held is not None:
                self.held = None
                self.owner.counts["evictions"] += 1

    return Models.bind()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="peers_ray.py")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, default=0, help="Serve's gRPC ingress too, on this port (0: none)")
    p.add_argument("--models-dir", required=True)
    p.add_argument("--stats-dir", required=True)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--temp-dir", help="Ray's session directory root (short path: it holds sockets)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--max-models", type=int, default=3)
    p.add_argument("--max-ongoing", type=int, default=64)
    a = p.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(
        include_dashboard=False,
        object_store_memory=128 << 20,  # nothing goes through the object store here
        log_to_driver=False,
        _temp_dir=a.temp_dir,
    )
    try:
        grpc: dict[str, Any] = {}
        if a.grpc_port:
            from ray.serve.config import gRPCOptions

            grpc["grpc_options"] = gRPCOptions(port=a.grpc_port, grpc_servicer_functions=[V2_SERVICER])
        serve.start(http_options={"host": "127.0.0.1", "port": a.port}, **grpc)
        app = build_app(a.models_dir, a.stats_dir, a.replicas, a.max_models, a.max_ongoing)
        serve.run(app, name="peers", route_prefix="/")
        Path(a.ready_file).write_text(json.dumps({"pid": os.getpid(), "ray": ray.__version__}))
        print(f"ray {ray.__version__} serve ready on 127.0.0.1:{a.port}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
