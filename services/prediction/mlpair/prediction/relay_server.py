"""``mlpair relay``: the outbox relay in a process of its own (transactional outbox → message relay).

With ``relay_in_process`` off, PredictionService commits each decision to the decision ledger (the
outbox) and answers, and delivers nothing: this process claims the ledger's undelivered rows and
delivers them to the CRM database with the same :class:`~mlpair.prediction.recording.relay.LedgerRelay`
the serving processes run otherwise, so delivery's CPU is no longer paid by the process that
serves requests (docs/decisions/0007-relay-in-its-own-process.md).

* **Waking up.** In a serving process the relay is woken by the process's own commits
  (``ledger.committed``). Here nothing commits, so it looks at the ledger every ``relay_poll_ms``
  (100 ms by default): a claim that finds nothing costs one short transaction. A decision reaches
  the CRM at most about that much later than with the relay in process.
* **Several relay processes over one ledger are safe**, as several replicas' relays are:
  PostgreSQL claims with ``FOR UPDATE SKIP LOCKED`` never overlap. A SQLite ledger is supported
  only for processes on its machine, as its serving workers are: claims are leases
  (``LEASE_S``, :mod:`mlpair.prediction.recording.ledger_sqlite`) taken in short write transactions.
* **Health** (``grpc.health.v1`` on ``relay_port``, for Kubernetes probes): ``liveness`` SERVING
  while the process runs; readiness (``""`` and ``relay``) SERVING while the ledger answers, NOT_SERVING for
  good once it stops; status names ``ledger`` and ``crm`` for dashboards (the CRM being down only
  leaves decisions waiting in the ledger, so it never makes the relay unready).
* **Metrics** on ``relay_metrics_port``: the relay's ``prediction_outbox_delivered_total``,
  ``prediction_outbox_already_in_crm_total``, ``prediction_relay_failures_total``,
  ``prediction_crm_writes_total``, ``prediction_crm_write_duration_seconds``, the backlog gauges
  ``prediction_outbox_depth`` and ``prediction_outbox_oldest_age_seconds`` and
  ``prediction_dependency_up`` for ``ledger`` and ``crm``.
* **Shutdown.** On SIGTERM or SIGINT readiness turns NOT_SERVING, the relay claims nothing more,
  the batches in flight finish for up to ``shutdown_grace_s`` (a batch cut short is released,
  undelivered, for the next relay), the connections close and the process exits 0. Whatever is
  left waits in the ledger for any relay.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from mlpair.prediction import metrics
from mlpair.prediction.health import DependencyHealth, bounded, export_backlog
from mlpair.prediction.recording.recorder import DecisionRecorder, recorder_for
from mlpair.prediction.settings import PredictionSettings
from mlpair.rpc.drain import wait_for_termination_signal
from mlpair.rpc.server import bind_port

logger = logging.getLogger(__name__)

DEPENDENCIES = ("ledger", "crm")
RELAY = "relay"
"""Health name of the relay's readiness (besides ``""``), for the readiness probe."""


class RelayHealth(DependencyHealth):
    """``grpc.health.v1`` of the relay process: readiness from the ledger, a status name per
    dependency (see the module docstring), checked in the background."""

    def __init__(self) -> None:
        super().__init__([RELAY], {dep: dep for dep in DEPENDENCIES}, "relay-health")

    async def check(self, recorder: DecisionRecorder, timeout_s: float) -> dict[str, bool]:
        """Checks the ledger and the CRM once (each within ``timeout_s`` seconds), publishes
        readiness, the status names and the backlog gauges; returns ``{dependency: healthy}``."""
        ledger, crm = await asyncio.gather(
            bounded(recorder.ledger.probe, timeout_s), bounded(recorder.crm.ping, timeout_s)
        )
        status = {"ledger": ledger, "crm": crm}
        if ledger:
            await export_backlog(recorder.ledger, timeout_s)
        await self.publish(status)
        return status


def build_recorder(settings: PredictionSettings) -> DecisionRecorder:
    """The ledger, the CRM and a relay that polls every ``relay_poll_ms`` (no I/O yet); nothing
    commits here, so the relay claims up to ``relay_concurrency`` batches with all the ledger pool
    but one connection (3 with the default pool of 4)."""
    return recorder_for(settings, relay=True, relay_poll_s=settings.relay_poll_ms / 1000, relay_only=True)


async def start(settings: PredictionSettings) -> tuple[grpc.aio.Server, int, RelayHealth, DecisionRecorder]:
    """Binds the health port, opens the ledger and the CRM, starts the relay and reports readiness.

    Returns:
        The health server (started), its bound port, the health and the recorder whose relay runs.

    Raises:
        StartupError: the health port is in use.
        SchemaNotReady: the ledger or the CRM database has not been migrated (``mlpair migrate``).
        StartupError: the ledger or the CRM database is behind a pooler that loses the prepared
            statements their cache keeps (:mod:`mlpair.prediction.recording.pooler`).
    """
    from mlpair.prediction.recording.pooler import check_poolers

    await check_poolers(settings)
    recorder = build_recorder(settings)
    for model in settings.models:  # at zero from the start, as serving processes declare them: a
        for outcome in ("ok", "error"):  # restarted relay's first failed write then shows in rate()
            metrics.labelled(metrics.CRM_WRITES, model, outcome)
    health = RelayHealth()
    server = grpc.aio.server()
    health.add_to(server)
    port = bind_port(server, f"{settings.host}:{settings.relay_port}", None)  # plaintext: probes only
    try:
        await recorder.start()
    except BaseException:
        await recorder.close()
        raise
    await server.start()
    dependencies = await health.watch(recorder, settings.health_interval_ms / 1000)
    logger.info(
        "outbox relay running, health on port %d, polling the ledger every %d ms; dependencies: %s",
        port,
        settings.relay_poll_ms,
        dependencies,
    )
    return server, port, health, recorder


async def stop(server: grpc.aio.Server, health: RelayHealth, recorder: DecisionRecorder, grace_s: float) -> None:
    """Readiness NOT_SERVING, no new claims, the batches in flight finished within ``grace_s``
    seconds (:meth:`~mlpair.prediction.recording.relay.LedgerRelay.stop_claiming`), connections closed."""
    await health.stop_monitoring()
    await health.begin_drain()
    if recorder.relay is not None and not await recorder.relay.stop_claiming(grace_s):
        logger.warning("batches still in flight after %.1f s were released, undelivered, for the next relay", grace_s)
    await recorder.close()
    await server.stop(0)


async def serve(settings: PredictionSettings) -> None:
    """Runs the relay until SIGTERM/SIGINT, then stops it (:func:`stop`)."""
    stopped = asyncio.create_task(wait_for_termination_signal())
    await asyncio.sleep(0)  # its handlers are installed: a signal during start-up stops cleanly
    try:
        server, _, health, recorder = await start(settings)
    except BaseException:
        stopped.cancel()
        raise
    await stopped
    await stop(server, health, recorder, settings.shutdown_grace_s)
    logger.info("outbox relay stopped (%d decision(s) delivered)", recorder.relay.delivered if recorder.relay else 0)
