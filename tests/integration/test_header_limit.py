"""MM_SVC_GRPC_MAX_HEADERS_SIZE: a request whose headers the external port takes is never
refused for its size when forwarded to a peer (the internal port leaves room for what a
forward adds), and the limit is firm (meshd sets grpc's soft and hard limits alike, so a
size is not refused at random). "Firm", not byte-exact: the client's own `grpc-timeout`
header changes length with the time left (e.g. `29999m` or `30S`), so the boundary moves by
a few bytes between calls."""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc
import pytest

from meshd._proto.mmesh import model_mesh_pb2 as mm
from meshd.runtimes.models import GeneratedModel, decode_infer_response, make_infer_request

from .conftest import Client, NodeFactory, close_enough, expected

pytestmark = [pytest.mark.slow, pytest.mark.both_data_planes]

ROWS = [[0.5, -1.0, 2.0, 0.25]]
# Well under grpc's default soft limit (8 KiB), so the runtime behind never refuses at random.
LIMIT = 4096
JITTER = 16  # bytes the client's grpc-timeout header may vary by between calls


def largest_accepted(accepts: Callable[[int], bool], high: int) -> int:
    """The largest n in [0, high) with accepts(n), for `accepts` true up to a point."""
    low = 0  # accepts(low) holds
    while high - low > 1:
        mid = (low + high) // 2
        if accepts(mid):
            low = mid
        else:
            high = mid
    return low


def test_headers_the_external_port_takes_pass_a_forward(start_node: NodeFactory, models: list[GeneratedModel]) -> None:
    settings: dict[str, str | int] = {
        "max_headers_size": LIMIT,
        "type_constraints": json.dumps({"demo-gpu": {"required": ["gpu"]}}),
    }
    b = start_node("inst-b", settings={**settings, "labels": "gpu"})
    a = start_node("inst-a", settings=settings)  # cannot load demo-gpu: forwards to b
    m = models[0]
    info = mm.ModelInfo(type="demo-gpu", path=str(m.path))
    req = mm.RegisterModelRequest(modelId=m.id, modelInfo=info, loadNow=True, sync=True)
    assert b.mm.registerModel(req, timeout=30).status == mm.ModelStatusInfo.LOADED

    unknown = m.id[:-1] + "x"  # as long as m.id, so its headers are as large as m's

    def padded(model_id: str, n: int) -> tuple[tuple[str, str], ...]:
        return (("mm-model-id", model_id), ("x-pad", "p" * n))

    def external_port_takes(n: int) -> bool:
        # An unknown model: meshd's external port alone decides (no runtime, no peer).
        try:
            infer(a, m, padded(unknown, n))
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND), e
            return e.code() == grpc.StatusCode.NOT_FOUND
        raise AssertionError(f"{unknown} was served")

    found = largest_accepted(external_port_takes, LIMIT)
    pad = found - JITTER  # surely under the limit, whatever the timeout header's length
    assert pad > 0
    assert all(not external_port_takes(found + JITTER) for _ in range(5))  # firm: never at random
    assert all(external_port_takes(pad) for _ in range(5))
    before = b.stats().requests
    served = infer(a, m, padded(m.id, pad))  # forwarded by a to b with meshd's own headers added
    assert close_enough(served, expected(m, ROWS))
    assert b.stats().requests > before


def infer(c: Client, m: GeneratedModel, metadata: tuple[tuple[str, str], ...]) -> list[list[float]]:
    resp = c.v2.ModelInfer(make_infer_request(m.id, ROWS), metadata=metadata, timeout=30)
    return decode_infer_response(resp)
