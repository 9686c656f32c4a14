"""PredictionService health: readiness from what it cannot work without, and each dependency.

``grpc.health.v1`` names served:

* ``liveness`` — SERVING while the process answers at all, whatever the ledger, the outbox
  relay or the drain say (:mod:`mlpair.rpc.health`): the name for the liveness and the startup
  probe, so a ledger outage makes replicas unready, never restarts them, even one that starts
  during the outage.
* ``""`` and ``mlpair.prediction.v1.PredictionService`` — **readiness**: SERVING while the
  configuration is loaded (the process started) and the decision ledger answers: without it no
  decision can be recorded, so none is made (fail closed). Nothing else: with InferenceService
  down requests are still answered (stale or fallback), and with the CRM database down
  decisions still wait durably in the ledger. NOT_SERVING for good once the drain starts.
* ``mlpair.prediction.v1.PredictionService/<dependency>`` for ``inference``, ``crm``,
  ``cache`` and ``ledger`` — SERVING when that dependency is healthy. The service is
  **degraded** when it is ready while inference, CRM or cache is not; the
  ``prediction_degraded`` and ``prediction_dependency_up`` gauges say the same to Prometheus.

With ``relay_in_process`` off the CRM is checked and reported all the same, though this process
delivers nothing to it (``mlpair relay`` does, and reports its own health): ``crm`` then says
whether the CRM database answers this pod, which shares the relay's network and credentials, so
``prediction_degraded`` means the same thing whichever process delivers, and a CRM outage shows
on the service's dashboards rather than only on the relay's. Readiness stays the ledger alone.

A background check runs every ``health_interval_ms``: a read of the ledger table, ``SELECT 1``
on the CRM database, a cache ping, InferenceService's own health (and the circuit breaker, which
must not be open), and the ledger backlog gauges (the backlog is the shared ledger's: every
replica reports the same figure).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from mlpair.prediction import metrics
from mlpair.prediction.scoring.resilience import CircuitState
from mlpair.rpc.health import Health

logger = logging.getLogger(__name__)

DEPENDENCIES = ("inference", "crm", "cache", "ledger")


async def bounded(check: Callable[[], Awaitable[object]], timeout_s: float) -> bool:
    """Whether ``check()`` answered truthy within ``timeout_s`` seconds; a hung or failing check is
    an unhealthy dependency. The check's coroutine is made here, not by the caller: a check
    cancelled before it starts (the service stopping) leaves no coroutine that was never awaited."""
    try:
        async with asyncio.timeout(timeout_s):
            return bool(await check())
    except Exception:  # noqa: BLE001  (a hung or failing check is an unhealthy dependency)
        return False


async def export_backlog(ledger, timeout_s: float) -> None:
    """The shared ledger's backlog gauges (``prediction_outbox_depth``, ``_oldest_age_seconds``),
    read within ``timeout_s`` seconds; they keep their last value when it cannot be read."""
    try:
        async with asyncio.timeout(timeout_s):
            depth, age_s = await ledger.backlog()
        metrics.OUTBOX_DEPTH.set(depth)
        metrics.OUTBOX_OLDEST_AGE.set(age_s)
    except Exception:  # noqa: BLE001  (the gauges keep their last value)
        logger.debug("ledger backlog unavailable", exc_info=True)


class DependencyHealth(Health):
    """:class:`~mlpair.rpc.health.Health` with readiness from the decision ledger and a status name
    per dependency: what PredictionService and the relay process (``mlpair relay``) publish.

    Args:
        service_names: readiness names besides "".
        dependency_names: dependency → its status name.
        task_name: the name of the background re-check's task.
    """

    def __init__(self, service_names: list[str], dependency_names: dict[str, str], task_name: str) -> None:
        super().__init__(service_names)
        self.dependency_names = dependency_names
        self.task_name = task_name
        self.status: dict[str, bool] = {}

    async def check(self, target, timeout_s: float) -> dict[str, bool]:
        """Checks every dependency of ``target`` once, publishes the result and returns it."""
        raise NotImplementedError

    async def watch(self, target, interval_s: float) -> str:
        """Checks ``target``'s dependencies now and then every ``interval_s`` seconds in the background
        until :meth:`stop_monitoring`; the first check as one line for the start-up log
        (``inference up, crm DOWN, …``)."""
        status = await self.check(target, timeout_s=interval_s)
        self.monitor(lambda: self.check(target, timeout_s=interval_s), interval_s, self.task_name)
        return ", ".join(f"{k} {'up' if v else 'DOWN'}" for k, v in status.items())

    async def publish(self, status: dict[str, bool]) -> None:
        """Each dependency's status name and ``prediction_dependency_up`` (a change logged), then
        readiness from ``status["ledger"]``."""
        for dep, healthy in status.items():
            if self.status.get(dep, True) != healthy:
                (logger.info if healthy else logger.warning)(
                    "dependency %s is %s", dep, "healthy" if healthy else "DOWN"
                )
            metrics.DEPENDENCY_UP.labels(dep).set(1 if healthy else 0)
            await self.set_status(self.dependency_names[dep], healthy)
        self.status = dict(status)
        await self.set_serving(status["ledger"])


class PredictionHealth(DependencyHealth):
    """``grpc.health.v1`` for PredictionService: readiness from the ledger and a status name per
    dependency (:class:`DependencyHealth`), checked in the background.

    Args:
        service_name: the full service name (readiness is reported under it and under "").
    """

    def __init__(self, service_name: str) -> None:
        super().__init__([service_name], {dep: f"{service_name}/{dep}" for dep in DEPENDENCIES}, "prediction-health")

    async def check(self, components, timeout_s: float) -> dict[str, bool]:
        """Checks every dependency of ``components`` (:class:`~mlpair.prediction.composition.PredictionComponents`)
        once and publishes readiness and per-dependency health.

        Returns:
            ``{dependency: healthy}`` for each of :data:`DEPENDENCIES`.
        """
        recorder, scorer = components.recorder, components.scorer
        ledger, crm, cache, inference_ready = await asyncio.gather(
            bounded(recorder.ledger.probe, timeout_s),
            bounded(recorder.crm.ping, timeout_s),
            bounded(scorer.cache.ping, timeout_s),
            bounded(lambda: scorer.client.ready(timeout_s), timeout_s),
        )
        inference = inference_ready and scorer.caller.breaker.state is not CircuitState.OPEN
        status = {"inference": inference, "crm": crm, "cache": cache, "ledger": ledger}
        if ledger:
            await export_backlog(recorder.ledger, timeout_s)
        await self.publish(status)
        metrics.DEGRADED.set(0 if inference and crm and cache else 1)
        return status
