"""The drain both servers stop through, and the termination signal that starts it.

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
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from mlpair.errors import ServiceError

logger = logging.getLogger(__name__)

QUIET_S = 0.2
"""The drain stops the server once no call has arrived for this long: every client that waits for
its answers then waits on a held call, and none is left on the wire. A margin over the time a
sent call takes to reach its handler on a loaded event loop (well under a millisecond idle, tens
of milliseconds on this project's 2-core test machine under a full test run)."""


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
    sent. Used by :func:`mlpair.rpc.servicers.guard_servicer` around every unary RPC of a servicer.
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
        """Counts an admitted call out."""
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


class Drained(Protocol):
    """What :func:`drain` turns: a server's readiness and its gate (:class:`mlpair.rpc.health.Health`)."""

    gate: DrainGate

    async def begin_drain(self) -> None:
        """Readiness NOT_SERVING for good; open health Watch streams end."""
        ...


async def drain(
    server: grpc.aio.Server,
    health: Drained,
    *,
    grace_s: float,
    accept_s: float = 0.0,
    withdraw: Callable[[], Awaitable[None]] | None = None,
    refuse: Callable[[], Awaitable[None]] | None = None,
    wait_idle: Callable[[float], Awaitable[bool]] | None = None,
) -> None:
    """Stops ``server`` gracefully (the module docstring's steps); the one way both services stop.

    Args:
        health: the server's health (:class:`mlpair.rpc.health.Health`): its readiness turns
            NOT_SERVING for good, and its ``gate`` is closed after ``accept_s`` and released once
            the server has begun to stop.
        grace_s: seconds from the call until the server is stopped at the latest.
        accept_s: seconds calls are still served after readiness turned NOT_SERVING (capped at ``grace_s``).
        withdraw: more readiness to withdraw with health's (e.g. OIP ``ServerReady``); None = health alone.
        refuse: more to close with the gate (e.g. the engine's own refusal); None = the gate alone.
        wait_idle: waits up to the given seconds for calls in flight, False when some remain;
            None = the gate's count.
    """
    deadline = time.monotonic() + grace_s

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    gate = health.gate
    if withdraw is not None:
        await withdraw()
    await health.begin_drain()
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


async def wait_for_termination_signal() -> None:
    """Returns when the process gets SIGTERM or SIGINT (Kubernetes sends SIGTERM on pod stop).

    The handlers are installed when this coroutine first runs: start it as a task before the
    server starts, so a signal during start-up is not the default (immediate) exit.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("termination signal received; draining")
