"""gRPC health checking (`grpc.health.v1`) and server reflection on meshd's ports.

Health answers SERVING for the whole server ("") and each named service once the instance
serves, and NOT_SERVING from the moment it starts stopping, so load balancers and Kubernetes
probes (`grpc:` probes) take it out before it goes. Reflection lets `grpcurl` and similar
tools call meshd without the .proto files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Imported for their descriptors: reflection describes these services and their messages.
from meshd._proto.inference import grpc_predict_v2_pb2
from meshd._proto.meshd import admin_pb2, peer_pb2
from meshd._proto.mmesh import model_mesh_pb2

EXTERNAL_SERVICES = (
    model_mesh_pb2.DESCRIPTOR.services_by_name["ModelMesh"].full_name,
    grpc_predict_v2_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["MeshAdmin"].full_name,
)
INTERNAL_SERVICES = (peer_pb2.DESCRIPTOR.services_by_name["MeshPeer"].full_name,)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """One health servicer per gRPC server, with the services it reports."""

    def __init__(self, server: Any, services: Sequence[str]) -> None:
        self.services = ("", *services)
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        names = (*services, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)

    async def set_serving(self, serving: bool) -> None:
        for name in self.services:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)
