"""Test helpers for faults between PredictionService and what it depends on (loopback only).

* :class:`TcpProxy` — a TCP proxy on 127.0.0.1 whose connection the test cuts and restores
  (e.g. between PredictionService and the real PostgreSQL).
* :class:`InferenceForwarder` — an InferenceService in front of the real one that counts
  calls, and can delay them (a slow model) or answer with a chosen status code first.
* :func:`prediction_service` — a real PredictionService on a free port with chosen settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``upstream``; :meth:`cut` drops every connection and refuses
    new ones until :meth:`restore`; :meth:`lose_reply_after` drops one connection right after
    the client sent a given message, so the server acts on it but the client never hears back."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._lose_after: bytes | None = None
        self.connections = 0
        self.replies_lost = 0

    def lose_reply_after(self, marker: bytes) -> None:
        """The next time a client sends bytes containing ``marker`` (e.g. ``b"COMMIT"``), they
        reach the server, the client's side is reset at once and the server's side shortly after."""
        self._lose_after = marker

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def cut(self) -> None:
        """Stops listening and resets every open connection (both sides see it broken)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def restore(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.cut()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, from_client: bool) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
                    if from_client and self._lose_after is not None and self._lose_after in data:
                        self._lose_after = None
                        self.replies_lost += 1
                        writer.transport.abort()  # the client never sees the reply...
                        await asyncio.sleep(0.2)  # ...while the server has time to act on the message
                        break
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))
        self._writers -= {writer, up_writer}


class InferenceForwarder(ipb_grpc.InferenceServiceServicer):
    """Forwards Infer to the real InferenceService at ``target``, counting calls.

    Attributes:
        calls: Infer calls received.
        deadlines: ``context.time_remaining()`` seen by each call, in seconds.
        rows: rows carried by each call.
        cancelled: calls whose caller went away while they were delayed.
        delay_s: seconds to wait before forwarding (a slow model).
        fail_first: status codes to answer with, one per call, before forwarding again.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self.calls = 0
        self.deadlines: list[float | None] = []
        self.rows: list[int] = []
        self.cancelled = 0
        self.delay_s = 0.0
        self.fail_first: list[grpc.StatusCode] = []
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = ipb_grpc.InferenceServiceStub(self._channel)

    async def Infer(self, request, context):
        self.calls += 1
        self.deadlines.append(context.time_remaining())
        self.rows.append(request.inputs.shape[0] if request.inputs.shape else 0)
        if self.fail_first:
            await context.abort(self.fail_first.pop(0), "injected by the test")
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
    from mlpair.prediction.server import start, stop

    server, port, health, predictor = await start(settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.PredictionServiceStub(channel), predictor, health, f"127.0.0.1:{port}"
    finally:
        await stop(server, health, predictor, 0)


def prediction_settings(tmp_path, model_repository, inference_target: str, **overrides):
    """PredictionSettings for a test: free port, no metrics port, CRM and outbox under ``tmp_path``."""
    from mlpair.prediction.settings import PredictionSettings
    from tests.support import CONFIG_DIR

    values = dict(host="127.0.0.1", port=0, metrics_port=0, inference_target=inference_target,
                  crm_url=f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}",
                  outbox_url=f"sqlite+aiosqlite:///{tmp_path / 'outbox.sqlite'}",
                  outbox_synchronous="NORMAL", model_repository=model_repository, config_dir=CONFIG_DIR,
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
