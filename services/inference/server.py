"""InferenceService process: wiring, start-up, readiness and graceful drain.

Liveness vs readiness: the gRPC port answers (health check reachable) as soon as the process
starts; ``grpc.health.v1`` reports SERVING only after every model is loaded, its version
triple verified and a warm-up inference run. On SIGTERM it reports NOT_SERVING at once,
lets in-flight calls finish for up to ``shutdown_grace_s`` and exits.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.inference.engine import InferenceEngine
from mlpair.inference.errors import DOMAIN
from mlpair.inference.servicer import InferenceServicer
from mlpair.inference.settings import InferenceSettings
from mlpair.logs import set_process_model_version
from mlpair.observability.interceptors import server_interceptors
from mlpair.rpc import ErrorInterceptor, Health, drain, message_size_options, wait_for_termination_signal

logger = logging.getLogger(__name__)

SERVICE_NAME = "mlpair.inference.v1.InferenceService"


def create_server(settings: InferenceSettings, engine: InferenceEngine, *,
                  tracer_provider=None) -> tuple[grpc.aio.Server, int, Health]:
    """Builds the server with the InferenceService and health services and binds its port.

    ``tracer_provider``: where spans go (None = the global one, set in ``main()``).

    Returns:
        The (not yet started) server, the bound port (useful with ``port=0``) and its health.
    """
    observability = server_interceptors("inference", tracer_provider, log_calls=True)
    server = grpc.aio.server(interceptors=[*observability, ErrorInterceptor(DOMAIN)],
                             options=message_size_options(settings.max_message_bytes))
    pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(engine), server)
    health = Health([SERVICE_NAME])
    health.add_to(server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    return server, port, health


async def start(settings: InferenceSettings, *,
                tracer_provider=None) -> tuple[grpc.aio.Server, int, Health, InferenceEngine]:
    """Starts serving health at once, then loads and warms the models and reports SERVING.

    Raises:
        ManifestError, InferenceError: a model cannot be loaded (the server is stopped first).
    """
    engine = InferenceEngine(settings)
    server, port, health = create_server(settings, engine, tracer_provider=tracer_provider)
    await health.set_serving(False)
    await server.start()
    try:
        await asyncio.get_running_loop().run_in_executor(None, engine.load)
    except BaseException:
        await server.stop(0)
        raise
    set_process_model_version(",".join(v for versions in engine.models().values() for v in versions))
    await health.set_serving(True)
    logger.info("InferenceService serving on port %d", port)
    return server, port, health, engine


async def serve(settings: InferenceSettings) -> None:
    """Runs until SIGTERM/SIGINT, then drains."""
    server, _, health, engine = await start(settings)
    await wait_for_termination_signal()
    await drain(server, health, settings.shutdown_grace_s)
    engine.close()
    logger.info("InferenceService stopped")
