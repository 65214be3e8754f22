"""KServe V2 inference over HTTP with the real tritonclient.http, against meshd's REST port.

Run with the tritonclient-http venv's python (imports tritonclient and numpy only). Infers
the linear model with FP32 rows (binary and JSON, both ways) and the echo model with one
tensor of each datatype, and asks for the linear model's metadata; prints one JSON object
with what came back.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

ECHO = {
    "BOOL": np.array([[True, False, True]]),
    "INT8": np.array([[-128, 0, 127]], dtype=np.int8),
    "UINT16": np.array([[0, 1, 65535]], dtype=np.uint16),
    "INT64": np.array([[-(2**62), 0, 2**62]], dtype=np.int64),
    "UINT64": np.array([[0, 1, 2**64 - 1]], dtype=np.uint64),
    "FP16": np.array([[0.5, -1.5, 2.0]], dtype=np.float16),
    "FP64": np.array([[0.1, -1e300, 3.0]], dtype=np.float64),
    "BYTES": np.array([[b"a", b"", "h\u00e9".encode()]], dtype=np.object_),
}


def linear(client: Any, model: str, rows: list[list[float]], binary: bool, headers: dict[str, str]) -> Any:
    x = httpclient.InferInput("x", [len(rows), len(rows[0])], "FP32")
    x.set_data_from_numpy(np.array(rows, dtype=np.float32), binary_data=binary)
    out = httpclient.InferRequestedOutput("y", binary_data=binary)
    result = client.infer(model, [x], outputs=[out], request_id=f"r-{binary}", headers=headers)
    return {"id": result.get_response().get("id"), "y": result.as_numpy("y").tolist()}


def echo(client: Any, model: str, binary: bool) -> dict[str, bool]:
    inputs = []
    for name, array in ECHO.items():
        tensor = httpclient.InferInput(name, list(array.shape), name)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in ECHO]
    result = client.infer(model, inputs, outputs=outputs)
    same = {}
    for name, array in ECHO.items():
        got = result.as_numpy(name)
        if name == "BYTES" and not binary:  # JSON carries text: tritonclient gives str back
            got = np.array([[v.encode() if isinstance(v, str) else v for v in row] for row in got], dtype=np.object_)
        same[name] = bool(got is not None and got.shape == array.shape and (got == array).all())
    return same


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--linear", required=True)
    p.add_argument("--echo", required=True)
    p.add_argument("--vmodel", required=True)
    p.add_argument("--rows", required=True, help="JSON rows for the linear model")
    a = p.parse_args()
    rows = json.loads(a.rows)
    client = httpclient.InferenceServerClient(url=a.url)
    out: dict[str, Any] = {
        "binary": linear(client, a.linear, rows, True, {}),
        "json": linear(client, a.linear, rows, False, {}),
        "vmodel": linear(client, "any-name", rows, True, {"mm-vmodel-id": a.vmodel}),
        "echo_binary": echo(client, a.echo, True),
        "echo_json": echo(client, a.echo, False),
        "metadata": client.get_model_metadata(a.linear),
        "vmodel_metadata": client.get_model_metadata("any-name", headers={"mm-vmodel-id": a.vmodel}),
    }
    try:
        linear(client, "no-such-model", rows, True, {})
    except InferenceServerException as e:
        out["missing"] = {"status": str(e.status()), "message": e.message()}
    client.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
