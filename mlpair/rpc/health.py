"""``grpc.health.v1`` for both servers: liveness beside readiness, and the one health helper.

Health names on both services:

* ``liveness`` (:data:`LIVENESS`): SERVING from the moment the port answers until the server
  stops, whatever the models, the ledger or the drain say; for the Kubernetes liveness probe,
  which must restart only a process that can no longer answer at all.
* ``""`` and each service name: readiness (each service's health module says what it checks),
  plus any further readiness names a service publishes (InferenceService: one per model);
  NOT_SERVING at once, and for good, when the drain starts.
* status names (PredictionService: one per dependency): what the service reports on besides
  readiness; the drain leaves them as they are.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mlpair.rpc.drain import DrainGate

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

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        """Sets ``service``'s status and wakes its watchers; ignored for every name once draining
        (nothing turns ready again during a drain)."""
        if self._draining:
            return
        await super().set(service, status)
        async with self._changed:
            self._changed.notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
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

    async def begin_drain(self, readiness_names: Sequence[str]) -> None:
        """Readiness names NOT_SERVING for good; open Watch streams send it and end."""
        for name in readiness_names:
            await super().set(name, NOT_SERVING)
        self._draining = True
        async with self._changed:
            self._changed.notify_all()


class Health:
    """One server's health: the standard ``grpc.health.v1`` service (see the module docstring)
    and the gate its guarded servicers pass every call through (:class:`~mlpair.rpc.drain.DrainGate`).

    Readiness starts NOT_SERVING; :meth:`set_serving` sets it, :meth:`set_status` sets a status
    name, and :func:`mlpair.rpc.drain.drain` ends readiness for good (:meth:`begin_drain`).

    Args:
        service_names: full names of the services the server serves (readiness is reported under
            each of them and under "").
    """

    def __init__(self, service_names: Sequence[str]) -> None:
        self.servicer = LifecycleHealthServicer()
        self.names = ["", *service_names]
        """Readiness names: overall and each service's."""
        self.gate = DrainGate()
        """Passed to :func:`mlpair.rpc.servicers.guard_servicer` by :func:`mlpair.rpc.server.build_server`;
        the drain closes it after its accept window."""
        self._parts: set[str] = set()
        self.workers = WorkerReadiness.of_this_process()
        """The supervisor's workers this process is one of (None when it serves alone)."""
        self._wanted = False  # this process's own readiness, whatever the other workers'
        self._waiting: asyncio.Task | None = None
        self._monitoring: asyncio.Task | None = None  # the checks :meth:`monitor` runs

    async def set_serving(self, serving: bool, parts: Mapping[str, bool] | None = None) -> None:
        """Sets every readiness name to ``serving``, and each further readiness name of ``parts``
        (e.g. a model's) to its own value; a part published before and absent from ``parts`` turns
        NOT_SERVING rather than unknown, so a watcher sees the change. ``parts`` None = unchanged.

        As one of a supervisor's workers, the readiness names turn SERVING only once every worker
        is ready (a connection may reach any of them); until then they stay NOT_SERVING and a
        task publishes SERVING when the last worker is."""
        self._wanted = serving
        if self.workers is not None:
            self.workers.mark(serving)
            if serving and not self.workers.all_ready():
                serving = False
                if self._waiting is None or self._waiting.done():
                    self._waiting = asyncio.get_running_loop().create_task(self._serving_once_all_ready())
        for name in self.names:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)
        if parts is None:
            return
        for name in self._parts - parts.keys():
            await self.servicer.set(name, NOT_SERVING)
        for name, ready in parts.items():
            await self.servicer.set(name, SERVING if ready else NOT_SERVING)
        self._parts |= parts.keys()

    async def set_live(self, live: bool) -> None:
        """Sets ``liveness`` (:data:`LIVENESS`): False only for a process that can never serve again
        (InferenceService: a lost CUDA device), so that the kubelet restarts it."""
        await self.servicer.set(LIVENESS, SERVING if live else NOT_SERVING)

    async def set_status(self, name: str, serving: bool) -> None:
        """Sets a status name (not readiness: the drain leaves it as it is)."""
        await self.servicer.set(name, SERVING if serving else NOT_SERVING)

    async def begin_drain(self) -> None:
        """Every readiness name NOT_SERVING for good (later updates are ignored); open Watch
        streams end; ``liveness`` stays SERVING."""
        self._wanted = False
        if self._waiting is not None:
            self._waiting.cancel()
        await self.servicer.begin_drain([*self.names, *sorted(self._parts)])

    async def _serving_once_all_ready(self) -> None:
        while self._wanted and self.workers is not None and not self.workers.all_ready():
            await asyncio.sleep(WorkerReadiness.POLL_S)
        if self._wanted:
            for name in self.names:
                await self.servicer.set(name, SERVING)

    def add_to(self, server: grpc.aio.Server) -> None:
        """Registers the health service on ``server``."""
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def monitor(self, check: Callable[[], Awaitable[object]], interval_s: float, name: str) -> None:
        """Runs ``check`` every ``interval_s`` seconds in a background task named ``name`` until
        :meth:`stop_monitoring`; a check that raises is logged and the next one runs."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await check()
                except Exception:
                    logger.exception("health check failed")

        self._monitoring = asyncio.get_running_loop().create_task(loop(), name=name)

    async def stop_monitoring(self) -> None:
        """Stops the background checks (before draining, so nothing flips readiness back on)."""
        if self._monitoring is not None:
            self._monitoring.cancel()
            await asyncio.gather(self._monitoring, return_exceptions=True)
            self._monitoring = None


class WorkerReadiness:
    """Which of a supervisor's workers are ready: one empty file per ready worker, named by its pid,
    in a folder the supervisor made (:mod:`mlpair.workers`).

    Args:
        folder: the supervisor's folder. workers: how many workers it started.
    """

    POLL_S = 0.1
    """How often a ready worker looks whether the others are."""

    def __init__(self, folder: Path, workers: int) -> None:
        self.folder, self.count = folder, workers
        self._mark = folder / str(os.getpid())

    @classmethod
    def of_this_process(cls) -> WorkerReadiness | None:
        """The readiness of this process's fellow workers, from the environment its supervisor set
        (``MLPAIR_WORKERS_READY_DIR``, ``MLPAIR_WORKERS``); None outside a supervisor."""
        from mlpair.workers import READY_DIR_ENV, WORKERS_ENV

        folder, workers = os.environ.get(READY_DIR_ENV), os.environ.get(WORKERS_ENV)
        return cls(Path(folder), int(workers)) if folder and workers else None

    def mark(self, ready: bool) -> None:
        """Marks this worker ready or not ready."""
        if ready:
            self._mark.touch()
        else:
            self._mark.unlink(missing_ok=True)

    def all_ready(self) -> bool:
        """Whether every worker has marked itself ready."""
        return sum(1 for _ in self.folder.iterdir()) >= self.count
