"""The KServe model-repository extension with the real tritonclient, against meshd.

Run with the tritonclient venv's python (imports only tritonclient). Steps are given as
arguments and run in order; prints one JSON list with each step's result.
    index | load:<model> | unload:<model> | ready:<model>
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("steps", nargs="+")
    a = p.parse_args()
    client = grpcclient.InferenceServerClient(url=a.url)
    results: list[Any] = []
    for step in a.steps:
        verb, _, model = step.partition(":")
        try:
            if verb == "index":
                index = client.get_model_repository_index(as_json=True).get("models", [])
                results.append({m["name"]: [m.get("state", ""), m.get("reason", "")] for m in index})
            elif verb == "load":
                client.load_model(model)
                results.append("loaded")
            elif verb == "unload":
                client.unload_model(model)
                results.append("unloaded")
            elif verb == "ready":
                results.append(client.is_model_ready(model))
            else:
                raise SystemExit(f"unknown step {step!r}")
        except InferenceServerException as e:
            results.append({"error": str(e.status()), "message": e.message()})
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
