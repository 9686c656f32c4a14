"""Serving lifecycle shared by both servers: liveness beside readiness, the drain, connection
keepalive and server reflection.

Health names (``grpc.health.v1``) on both services:

* ``liveness`` (:data:`LIVENESS`): SERVING from the moment the port answers until the server
  stops, whatever the models, the ledger or the drain say; for the Kubernetes liveness probe,
  which must restart only a process that can no longer answer at all.
* ``""`` and each service name: readiness (each service's health module says what it checks);
  NOT_SERVING at once when the drain starts.

Drain (:func:`drain`), on SIGTERM:

1. readiness turns NOT_SERVING on every name and protocol, and every open health ``Watch``
   stream ends (with its last status sent), so neither a probe nor a watcher holds the shutdown;
2. for ``accept_s`` calls are still served: calls a client sent just before the signal, which
   gRPC has received but the busy event loop has not dispatched yet;
3. then new calls are held (:class:`DrainGate`) while calls in flight get what is left of
   ``grace_s`` to finish, until no new call has arrived for :data:`QUIET_S`;
4. the server stops (listener closed, GOAWAY sent), and only then are the held calls answered
   UNAVAILABLE (reason ``DRAINING``, retryable).

gRPC's own ``server.stop(grace)`` cancels every call that reaches the server after it is
called, including calls already on the wire (the client sees CANCELLED, which neither a mesh
nor PredictionService retries). Steps 3 and 4 leave no call on the wire at that moment from a
client that waits for its answers; a client that sends without waiting keeps the server in
step 3 until the grace runs out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2
from pydantic_settings import BaseSettings, SettingsConfigDict

from mlpair.errors import ServiceError

logger = logging.getLogger(__name__)

LIVENESS = "liveness"
"""Health name of liveness: SERVING while the process serves at all (see the module docstring)."""
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class LifecycleHealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 with a ``liveness`` name that stays SERVING, and ``Watch`` streams that end
    when the drain starts (grpc's own servicer keeps them open until the server's grace runs out,
    so one watcher delayed every shutdown by the whole grace)."""

    def __init__(self) -> None:
        super().__init__()
        self._server_status[LIVENESS] = SERVING
        self._changed = asyncio.Condition()
        self._draining = False

    async def set(self, service: str, status) -> None:
        """Sets ``service``'s status and wakes its watchers; ignored for every name once draining
        (nothing turns ready again during a drain)."""
        if self._draining:
            return
        await super().set(service, status)
        async with self._changed:
            self._changed.notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        """Streams the name's status on every change; ends after the last one once draining."""
        last = None
        while True:
            status = self._server_status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self._draining:
                return
            async with self._changed:
                if not self._draining and self._server_status.get(request.service) == status:
                    await self._changed.wait()

    async def begin_drain(self, readiness_names: list[str]) -> None:
        """Readiness names NOT_SERVING for good; open Watch streams send it and end."""
        for name in readiness_names:
            await super().set(name, NOT_SERVING)
        self._draining = True
        async with self._changed:
            self._changed.notify_all()


class Draining(ServiceError):
    """The server is shutting down and takes no new calls; retry on another replica."""

    code = "UNAVAILABLE"
    reason = "DRAINING"


class DrainGate:
    """Counts calls in flight and, once closed, holds each new call until the server has begun to
    stop, then refuses it with :class:`Draining` (UNAVAILABLE).

    Holding rather than refusing at once matters for the last moment of a drain: a client that
    got its UNAVAILABLE sends its next call at once, and a call on the wire when gRPC's shutdown
    begins is cancelled (CANCELLED). A held client has nothing on the wire; it gets its answer
    after the server has sent GOAWAY, so its next call goes elsewhere or is refused before it is
    sent. Used by :func:`mlpair.rpc.guard_servicer` around every unary RPC of a servicer.
    """

    def __init__(self) -> None:
        self.closed = False
        self.in_flight = 0
        self.last_arrival = 0.0
        """``time.monotonic()`` of the latest call held (or of closing, before any)."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._released = asyncio.Event()

    def enter(self) -> bool:
        """Admits one call (True), unless the gate is closed (False: :meth:`refuse` it)."""
        if self.closed:
            return False
        self.in_flight += 1
        self._idle.clear()
        return True

    async def refuse(self) -> None:
        """Holds a call the closed gate did not admit until :meth:`release`, then refuses it.

        Raises:
            Draining: always, once released.
        """
        self.last_arrival = time.monotonic()
        await self._released.wait()
        raise Draining("the server is shutting down; retry on another replica")

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def close(self) -> None:
        """Holds every new call from now on."""
        self.closed = True
        self.last_arrival = time.monotonic()

    def release(self) -> None:
        """Answers every held call, and every later one, UNAVAILABLE."""
        self._released.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no admitted call is in flight; False when ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False

    async def wait_quiet(self, quiet_s: float, timeout_s: float) -> bool:
        """Waits until no call has arrived for ``quiet_s`` seconds; False when ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while (now := time.monotonic()) < deadline:
            left = self.last_arrival + quiet_s - now
            if left <= 0:
                return True
            await asyncio.sleep(min(left, deadline - now))
        return False


QUIET_S = 0.2
"""The drain stops the server once no call has arrived for this long: every client that waits for
its answers then waits on a held call, and none is left on the wire. A margin over the time a
sent call takes to reach its handler on a loaded event loop (well under a millisecond idle, tens
of milliseconds on this project's 2-core test machine under a full test run)."""


async def drain(
    server: grpc.aio.Server,
    gate: DrainGate,
    *,
    grace_s: float,
    accept_s: float,
    begin: Callable[[], Awaitable[None]],
    refuse: Callable[[], Awaitable[None]] | None = None,
    wait_idle: Callable[[float], Awaitable[bool]] | None = None,
) -> None:
    """Stops ``server`` gracefully (the module docstring's steps).

    Args:
        gate: the servicers' gate (:func:`mlpair.rpc.guard_servicer`): closed after ``accept_s``,
            released once the server has begun to stop.
        grace_s: seconds from the call until the server is stopped at the latest.
        accept_s: seconds calls are still served after readiness turned NOT_SERVING (capped at ``grace_s``).
        begin: turns every readiness signal not-ready and ends health Watch streams.
        refuse: more to close with the gate (e.g. the engine's own refusal); None = the gate alone.
        wait_idle: waits up to the given seconds for calls in flight, False when some remain;
            None = the gate's count.
    """
    deadline = time.monotonic() + grace_s

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    await begin()
    await asyncio.sleep(min(accept_s, grace_s))
    gate.close()
    if refuse is not None:
        await refuse()
    if not await (wait_idle or gate.wait_idle)(left()):
        logger.warning("grace period of %.1f s ended with calls still in flight", grace_s)
    await gate.wait_quiet(QUIET_S, left())
    stopping = asyncio.ensure_future(server.stop(left()))
    await asyncio.sleep(0.01)  # shutdown begun (GOAWAY sent) before the held calls get their answer
    gate.release()
    await stopping


class ConnectionSettings(BaseSettings):
    """Connection settings both services' settings classes share (each adds its own env prefix)."""

    model_config = SettingsConfigDict(extra="ignore", use_attribute_docstrings=True)

    keepalive_min_ping_interval_ms: int = 1000
    """Shortest interval between a client's keepalive pings that the server accepts, in ms; pinging
    more often is a strike, and two strikes close the connection (GOAWAY too_many_pings)."""
    keepalive_permit_without_calls: bool = True
    """Accept keepalive pings on a connection with no call in flight (clients keeping idle connections warm)."""
    max_connection_age_ms: int = 300_000
    """Connections are closed gracefully (GOAWAY) after about this long, so clients reconnect and spread
    over replicas added since; 0 = never. Long ModelStreamInfer streams end with their connection."""
    max_connection_age_grace_ms: int = 30_000
    """Milliseconds calls in flight on an aged connection get to finish before it is closed."""
    reflection: bool = True
    """gRPC server reflection (grpcurl, grpc_cli, Postman list and call the services without .proto files)."""


def server_options(settings: ConnectionSettings) -> list[tuple[str, int]]:
    """gRPC server options for the keepalive and connection-age policy of ``settings``.

    gRPC's server defaults refuse what many clients do: a ping more often than every 5 minutes
    without a call in flight is a strike, and after 2 strikes the server closes the connection
    with GOAWAY ``too_many_pings`` (a client pinging every second was cut off after 3 s).
    """
    options = [
        ("grpc.http2.min_ping_interval_without_data_ms", settings.keepalive_min_ping_interval_ms),
        ("grpc.keepalive_permit_without_calls", int(settings.keepalive_permit_without_calls)),
    ]
    if settings.max_connection_age_ms > 0:
        options += [
            ("grpc.max_connection_age_ms", settings.max_connection_age_ms),
            ("grpc.max_connection_age_grace_ms", settings.max_connection_age_grace_ms),
        ]
    return options


def client_keepalive_options(keepalive_ms: int, timeout_ms: int) -> list[tuple[str, int]]:
    """Channel options of a client that pings every ``keepalive_ms`` (calls in flight or not) and
    drops the connection when a ping is not answered within ``timeout_ms``; 0 = no pings.

    The server must accept pings that often (its ``keepalive_min_ping_interval_ms``, at most
    ``keepalive_ms``), or it closes the connection after two early pings.
    """
    if keepalive_ms <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def enable_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """gRPC server reflection (grpcio-reflection) listing ``service_names``, health and reflection
    itself, so grpcurl and grpc_cli can call the server without the .proto files."""
    from grpc_health.v1 import health_pb2 as health_messages
    from grpc_reflection.v1alpha import reflection

    names = [*service_names, health_messages.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
