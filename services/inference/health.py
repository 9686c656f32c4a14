"""``grpc.health.v1`` for InferenceService: overall, per service and per model.

Names and their meaning (readiness, for Kubernetes readiness probes and load balancers):

* ``""`` (overall), ``mlpair.inference.v1.InferenceService`` and
  ``inference.GRPCInferenceService``: SERVING when the server is ready — every expected model
  has a loaded, verified and warmed version, and the server is not draining;
* ``<model name>`` (e.g. ``credit-risk``): SERVING when that model has a serving version.

Everything starts NOT_SERVING and turns NOT_SERVING again at once on SIGTERM, when open Watch
streams end too. Liveness is the name ``liveness`` (:mod:`mlpair.lifecycle`): SERVING while the
port answers, whatever the models and the drain (the OIP ``ServerLive`` RPC says the same).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.lifecycle import LifecycleHealthServicer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServingHealth:
    """Publishes the engine's readiness on the standard health service."""

    def __init__(self, service_names: list[str]) -> None:
        self.servicer = LifecycleHealthServicer()
        self._server_names = ["", *service_names]
        self._models: set[str] = set()

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def update(self, server_ready: bool, models: dict[str, bool]) -> None:
        """Sets the server names to ``server_ready`` and each model name to its own readiness.

        Models that disappeared (unloaded) turn NOT_SERVING rather than unknown, so a watcher
        sees the change.
        """
        for name in self._server_names:
            await self.servicer.set(name, SERVING if server_ready else NOT_SERVING)
        for name in self._models - models.keys():
            await self.servicer.set(name, NOT_SERVING)
        for name, ready in models.items():
            await self.servicer.set(name, SERVING if ready else NOT_SERVING)
        self._models |= models.keys()

    async def shutdown(self) -> None:
        """NOT_SERVING for every readiness name, for good (later updates are ignored); open Watch
        streams end; ``liveness`` stays SERVING."""
        await self.servicer.begin_drain([*self._server_names, *sorted(self._models)])
