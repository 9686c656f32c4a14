"""InferenceService process: wiring, start-up, readiness and graceful drain.

One gRPC port serves the project's API (``mlpair.inference.v1.InferenceService``), the Open
Inference Protocol v2 (``inference.GRPCInferenceService``) and ``grpc.health.v1``, all over
one engine, batcher and set of checks. Message size limits are explicit in both directions
(``max_message_bytes``): a larger message is refused by gRPC with RESOURCE_EXHAUSTED.

Lifecycle (see :mod:`mlpair.inference.health` for what each health name means):

1. start: the port answers at once (liveness); health and OIP readiness say not ready;
2. load: every model is verified (version triple, file hashes), loaded and warmed up; an
   inconsistent entry or failed load refuses the start with a clear message (exit 1);
3. ready: health SERVING, OIP ServerReady/ModelReady true;
4. SIGTERM (:func:`mlpair.rpc.drain.drain`): not ready at once on every name and protocol
   (``liveness`` stays SERVING), health Watch streams end; after ``shutdown_accept_ms`` new
   requests are held and, once the server has begun to stop, answered UNAVAILABLE (DRAINING)
   so clients and load balancers move on; in-flight requests finish (their batches run); the
   server stops when nothing is in flight or ``shutdown_grace_s`` has passed, whichever is
   first, then the process exits.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.collector import tune_collector
from mlpair.inference import metrics
from mlpair.inference.engine import InferenceEngine
from mlpair.inference.errors import DOMAIN
from mlpair.inference.gpu_signals import GpuSignals, start_gpu_signals
from mlpair.inference.health import publish_loading, publish_readiness
from mlpair.inference.repository import RuntimeFactory
from mlpair.inference.runtimes import create_runtime
from mlpair.inference.servicer import InferenceServicer, OpenInferenceServicer, count_refused_calls
from mlpair.inference.settings import InferenceSettings
from mlpair.logs import count_failures_with, set_process_model_version
from mlpair.observability.calls import observe_servicer
from mlpair.rpc import Health, Service, build_server, drain, wait_for_termination_signal

logger = logging.getLogger(__name__)

SERVICE_NAME = "mlpair.inference.v1.InferenceService"
OIP_SERVICE_NAME = "inference.GRPCInferenceService"


class InferenceServer:
    """The gRPC server, its engine and its health, bound but not started.

    Args:
        settings: the service settings (``port=0`` picks a free port: see :attr:`port`).
        runtime_factory: builds each model version's runtime (tests may wrap the real one).
        shared_port: this process is one of a supervisor's workers (:mod:`mlpair.workers`): bind the
            port with SO_REUSEPORT; otherwise exclusively.

    Raises:
        StartupError: the port is in use.
    """

    def __init__(
        self,
        settings: InferenceSettings,
        runtime_factory: RuntimeFactory = create_runtime,
        *,
        tracer_provider=None,
        shared_port: bool = False,
    ) -> None:
        self.settings = settings
        self.engine = InferenceEngine(settings, runtime_factory, on_change=self._refresh_health)
        self.health = Health([SERVICE_NAME, OIP_SERVICE_NAME])
        self.gpu: GpuSignals | None = None
        """The GPU sampler (:mod:`mlpair.inference.gpu_signals`) once the models are loaded; None without a GPU."""
        count_failures_with("inference", lambda stage: metrics.OBSERVABILITY_ERRORS.labels(stage).inc())

        def observe(servicer: object, name: str) -> None:
            # spans, log context and the per-call line; tracer_provider None = the global one
            observe_servicer(servicer, name, "inference", tracer_provider, log_calls=True)

        self.server, self.port = build_server(
            settings,
            [
                Service(
                    SERVICE_NAME,
                    InferenceServicer(self.engine),
                    pb_grpc.add_InferenceServiceServicer_to_server,
                    count_refused_calls(self.engine),
                ),
                Service(
                    OIP_SERVICE_NAME,
                    OpenInferenceServicer(self.engine),
                    oip_grpc.add_GRPCInferenceServiceServicer_to_server,
                    count_refused_calls(self.engine),
                ),
            ],
            self.health,
            domain=DOMAIN,
            shared_port=shared_port,
            observe=observe if settings.tracing else None,
        )

    async def start(self) -> None:
        """Starts answering (liveness) while reporting not ready, per model too."""
        await publish_loading(self.health, self.engine)
        await self.server.start()

    async def load(self) -> None:
        """Loads, verifies and warms every model to serve, then starts the GPU signals; readiness
        follows. The first failure stops the load and is raised as it came (nothing turns ready;
        the failed version is UNAVAILABLE in the repository index, with the reason).

        Raises:
            StartupError: the model repository is missing or empty, a model to serve has no trained
                version, or CUDA was asked for and is not active.
            ManifestError: an entry's manifest, version triple or file hashes are inconsistent.
            InferenceError: a model to serve has no version the policy selects (ModelNotFound), or
                a version failed to load or warm up in a way the service checks (ModelLoadFailed:
                no file for the runtime, a node that would fall back to the CPU on CUDA, unusable
                warm-up logits).
            Exception: anything the runtime's own library raises while loading or running the
                model, not wrapped: a corrupt model file comes out as ONNX Runtime's own error
                (``InvalidProtobuf``, for instance) or PyTorch's.
        """
        await self.engine.start()
        self.gpu = await start_gpu_signals(self.engine, self.settings)
        set_process_model_version(
            ",".join(f"{name}:{v}" for name, versions in self.engine.repository.serving().items() for v in versions)
        )
        logger.info("InferenceService ready on port %d: %s", self.port, self.engine.repository.serving())

    async def _refresh_health(self) -> None:
        await publish_readiness(self.health, self.engine)

    async def drain(self) -> None:
        """Graceful stop (:func:`mlpair.rpc.drain.drain`): not ready on every signal at once (OIP
        ServerReady and ModelReady too) and health Watch streams ended; still serve for
        ``shutdown_accept_ms`` (calls already on the wire when the signal came); then hold new work
        (answered UNAVAILABLE once the server has begun to stop), let in-flight work (queued
        batches and open streams included) finish within ``shutdown_grace_s``, stop the server,
        retire the models."""
        await drain(
            self.server,
            self.health,
            grace_s=self.settings.shutdown_grace_s,
            accept_s=self.settings.shutdown_accept_ms / 1000,
            withdraw=self.engine.withdraw_readiness,
            refuse=self.engine.begin_drain,
            wait_idle=self.engine.wait_idle,
        )
        await self._stop_gpu_signals()
        await self.engine.close()

    async def stop(self) -> None:
        """Immediate stop (tests): cancels in-flight calls."""
        await self.server.stop(0)
        await self._stop_gpu_signals()
        await self.engine.close()

    async def _stop_gpu_signals(self) -> None:
        if self.gpu is not None:
            await self.gpu.stop()
            self.gpu = None


async def start(
    settings: InferenceSettings, runtime_factory: RuntimeFactory = create_runtime, *, tracer_provider=None
) -> tuple[grpc.aio.Server, int, Health, InferenceEngine]:
    """Starts the server and loads the models; returns once ready.

    ``tracer_provider``: where spans go (None = the global one, set in ``main()``).

    Raises:
        StartupError, ManifestError, InferenceError, or the runtime library's own error: a model
            cannot be loaded, as :meth:`InferenceServer.load` raises it (the server is stopped first).
    """
    server = InferenceServer(settings, runtime_factory, tracer_provider=tracer_provider)
    await server.start()
    try:
        await server.load()
    except BaseException:
        await server.stop()
        raise
    return server.server, server.port, server.health, server.engine


async def serve(
    settings: InferenceSettings, *, shared_port: bool = False, runtime_factory: RuntimeFactory = create_runtime
) -> None:
    """Runs until SIGTERM/SIGINT, then drains (see the module docstring); ``shared_port``: as one of a
    supervisor's workers (each loads its own copy of every model: on a GPU, N times the device memory);
    ``runtime_factory``: builds each model version's runtime."""
    stopped = asyncio.create_task(wait_for_termination_signal())
    await asyncio.sleep(0)  # its handlers are installed: a signal from here on starts the drain
    server = InferenceServer(settings, runtime_factory, shared_port=shared_port)
    await server.start()
    load = asyncio.create_task(server.load())
    await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
    failure = load.exception() if load.done() else None
    if failure is not None:
        stopped.cancel()
        await server.stop()
        raise failure
    if load.done():
        tune_collector()  # serving from here on (mlpair.collector)
    await stopped
    logger.info("InferenceService draining (grace %.1f s)", settings.shutdown_grace_s)
    if not load.done():
        load.cancel()
    await server.drain()
    logger.info("InferenceService stopped")
