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
from mlpair.logs import add_personal_fields, count_failures_with, set_process_model_version
from mlpair.observability.calls import observe_servicer
from mlpair.prediction import metrics
from mlpair.prediction.crm.recorder import recorder_for
from mlpair.prediction.drift import DriftMonitors, drift_config
from mlpair.prediction.errors import DOMAIN
from mlpair.prediction.health import PredictionHealth
from mlpair.prediction.pipeline import ConfigurationError, ModelFamily, Predictor
from mlpair.prediction.scoring.factory import build_scorer
from mlpair.prediction.servicer import PredictionServicer, count_refused_calls
from mlpair.prediction.settings import PredictionSettings
from mlpair.rpc import Service, build_server, drain, wait_for_termination_signal

logger = logging.getLogger(__name__)

SERVICE_NAME = "mlpair.prediction.v1.PredictionService"
SHUTDOWN_DELIVERY_S = 5.0  # at most this much of the grace goes to delivering what this replica recorded


def load_families(settings: PredictionSettings) -> dict[str, ModelFamily]:
    """Every served model family, checked against the settings (files only: no network I/O).

    A supervisor calls it before starting its workers, so a configuration error is one line from
    one process rather than the same line from each worker.

    Raises:
        ConfigurationError: schema, policy and model repository disagree, or the default,
            ensemble or shadow families are not among the served ones.
    """
    names = settings.models or [settings.model_name]
    if settings.model_name not in names:
        raise ConfigurationError(
            f"default model family {settings.model_name!r} is not among the served {names}: set "
            f"--model-name / PREDICTION_MODEL_NAME to one of them"
        )
    if unserved := sorted((set(settings.ensembles) | set(settings.shadows)) - set(names)):
        raise ConfigurationError(f"ensemble or shadow configured for {unserved}, which are not served")
    return {
        name: ModelFamily.load(
            name,
            settings.config_dir,
            settings.model_repository,
            ensemble=settings.ensembles.get(name, ()),
            shadow=settings.shadows.get(name),
        )
        for name in names
    }


def scoring_bound_s(settings: PredictionSettings) -> float:
    """The longest an item's scoring takes when its deadline does not cut it short, in seconds: a
    wait in the coalescer's lane, then every Infer attempt and every backoff at its longest
    (``inference_timeout_ms`` each), twice (a cache follower whose leader failed leads a flight
    of its own)."""
    attempt_s = 2 * settings.inference_timeout_ms / 1000  # the attempt, then its backoff
    return 2 * (settings.coalesce_max_delay_ms / 1000 + settings.inference_max_attempts * attempt_s)


def build_predictor(settings: PredictionSettings, *, tracer_provider=None) -> Predictor:
    """Loads every served model family (:func:`load_families`) and builds its dependencies (no
    network I/O yet).

    ``tracer_provider``: where spans go (None = the global one, set in ``main()``).

    Raises:
        ConfigurationError: see :func:`load_families`.
    """
    families = load_families(settings)
    recorder = recorder_for(settings)
    # Observability (issue 6): CRM spans, personal fields kept out of logs, drift monitoring.
    if settings.tracing:
        recorder.instrument(tracer_provider)
    for family in families.values():
        add_personal_fields(family.entry.preprocessing.feature_schema.personal_data)
    set_process_model_version(",".join(f"{name}:{f.entry.manifest.model_version}" for name, f in families.items()))
    for name, family in families.items():
        metrics.declare(name, family.policy.decisions)
    drift = DriftMonitors.for_families(families, drift_config(settings))
    return Predictor(
        families,
        settings.model_name,
        build_scorer(settings, tracer_provider=tracer_provider),
        recorder,
        max_inference_rows=settings.inference_max_batch_rows,
        max_batch_items=settings.max_batch_items,
        merge_max_calls=settings.merge_max_calls,
        merge_max_delay_s=settings.merge_max_delay_ms / 1000,
        merge_deadline_window_s=settings.crm_reserve_ms / 2000,  # half the time kept back to record
        merge_scoring_bound_s=scoring_bound_s(settings),
        merge_wait_from_calls=settings.merge_wait_from_calls,
        explain_top_k=settings.explain_top_reasons,
        drift=drift,
        unknown_attributes=settings.unknown_attributes,
    )


def create_server(
    settings: PredictionSettings, predictor: Predictor, *, tracer_provider=None, shared_port: bool = False
) -> tuple[grpc.aio.Server, int, PredictionHealth]:
    """Builds the server with PredictionService and health (:func:`mlpair.rpc.server.build_server`)
    and binds its port (0 = free port): with SO_REUSEPORT when ``shared_port`` (one of a
    supervisor's workers), else exclusively.

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
                PredictionServicer(predictor, settings.max_chunk_rows),
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
) -> tuple[grpc.aio.Server, int, PredictionHealth, Predictor]:
    """Opens the decision ledger, starts the relay (unless ``relay_in_process`` is off) and the
    server, and reports readiness.

    Raises:
        ConfigurationError: inconsistent configuration.
        SchemaNotReady: the ledger or the CRM database has not been migrated (``mlpair migrate``).
        StartupError: the ledger or the CRM database is behind a pooler that loses the prepared
            statements their cache keeps (:mod:`mlpair.prediction.crm.pooler`).
    """
    from mlpair.prediction.crm.pooler import check_poolers

    await check_poolers(settings)
    predictor = build_predictor(settings, tracer_provider=tracer_provider)
    await predictor.recorder.start()
    try:
        server, port, health = create_server(
            settings, predictor, tracer_provider=tracer_provider, shared_port=shared_port
        )
    except BaseException:
        await predictor.recorder.close(drain_timeout_s=0)
        raise
    await server.start()
    predictor.drift.start(settings.drift_interval_s)
    interval_s = settings.health_interval_ms / 1000
    status = await health.check(predictor, timeout_s=interval_s)
    health.start_monitoring(predictor, interval_s)
    logger.info(
        "PredictionService serving on port %d (inference at %s); dependencies: %s",
        port,
        settings.inference_target,
        ", ".join(f"{k} {'up' if v else 'DOWN'}" for k, v in status.items()),
    )
    return server, port, health, predictor


async def stop(
    server: grpc.aio.Server, health: PredictionHealth, predictor: Predictor, grace_s: float, accept_s: float = 0.0
) -> None:
    """Drains in-flight calls (:func:`mlpair.rpc.drain.drain`), delivers what it can of the ledger's
    backlog (when this process runs the relay: otherwise the ledger keeps it for ``mlpair relay``),
    then closes every connection."""
    await health.stop_monitoring()  # first, so no check turns readiness back on
    await drain(server, health, grace_s=grace_s, accept_s=accept_s)
    await predictor.drift.stop()
    await predictor.drain_background()
    await predictor.scorer.close()
    await predictor.inference.close()
    await predictor.recorder.close(drain_timeout_s=min(grace_s, SHUTDOWN_DELIVERY_S))


async def serve(settings: PredictionSettings, *, shared_port: bool = False) -> None:
    """Runs until SIGTERM/SIGINT, then drains; ``shared_port``: as one of a supervisor's workers, each
    with its own ledger pool, relay (unless ``relay_in_process`` is off), cache and breaker over the
    one shared ledger."""
    # The handlers first: a SIGTERM while the ledger is opened or the families load then starts
    # the drain as soon as the server is up, instead of the default exit mid-start.
    stopped = asyncio.create_task(wait_for_termination_signal())
    await asyncio.sleep(0)  # its handlers are installed
    try:
        server, _, health, predictor = await start(settings, shared_port=shared_port)
    except BaseException:
        stopped.cancel()
        raise
    tune_collector()
    await stopped
    await stop(server, health, predictor, settings.shutdown_grace_s, settings.shutdown_accept_ms / 1000)
    logger.info("PredictionService stopped")
