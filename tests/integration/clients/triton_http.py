"""KServe V2 REST health, metadata and repository calls with the real tritonclient.http, against meshd.

Run with the tritonclient-http venv's python (imports only tritonclient). Steps are given as
arguments and run in order; prints one JSON list with each step's result.
    live | ready | server | index | load:<model> | unload:<model> | ready:<model>
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True, help="host:port of meshd's REST port")
    p.add_argument("steps", nargs="+")
    a = p.parse_args()
    client = httpclient.InferenceServerClient(url=a.url)
    results: list[Any] = []
    for step in a.steps:
        verb, _, model = step.partition(":")
        try:
            if verb == "live":
                results.append(client.is_server_live())
            elif verb == "ready" and not model:
                results.append(client.is_server_ready())
            elif verb == "ready":
                results.append(client.is_model_ready(model))
            elif verb == "server":
                md = client.get_server_metadata()
                results.append([md.get("name"), md.get("extensions")])
            elif verb == "index":
                index = client.get_model_repository_index()
                results.append({m["name"]: [m.get("state", ""), m.get("reason", "")] for m in index})
            elif verb == "load":
                client.load_model(model)
                results.append("loaded")
            elif verb == "unload":
                client.unload_model(model)
                results.append("unloaded")
            else:
                raise SystemExit(f"unknown step {step!r}")
        except InferenceServerException as e:
            results.append({"error": str(e.status()), "message": e.message()})
    client.close()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
