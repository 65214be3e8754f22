"""Run the real tritonclient (gRPC) against meshd for a language model: one ModelInfer and one
ModelStreamInfer with `text_input` (BYTES), as Dynamo's KServe frontend maps completions.

Runs in the tritonclient venv, never in meshd's. Prints one JSON object:
{"infer": {"text", "finish_reason"}, "stream": [{"text", "finish_reason"}, ...],
 "metadata": {...}, "config": {...}, "errors": [...]}; exits 1 if there was any error.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def _inputs(prompt: str, streaming: bool | None) -> list[grpcclient.InferInput]:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs = [text]
    if streaming is not None:
        flag = grpcclient.InferInput("streaming", [1], "BOOL")
        flag.set_data_from_numpy(np.array([streaming], dtype=bool))
        inputs.append(flag)
    return inputs


def _decode(result: grpcclient.InferResult) -> dict[str, Any]:
    text = result.as_numpy("text_output")
    reason = result.as_numpy("finish_reason")
    return {
        "text": b"".join(text.tolist()).decode() if text is not None else None,
        "finish_reason": b"".join(reason.tolist()).decode() if reason is not None else None,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="the mesh")
    p.add_argument("--parameters", default="{}", help="JSON request parameters (max_tokens, temperature, ...)")
    a = p.parse_args()
    parameters = json.loads(a.parameters)
    out: dict[str, Any] = {"errors": []}
    client = grpcclient.InferenceServerClient(a.url)
    try:
        out["metadata"] = client.get_model_metadata(a.model, as_json=True)
        out["config"] = client.get_model_config(a.model, as_json=True)
        result = client.infer(a.model, _inputs(a.prompt, None), request_id="unary", parameters=parameters)
        out["infer"] = _decode(result)
    except InferenceServerException as e:
        out["errors"].append({"where": "unary", "status": e.status(), "message": e.message()})
    answers: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer(a.model, _inputs(a.prompt, True), request_id="streamed", parameters=parameters)
    out["stream"] = []
    while True:
        try:
            result, error = answers.get(timeout=60)
        except queue.Empty:
            out["errors"].append({"where": "stream", "message": "no answer within 60 s"})
            break
        if error is not None:
            out["errors"].append({"where": "stream", "message": str(error)})
            break
        piece = _decode(result)
        out["stream"].append(piece)
        if piece["finish_reason"]:
            break
    client.stop_stream()
    client.close()
    print(json.dumps(out))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
