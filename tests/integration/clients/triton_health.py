"""KServe health and metadata calls with the real tritonclient, no meshd headers at all.

Run with the tritonclient venv's python (imports only tritonclient): prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import tritonclient.grpc as grpcclient


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--loaded", required=True, help="a model loaded in the mesh")
    p.add_argument("--registered", required=True, help="a model registered but not loaded")
    p.add_argument("--vmodel", required=True, help="a vmodel whose active model is loaded")
    a = p.parse_args()
    client = grpcclient.InferenceServerClient(url=a.url)
    meta = client.get_model_metadata(a.loaded, as_json=True)
    out = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "server": client.get_server_metadata(as_json=True).get("name"),
        "loaded_ready": client.is_model_ready(a.loaded),
        "registered_ready": client.is_model_ready(a.registered),
        "unknown_ready": client.is_model_ready("no-such-model"),
        "vmodel_ready": client.is_model_ready(a.vmodel),
        "vmodel_header_ready": client.is_model_ready("ignored", headers={"mm-vmodel-id": a.vmodel}),
        "metadata_name": meta.get("name"),
        "metadata_inputs": [i["name"] for i in meta.get("inputs", [])],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
