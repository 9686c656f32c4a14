"""``grpc.health.v1`` for InferenceService: overall, per service and per model.

Names and their meaning (readiness, for Kubernetes readiness probes and load balancers):

* ``""`` (overall), ``mlpair.inference.v1.InferenceService`` and
  ``inference.GRPCInferenceService``: SERVING when the server is ready — every expected model
  has a loaded, verified and warmed version, and the server is not draining;
* ``<model name>`` (e.g. ``credit-risk``): SERVING when that model has a serving version.

Everything starts NOT_SERVING and turns NOT_SERVING again at once on SIGTERM, when open Watch
streams end too. Liveness is the name ``liveness`` (:mod:`mlpair.rpc.health`): SERVING while the
port answers, whatever the models and the drain (the OIP ``ServerLive`` RPC says the same).
Both services publish through the one helper, :class:`mlpair.rpc.health.Health`.
"""

from __future__ import annotations

from mlpair.inference.engine import InferenceEngine
from mlpair.rpc.health import Health


async def publish_readiness(health: Health, engine: InferenceEngine) -> None:
    """Publishes the engine's readiness: the server's on the service names, each model's on its
    name (every expected or serving model; one that was unloaded turns NOT_SERVING)."""
    repo = engine.repository
    models = {name: engine.model_ready(name) for name in repo.expected | set(repo.serving())}
    await health.set_serving(engine.ready(), models)


async def publish_loading(health: Health, engine: InferenceEngine) -> None:
    """Publishes "not ready" on every name, models to load included (before the load starts)."""
    await health.set_serving(False, {name: False for name in engine.repository.model_names()})
