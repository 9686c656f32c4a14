"""PredictionService process: wiring, start-up checks, readiness and graceful drain.

Start-up refuses to run when the configured feature schema is not the one the model was
trained on, or the CRM cannot be reached. Readiness (``grpc.health.v1`` SERVING) follows.
"""

from __future__ import annotations

import logging

import grpc

from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.logs import add_personal_fields, set_process_model_version
from mlpair.observability.interceptors import client_interceptors, server_interceptors
from mlpair.observability.tracing import instrument_engine
from mlpair.prediction.crm.store import CrmStore
from mlpair.prediction.drift import DriftMonitors, drift_config
from mlpair.prediction.errors import DOMAIN
from mlpair.prediction.inference_client import InferenceClient
from mlpair.prediction.pipeline import ModelFamily, Predictor
from mlpair.prediction.servicer import PredictionServicer
from mlpair.prediction.settings import PredictionSettings
from mlpair.rpc import ErrorInterceptor, Health, drain, message_size_options, wait_for_termination_signal

logger = logging.getLogger(__name__)

SERVICE_NAME = "mlpair.prediction.v1.PredictionService"


def build_predictor(settings: PredictionSettings, *, tracer_provider=None) -> Predictor:
    """Loads the model family and connects its dependencies (no network I/O yet).

    ``tracer_provider``: where spans go (None = the global one, set in ``main()``).

    Raises:
        ConfigurationError: schema, policy and model repository disagree.
    """
    family = ModelFamily.load(settings.model_name, settings.config_dir, settings.model_repository)
    inference = InferenceClient(settings.inference_target, timeout_ms=settings.inference_timeout_ms,
                                max_message_bytes=settings.max_message_bytes,
                                interceptors=client_interceptors(tracer_provider))
    crm = CrmStore(settings.crm_url)
    # Observability (issue 6): CRM spans, personal fields kept out of logs, drift monitoring.
    instrument_engine(crm.engine, tracer_provider)
    add_personal_fields(family.entry.preprocessing.feature_schema.personal_data)
    set_process_model_version(family.entry.manifest.model_version)
    drift = DriftMonitors.for_entries({family.name: family.entry}, drift_config(settings))
    return Predictor({family.name: family}, settings.model_name, inference, crm, drift=drift)


def create_server(settings: PredictionSettings, predictor: Predictor, *,
                  tracer_provider=None) -> tuple[grpc.aio.Server, int, Health]:
    """Builds the server with PredictionService and health and binds its port (0 = free port)."""
    observability = server_interceptors("prediction", tracer_provider)
    server = grpc.aio.server(interceptors=[*observability, ErrorInterceptor(DOMAIN)],
                             options=message_size_options(settings.max_message_bytes))
    pb_grpc.add_PredictionServiceServicer_to_server(PredictionServicer(predictor), server)
    health = Health([SERVICE_NAME])
    health.add_to(server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    return server, port, health


async def start(settings: PredictionSettings, *,
                tracer_provider=None) -> tuple[grpc.aio.Server, int, Health, Predictor]:
    """Creates CRM tables, starts the server and reports SERVING.

    Raises:
        ConfigurationError: inconsistent configuration. sqlalchemy.exc.SQLAlchemyError: CRM unreachable.
    """
    predictor = build_predictor(settings, tracer_provider=tracer_provider)
    await predictor.crm.create_schema()
    server, port, health = create_server(settings, predictor, tracer_provider=tracer_provider)
    await server.start()
    predictor.drift.start(settings.drift_interval_s)
    await health.set_serving(True)
    logger.info("PredictionService serving on port %d (inference at %s)", port, settings.inference_target)
    return server, port, health, predictor


async def stop(server: grpc.aio.Server, health: Health, predictor: Predictor, grace_s: float) -> None:
    """Drains in-flight calls, then closes the inference channel and the CRM pool."""
    await drain(server, health, grace_s)
    await predictor.drift.stop()
    await predictor.inference.close()
    await predictor.crm.close()


async def serve(settings: PredictionSettings) -> None:
    """Runs until SIGTERM/SIGINT, then drains."""
    server, _, health, predictor = await start(settings)
    await wait_for_termination_signal()
    await stop(server, health, predictor, settings.shutdown_grace_s)
    logger.info("PredictionService stopped")
