"""PredictionService process: wiring, start-up checks, readiness and graceful drain.

Start-up refuses to run when the configured feature schema is not the one the model was
trained on, or the CRM cannot be reached. Readiness (``grpc.health.v1`` SERVING) follows.
"""

from __future__ import annotations

import logging

import grpc

from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.prediction.crm.store import CrmStore
from mlpair.prediction.errors import DOMAIN
from mlpair.prediction.inference_client import InferenceClient
from mlpair.prediction.pipeline import ConfigurationError, ModelFamily, Predictor
from mlpair.prediction.servicer import PredictionServicer
from mlpair.prediction.settings import PredictionSettings
from mlpair.rpc import (ErrorInterceptor, Health, bind_port, channel_credentials, drain, message_size_options,
                        server_credentials, wait_for_termination_signal)

logger = logging.getLogger(__name__)

SERVICE_NAME = "mlpair.prediction.v1.PredictionService"


def build_predictor(settings: PredictionSettings) -> Predictor:
    """Loads every served model family and connects its dependencies (no network I/O yet).

    Raises:
        ConfigurationError: schema, policy and model repository disagree, or the default
            family is not among the served ones.
    """
    names = settings.models or [settings.model_name]
    if settings.model_name not in names:
        raise ConfigurationError(f"default model family {settings.model_name!r} is not among the served {names}")
    if unserved := sorted((set(settings.ensembles) | set(settings.shadows)) - set(names)):
        raise ConfigurationError(f"ensemble or shadow configured for {unserved}, which are not served")
    families = {name: ModelFamily.load(name, settings.config_dir, settings.model_repository,
                                       ensemble=settings.ensembles.get(name, ()), shadow=settings.shadows.get(name))
                for name in names}
    tls = channel_credentials(settings.inference_tls_ca_file, settings.inference_tls_cert_file,
                              settings.inference_tls_key_file)
    inference = InferenceClient(settings.inference_target, timeout_ms=settings.inference_timeout_ms,
                                max_message_bytes=settings.max_message_bytes, credentials=tls)
    return Predictor(families, settings.model_name, inference, CrmStore(settings.crm_url),
                     max_inference_rows=settings.inference_max_batch_rows, max_batch_items=settings.max_batch_items,
                     explain_top_k=settings.explain_top_reasons)


def create_server(settings: PredictionSettings, predictor: Predictor) -> tuple[grpc.aio.Server, int, Health]:
    """Builds the server with PredictionService and health and binds its port (0 = free port)."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor(DOMAIN)],
                             options=message_size_options(settings.max_message_bytes))
    pb_grpc.add_PredictionServiceServicer_to_server(PredictionServicer(predictor), server)
    health = Health([SERVICE_NAME])
    health.add_to(server)
    tls = server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
    port = bind_port(server, f"{settings.host}:{settings.port}", tls)
    return server, port, health


async def start(settings: PredictionSettings) -> tuple[grpc.aio.Server, int, Health, Predictor]:
    """Creates CRM tables, starts the server and reports SERVING.

    Raises:
        ConfigurationError: inconsistent configuration. sqlalchemy.exc.SQLAlchemyError: CRM unreachable.
    """
    predictor = build_predictor(settings)
    await predictor.crm.create_schema()
    server, port, health = create_server(settings, predictor)
    await server.start()
    await health.set_serving(True)
    logger.info("PredictionService serving on port %d (inference at %s)", port, settings.inference_target)
    return server, port, health, predictor


async def stop(server: grpc.aio.Server, health: Health, predictor: Predictor, grace_s: float) -> None:
    """Drains in-flight calls, then closes the inference channel and the CRM pool."""
    await drain(server, health, grace_s)
    await predictor.drain_background()
    await predictor.inference.close()
    await predictor.crm.close()


async def serve(settings: PredictionSettings) -> None:
    """Runs until SIGTERM/SIGINT, then drains."""
    server, _, health, predictor = await start(settings)
    await wait_for_termination_signal()
    await stop(server, health, predictor, settings.shutdown_grace_s)
    logger.info("PredictionService stopped")
