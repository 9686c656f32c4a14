"""Test helpers for faults between PredictionService and what it depends on (loopback only).

* :class:`TcpProxy` — a TCP proxy on 127.0.0.1 whose connection the test cuts and restores
  (e.g. between PredictionService and the real PostgreSQL).
* :class:`InferenceForwarder` — an InferenceService in front of the real one that counts
  calls, and can delay them (a slow model) or answer with a chosen status code first.
* :func:`prediction_service` — a real PredictionService on a free port with chosen settings.
* :func:`faulty_inference` — a real InferenceService process whose model runtimes fail on demand
  (``tests/fault_inference.py``), switched with :func:`set_fault`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from tests.support.pair import TcpProxy, free_port  # noqa: F401  (the tests' fault helpers, re-exported)


class InferenceForwarder(ipb_grpc.InferenceServiceServicer):
    """Forwards Infer to the real InferenceService at ``target``, counting calls.

    Attributes:
        calls: Infer calls received.
        deadlines: ``context.time_remaining()`` seen by each call, in seconds.
        rows: rows carried by each call.
        received: each call's metadata and request, as they arrived.
        cancelled: calls whose caller went away while they were delayed.
        delay_s: seconds to wait before forwarding (a slow model).
        fail_first: statuses to answer with, one per call, before forwarding again: a status code,
            or (code, details, trailing metadata) as a server or the mesh would send them.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self.calls = 0
        self.deadlines: list[float | None] = []
        self.rows: list[int] = []
        self.received: list[tuple[tuple, object]] = []
        self.cancelled = 0
        self.delay_s = 0.0
        self.fail_first: list = []
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = ipb_grpc.InferenceServiceStub(self._channel)

    async def Infer(self, request, context):
        self.calls += 1
        self.deadlines.append(context.time_remaining())
        self.rows.append(request.inputs.shape[0] if request.inputs.shape else 0)
        self.received.append((tuple(context.invocation_metadata()), request))
        if self.fail_first:
            failure = self.fail_first.pop(0)
            if isinstance(failure, grpc.StatusCode):
                await context.abort(failure, "injected by the test")
            await context.abort(*failure)
        if self.delay_s:
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await self._stub.Infer(request, metadata=tuple(context.invocation_metadata()),
                                      timeout=context.time_remaining())

    async def close(self) -> None:
        await self._channel.close()


@contextlib.asynccontextmanager
async def inference_forwarder(target: str):
    """A real gRPC server on a free port running :class:`InferenceForwarder`; yields (address, forwarder)."""
    from grpc_health.v1 import health

    forwarder = InferenceForwarder(target)
    server = grpc.aio.server()
    ipb_grpc.add_InferenceServiceServicer_to_server(forwarder, server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", forwarder
    finally:
        await server.stop(0)
        await forwarder.close()


@contextlib.asynccontextmanager
async def prediction_service(settings):
    """A real PredictionService for ``settings`` (port 0); yields (stub, predictor, health, address)."""
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from mlpair.prediction.server import stop
    from tests.support import start_prediction

    server, port, health, predictor = await start_prediction(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.PredictionServiceStub(channel), predictor, health, f"127.0.0.1:{port}"
    finally:
        await stop(server, health, predictor, 0)


def prediction_settings(tmp_path, model_repository, inference_target: str, **overrides):
    """PredictionSettings for a test: free port, no metrics port, CRM and decision ledger under ``tmp_path``."""
    from mlpair.prediction.settings import PredictionSettings
    from tests.support import CONFIG_DIR

    values = dict(host="127.0.0.1", port=0, metrics_port=0, inference_target=inference_target,
                  crm_url=f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}",
                  ledger_url=f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}",
                  ledger_synchronous="NORMAL", model_repository=model_repository, config_dir=CONFIG_DIR,
                  health_interval_ms=200)
    values.update(overrides)
    return PredictionSettings(**values)


async def health_of(address: str, service: str) -> int:
    """The ``grpc.health.v1`` status of ``service`` ("" = overall) at ``address``."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    return reply.status


async def eventually(check, timeout_s: float = 20.0, interval_s: float = 0.1):
    """Polls ``await check()`` until it returns something truthy; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := await check():
            return result
        await asyncio.sleep(interval_s)
    pytest.fail(f"condition not reached within {timeout_s} s")


FAULT_LAUNCHER = Path(__file__).resolve().parent / "fault_inference.py"


def faulty_inference(workdir: Path, model_repository: Path, fault_file: Path, **env: str):
    """An InferenceService process (not started) whose runtimes fail on demand: a
    :class:`tests.support.pair.Service` as :func:`tests.support.pair.pair` builds for inference (credit-risk, one
    process, loopback, a free port, no metrics port), run by ``tests/fault_inference.py``.

    Args:
        workdir: where its log goes (``inference-<port>.log``: several replicas may share it).
        model_repository: the trained models.
        fault_file: the file whose word selects the fault (see ``tests/fault_inference.py``; write it
            with :func:`set_fault`); absent = healthy.
        env: further variables, winning over the defaults: ``INFERENCE_*`` settings (e.g.
            ``INFERENCE_METRICS_PORT``), ``MLPAIR_FAULT_MODELS`` (a JSON list of the models to fail).
    """
    import json
    import os

    from tests.support.pair import MODEL, REPO, Service

    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # The launcher runs by path, not as ``-m tests.fault_inference``: an installed distribution may
    # ship a top-level ``tests`` package that would shadow this folder; PYTHONPATH still names the
    # repository root so that this checkout's packages import first.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    values = {"INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0",
              "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_MODELS": json.dumps([MODEL]),
              "INFERENCE_LOG_LEVEL": "WARNING", "INFERENCE_WORKERS": "1", "PYTHONPATH": path,
              "MLPAIR_FAULT_FILE": str(fault_file), **env}
    return Service("inference", values, port, workdir / f"inference-{port}.log", command=[str(FAULT_LAUNCHER)])


def set_fault(fault_file: Path, fault: str = "") -> None:
    """Switches the fault of the processes reading ``fault_file`` at once (written whole by a rename,
    so a batch never reads half a word); ``""`` = healthy."""
    temporary = fault_file.with_name(fault_file.name + ".new")
    temporary.write_text(fault)
    temporary.replace(fault_file)
