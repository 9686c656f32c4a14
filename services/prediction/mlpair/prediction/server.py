"""PredictionService process: wiring, start-up checks, readiness and graceful drain.

Start-up refuses to run when the configured feature schema is not the one the model was
trained on, or when the decision ledger or the CRM database lacks the schema this release uses
(``mlpair migrate`` has not run; the server never migrates). The CRM database and InferenceService
may be down: decisions wait in the ledger, and requests are served stale or by the fallback. The
ledger may be down at start-up too: the server then starts not ready. Readiness and
per-dependency health are described in :mod:`mlpair.prediction.health`.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.collector import tune_collector
from mlpair.logs import count_failures_with
from mlpair.observability.calls import observe_servicer
from mlpair.prediction import metrics
from mlpair.prediction.composition import PredictionComponents, build_components
from mlpair.prediction.errors import DOMAIN
from mlpair.prediction.feedback.store import OutcomeStore
from mlpair.prediction.health import PredictionHealth
from mlpair.prediction.intake.limits import CallerGate, build_gate
from mlpair.prediction.intake.priority import PriorityPolicy
from mlpair.prediction.intake.servicer import PredictionServicer, count_refused_calls
from mlpair.prediction.pipeline import Predictor
from mlpair.prediction.settings import PredictionSettings
from mlpair.rpc import Service, build_server, drain, wait_for_termination_signal

logger = logging.getLogger(__name__)

SERVICE_NAME = "mlpair.prediction.v1.PredictionService"
SHUTDOWN_DELIVERY_S = 5.0  # at most this much of the grace goes to delivering what this replica recorded


def create_server(
    settings: PredictionSettings,
    predictor: Predictor,
    *,
    tracer_provider=None,
    shared_port: bool = False,
    outcomes: OutcomeStore | None = None,
    gate: CallerGate | None = None,
) -> tuple[grpc.aio.Server, int, PredictionHealth]:
    """Builds the server with PredictionService and health (:func:`mlpair.rpc.server.build_server`)
    and binds its port (0 = free port): with SO_REUSEPORT when ``shared_port`` (one of a
    supervisor's workers), else exclusively. ``outcomes``: where RecordOutcomes stores (None: it is
    refused UNIMPLEMENTED); ``gate``: callers and their limits (None: built from ``settings``).

    Raises:
        StartupError: the port is in use.
    """
    health = PredictionHealth(SERVICE_NAME)
    count_failures_with("prediction", lambda stage: metrics.OBSERVABILITY_ERRORS.labels(stage).inc())

    def observe(servicer: object, name: str) -> None:
        # spans and log context; tracer_provider None = the global one
        observe_servicer(servicer, name, "prediction", tracer_provider)

    server, port = build_server(
        settings,
        [
            Service(
                SERVICE_NAME,
                PredictionServicer(
                    predictor,
                    settings.max_chunk_rows,
                    outcomes,
                    settings.max_outcome_items,
                    PriorityPolicy(
                        settings.priority_levels,
                        settings.priority_online,
                        settings.priority_bulk,
                        settings.priority_allow_raise,
                    ),
                    gate or build_gate(settings),
                ),
                pb_grpc.add_PredictionServiceServicer_to_server,
                count_refused_calls(predictor),
            )
        ],
        health,
        domain=DOMAIN,
        shared_port=shared_port,
        observe=observe if settings.tracing else None,
    )
    return server, port, health


async def start(
    settings: PredictionSettings, *, tracer_provider=None, shared_port: bool = False
) -> tuple[grpc.aio.Server, int, PredictionHealth, PredictionComponents]:
    """Builds the components (:func:`~mlpair.prediction.composition.build_components`), opens the
    decision ledger, starts the relay (unless ``relay_in_process`` is off) and the server, and
    reports readiness.

    Raises:
        ConfigurationError: inconsistent configuration.
        SchemaNotReady: the ledger or the CRM database has not been migrated (``mlpair migrate``).
        StartupError: the ledger or the CRM database is behind a pooler that loses the prepared
            statements their cache keeps (:mod:`mlpair.prediction.recording.pooler`).
    """
    from mlpair.prediction.recording.pooler import check_poolers

    await check_poolers(settings)
    components = build_components(settings, tracer_provider=tracer_provider)
    await components.start()
    try:
        server, port, health = create_server(
            settings,
            components.predictor,
            tracer_provider=tracer_provider,
            shared_port=shared_port,
            outcomes=components.feedback.store if components.feedback else None,
            gate=components.gate,
        )
    except BaseException:
        await components.recorder.close(drain_timeout_s=0)
        raise
    await server.start()
    components.drift.start(settings.drift_interval_s)
    if components.feedback is not None:
        components.feedback.start(settings.outcome_refresh_s)
    dependencies = await health.watch(components, settings.health_interval_ms / 1000)
    logger.info(
        "PredictionService serving on port %d (inference at %s); dependencies: %s; decision events: %s",
        port,
        settings.inference_target,
        dependencies,
        f"{_host_of(settings.events_url)} stream {settings.events_stream}" if settings.events_url else "off",
    )
    return server, port, health, components


async def stop(
    server: grpc.aio.Server,
    health: PredictionHealth,
    components: PredictionComponents,
    grace_s: float,
    accept_s: float = 0.0,
) -> None:
    """Drains in-flight calls (:func:`mlpair.rpc.drain.drain`), delivers what it can of the ledger's
    backlog (when this process runs the relay: otherwise the ledger keeps it for ``mlpair relay``),
    then closes every connection (:meth:`PredictionComponents.close`)."""
    await health.stop_monitoring()  # first, so no check turns readiness back on
    await drain(server, health, grace_s=grace_s, accept_s=accept_s)
    await components.close(delivery_s=min(grace_s, SHUTDOWN_DELIVERY_S))


async def serve(settings: PredictionSettings, *, shared_port: bool = False) -> None:
    """Runs until SIGTERM/SIGINT, then drains; ``shared_port``: as one of a supervisor's workers, each
    with its own ledger pool, relay (unless ``relay_in_process`` is off), cache and breaker over the
    one shared ledger."""
    # The handlers first: a SIGTERM while the ledger is opened or the families load then starts
    # the drain as soon as the server is up, instead of the default exit mid-start.
    stopped = asyncio.create_task(wait_for_termination_signal())
    await asyncio.sleep(0)  # its handlers are installed
    try:
        server, _, health, components = await start(settings, shared_port=shared_port)
    except BaseException:
        stopped.cancel()
        raise
    tune_collector()
    await stopped
    await stop(server, health, components, settings.shutdown_grace_s, settings.shutdown_accept_ms / 1000)
    logger.info("PredictionService stopped")


def _host_of(url: str) -> str:
    """``url``'s scheme, host and port, without credentials (a log line never carries a password)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"
