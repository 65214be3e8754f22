"""Run the real tritonclient (gRPC) against a KServe V2 endpoint and print what came back.

Runs in the tritonclient venv (see tests/integration/test_tritonclient.py), never in meshd's,
so it imports only tritonclient, numpy and the standard library.

For each batch given (a JSON list of batches, each a list of FP32 rows), it sends:
  * infer: one ModelInfer (`InferenceServerClient.infer`), the model id in the header;
  * stream: one request per batch on a single ModelStreamInfer stream (`start_stream` with
    the header, `async_stream_infer` per batch, `stop_stream`), every callback recorded.

It prints one JSON object: {"infer": [...], "stream": [...], "errors": [...]}, each result
{"id": request id, "outputs": rows of output "y"}, and exits 1 if there was any error.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

INPUT_NAME = "x"
OUTPUT_NAME = "y"


def _inputs(rows: list[list[float]]) -> list[grpcclient.InferInput]:
    data = np.asarray(rows, dtype=np.float32)
    tensor = grpcclient.InferInput(INPUT_NAME, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)  # raw_input_contents, as the reference runtime reads it
    return [tensor]


def _result(result: grpcclient.InferResult) -> dict[str, Any]:
    outputs = result.as_numpy(OUTPUT_NAME)
    return {
        "id": result.get_response().id,
        "outputs": None if outputs is None else outputs.tolist(),
    }


def _error(where: str, e: InferenceServerException) -> dict[str, Any]:
    return {"where": where, "status": e.status(), "message": e.message()}


def run_infer(
    client: grpcclient.InferenceServerClient,
    model_name: str,
    headers: dict[str, Any],
    batches: list[list[list[float]]],
    timeout_s: float,
    out: dict[str, list[Any]],
) -> None:
    for i, rows in enumerate(batches):
        try:
            result = client.infer(
                model_name, _inputs(rows), request_id=f"infer-{i}", headers=headers, client_timeout=timeout_s
            )
        except InferenceServerException as e:
            out["errors"].append(_error(f"infer-{i}", e))
            continue
        out["infer"].append(_result(result))


def run_stream(
    client: grpcclient.InferenceServerClient,
    model_name: str,
    headers: dict[str, Any],
    batches: list[list[list[float]]],
    timeout_s: float,
    out: dict[str, list[Any]],
) -> None:
    lock = threading.Lock()
    done = threading.Event()
    answered = 0

    def callback(result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
        # Called on tritonclient's response thread, once per response and once more if the RPC fails.
        nonlocal answered
        with lock:
            if error is not None:
                out["errors"].append(_error("stream", error))
                if error.status() is not None:  # a gRPC status: the whole stream has ended
                    done.set()
                    return
            else:
                assert result is not None
                out["stream"].append(_result(result))
            answered += 1
            if answered == len(batches):
                done.set()

    client.start_stream(callback, stream_timeout=timeout_s, headers=headers)
    try:
        for i, rows in enumerate(batches):
            try:
                client.async_stream_infer(model_name, _inputs(rows), request_id=f"stream-{i}")
            except InferenceServerException as e:  # the stream already failed
                out["errors"].append(_error(f"stream-{i}", e))
                break
        if not done.wait(timeout_s):
            out["errors"].append({"where": "stream", "status": None, "message": f"no answer in {timeout_s}s"})
    finally:
        client.stop_stream(cancel_requests=not done.is_set())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="host:port of the gRPC endpoint")
    p.add_argument("--model-id", required=True, help="sent in the model-id header")
    p.add_argument("--header-name", default="mm-model-id", help="header carrying the model id (-bin: as bytes)")
    p.add_argument("--model-name", default=None, help="model_name in the request body (default: the model id)")
    p.add_argument("--batches", required=True, help="JSON list of batches, each a list of rows of floats")
    p.add_argument("--mode", choices=["infer", "stream", "both"], default="both")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call, and for the whole stream")
    args = p.parse_args(argv)

    batches = json.loads(args.batches)
    value: str | bytes = args.model_id.encode() if args.header_name.endswith("-bin") else args.model_id
    headers: dict[str, Any] = {args.header_name: value}
    model_name = args.model_name if args.model_name is not None else args.model_id
    out: dict[str, list[Any]] = {"infer": [], "stream": [], "errors": []}

    with grpcclient.InferenceServerClient(args.url) as client:
        if args.mode in ("infer", "both"):
            run_infer(client, model_name, headers, batches, args.timeout, out)
        if args.mode in ("stream", "both"):
            run_stream(client, model_name, headers, batches, args.timeout, out)

    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
