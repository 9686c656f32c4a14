"""``grpc.health.v1`` for InferenceService: overall, per service and per model.

Names and their meaning (readiness, for Kubernetes readiness probes and load balancers):

* ``""`` (overall), ``mlpair.inference.v1.InferenceService`` and
  ``inference.GRPCInferenceService``: SERVING when the server is ready — every expected model
  has a loaded, verified and warmed version, and the server is not draining;
* ``<model name>`` (e.g. ``credit-risk``): SERVING when that model has a serving version that
  is healthy now (:mod:`mlpair.inference.model_health`); the server's names also need every
  expected model so, and no server-level condition (e.g. a lost device).

Everything starts NOT_SERVING and turns NOT_SERVING again at once on SIGTERM, when open Watch
streams end too. Liveness is the name ``liveness`` (:mod:`mlpair.rpc.health`): SERVING while the
port answers, whatever the models and the drain (the OIP ``ServerLive`` RPC says the same).
InferenceService turns ``liveness`` NOT_SERVING (and OIP ``ServerLive`` false) once, for good, when
a runtime raises a sticky CUDA error (:meth:`InferenceEngine.mark_device_lost`): the process can
never run a model again and the kubelet restarts it; every recoverable state leaves it SERVING.
Both services publish through the one helper, :class:`mlpair.rpc.health.Health`.
"""

from __future__ import annotations

from mlpair.inference.engine import InferenceEngine
from mlpair.rpc.health import Health


async def publish_readiness(health: Health, engine: InferenceEngine) -> None:
    """Publishes the engine's readiness: the server's on the service names, each model's on its
    name (every expected or serving model; one that was unloaded turns NOT_SERVING); and its
    liveness on ``liveness`` (NOT_SERVING once the device is lost)."""
    repo = engine.repository
    models = {name: engine.model_ready(name) for name in repo.expected | set(repo.serving())}
    await health.set_serving(engine.ready(), models)
    if not engine.live():
        await health.set_live(False)


async def publish_loading(health: Health, engine: InferenceEngine) -> None:
    """Publishes "not ready" on every name, models to load included (before the load starts)."""
    await health.set_serving(False, {name: False for name in engine.repository.model_names()})
