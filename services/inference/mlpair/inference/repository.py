"""The model repository as served: loading, publishing and retiring model versions.

Layout: ``<root>/<model_name>/<version>/`` (see :mod:`mlpair.contracts.manifest`), read from the
source the settings name (:mod:`mlpair.inference.sourcing`: a local folder, a bucket, a registry).
Which versions serve is the version policy's choice (``latest:N``, ``all``, ``specific:a,b``;
:mod:`mlpair.inference.versions`, with what a served version and its status are).

Switching versions never drops a request: a new version is loaded, verified and warmed in a
thread while the current ones keep serving; only then is it published (new requests pick it);
versions the policy no longer wants are unpublished and their batchers finish every queued
request before they close. A version that fails to load is marked UNAVAILABLE with a reason
and never serves; the versions already serving stay. After start each version's health is
tracked (:mod:`mlpair.inference.model_health`): an unhealthy version stays published (its
self-test runs through its batcher) but is not ready and takes no request (:meth:`~ModelRepository.route`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from mlpair.contracts.manifest import ManifestError, ModelEntry
from mlpair.inference import metrics
from mlpair.inference.batcher import DynamicBatcher
from mlpair.inference.errors import (
    InferenceError,
    ModelLoadFailed,
    ModelNotFound,
    ModelNotReady,
    ModelSourceUnavailable,
    ModelUnhealthy,
)
from mlpair.inference.model_health import VersionHealth
from mlpair.inference.runtimes import Runtime, create_runtime
from mlpair.inference.settings import InferenceSettings
from mlpair.inference.sourcing import SourceReader, poll
from mlpair.inference.versions import (
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    ServedVersion,
    VersionPolicy,
    VersionStatus,
)
from mlpair.inference.warmup import open_version
from mlpair.sources import VersionRefused

logger = logging.getLogger(__name__)

RuntimeFactory = Callable[[ModelEntry, InferenceSettings], Runtime]


class ModelRepository:
    """Loads, publishes and retires model versions per the settings' version policy.

    The hot path (:meth:`get`) is two dict lookups. Load and unload operations are serialised
    by one lock and run the blocking work (file checks, runtime start, warm-up) in a thread.

    Args:
        settings: repository root, policy, runtime and batching settings.
        runtime_factory: builds a runtime for an entry (tests may wrap the real one).
        on_change: awaited after every publish or retire and every health transition (the server
            refreshes health).
        on_device_lost: awaited with a one-line reason when a version's runtime raised a sticky CUDA
            error (the engine fails liveness).
    """

    def __init__(
        self,
        settings: InferenceSettings,
        runtime_factory: RuntimeFactory = create_runtime,
        on_change: Callable[[], Awaitable[None]] | None = None,
        on_device_lost: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.root = settings.model_repository
        self.source = SourceReader(settings)
        self.policy = VersionPolicy.parse(settings.version_policy)
        self._factory = runtime_factory
        self._on_change = on_change
        self._on_device_lost = on_device_lost
        self._serving: dict[str, dict[str, ServedVersion]] = {}
        self._default: dict[str, ServedVersion] = {}  # name → highest serving version
        self._route: dict[str, ServedVersion] = {}  # name → highest healthy serving version
        self._tasks: set[asyncio.Task] = set()  # health publications under way
        self._status: dict[tuple[str, str], VersionStatus] = {}
        self._lock = asyncio.Lock()
        self.expected: set[str] = set()  # models readiness waits for

    # -- hot path --------------------------------------------------------------------------

    def get(self, name: str, version: str = "") -> ServedVersion:
        """The serving version ``version`` of ``name`` (empty = the highest serving one).

        Raises:
            ModelNotFound: unknown model, or a version that is not serving (naming those that are).
            ModelNotReady: the model is known but no version is serving yet.
        """
        if not version:
            served = self._default.get(name)
            if served is not None:
                return served
        else:
            served = self._serving.get(name, {}).get(version)
            if served is not None:
                return served
        return self._missing(name, version)

    def route(self, name: str, version: str = "") -> ServedVersion:
        """The version an inference request for ``name`` (``version``, empty = the highest healthy
        one) runs on: as :meth:`get`, but only a healthy version.

        Raises:
            ModelUnhealthy: that version, or every serving version of ``name``, is unhealthy.
            ModelNotFound, ModelNotReady: as :meth:`get`.
        """
        served = self._route.get(name) if not version else self._serving.get(name, {}).get(version)
        if served is not None and served.health.healthy:
            return served
        if served is not None or (not version and self._serving.get(name)):
            what = f"version {version} is not healthy" if version else "has no healthy version serving"
            raise ModelUnhealthy(f"model {name!r} {what}; retry on another replica", metadata={"model": name})
        return self._missing(name, version)

    def _missing(self, name: str, version: str) -> ServedVersion:
        versions = self._serving.get(name)
        if versions:
            available = ", ".join(sorted(versions, key=int))
            raise ModelNotFound(
                f"model {name!r} has no version {version!r} serving; available: {available}",
                metadata={"model": name, "available_versions": available},
            )
        if name in self.expected or any(key[0] == name for key in self._status):
            raise ModelNotReady(f"model {name!r} is not ready yet; retry after readiness")
        known = ", ".join(sorted(self._serving)) or "none"
        raise ModelNotFound(f"unknown model {name!r}; available: {known}", metadata={"model": name})

    # -- state -----------------------------------------------------------------------------

    def serving(self) -> dict[str, list[str]]:
        """Model name → serving versions, ascending."""
        return {name: sorted(v, key=int) for name, v in self._serving.items() if v}

    def is_ready(self, name: str, version: str = "") -> bool:
        """Whether ``name`` (``version``, or any version when empty) is serving and healthy."""
        if not version:
            return name in self._route
        served = self._serving.get(name, {}).get(version)
        return served is not None and served.health.healthy

    def is_serving(self, name: str) -> bool:
        """Whether ``name`` has a published version, healthy or not."""
        return bool(self._serving.get(name))

    def all_expected_ready(self) -> bool:
        """Whether every expected model has a healthy serving version (and at least one model is expected)."""
        return bool(self.expected) and all(name in self._route for name in self.expected)

    def index(self) -> list[VersionStatus]:
        """Every version the server has tried to load, with its state, sorted."""
        return sorted(self._status.values(), key=lambda s: (s.name, int(s.version)))

    def model_names(self) -> list[str]:
        """Models to serve: the configured ones, else every model in the repository."""
        return self.source.model_names()

    # -- load and unload -------------------------------------------------------------------

    async def load_all(self) -> None:
        """Start-up: loads every model to serve; any failure refuses the start.

        Raises:
            StartupError: the repository is missing or empty, or a model to serve has no trained
                version (the message says to run ``mlpair train``).
            ModelSourceUnavailable: the model source cannot be read now.
            ModelNotFound: a model to serve has no version the policy selects.
            ManifestError: an entry's version triple or files are inconsistent.
            ModelLoadFailed: a runtime failed to load or warm up.
        """
        names = await self.source.check_trained()
        self.expected.update(names)
        if self._on_change:
            await self._on_change()
        for name in names:
            await self.load_model(name, strict=True)

    async def load_model(self, name: str, *, strict: bool = False) -> list[str]:
        """(Re)loads ``name`` per the policy: new versions first, then retires unwanted ones.

        Versions already serving are kept as they are. If no wanted version ends up serving,
        nothing is retired (the previous versions keep serving).

        Args:
            strict: raise the first failure as is (start-up); otherwise failures are recorded
                as UNAVAILABLE and reported together as ModelLoadFailed.

        Returns:
            The versions serving afterwards.

        Raises:
            ModelNotFound: the policy selects no version of ``name`` in the repository.
            ModelLoadFailed: a wanted version failed to load (see :meth:`index` for why).
            ModelSourceUnavailable: the model source cannot be read now (nothing changes).
        """
        async with self._lock:
            wanted = [str(v) for v in self.policy.select(await self.source.versions(name))]
            if not wanted:
                raise ModelNotFound(
                    f"no version of model {name!r} at {self.source.source.uri} matches the version "
                    f"policy {self.settings.version_policy!r}",
                    metadata={"model": name},
                )
            self.expected.add(name)
            current = self._serving.get(name, {})
            failed = []
            for version in wanted:
                if version not in current:
                    try:
                        await self._load_version(name, version)
                    except Exception as exc:
                        if strict or isinstance(exc, ModelSourceUnavailable):
                            raise
                        reason = self._status[(name, version)].reason
                        failed.append(f"{version}: {reason}")
                        logger.warning(
                            "model %s version %s failed to load: %s",
                            name,
                            version,
                            reason,
                            exc_info=not isinstance(exc, InferenceError),
                        )
            serving_wanted = [v for v in wanted if v in self._serving.get(name, {})]
            if serving_wanted:
                for version in [v for v in self._serving.get(name, {}) if v not in wanted]:
                    await self._retire(name, version)
            if failed:
                raise ModelLoadFailed(
                    f"model {name!r}: {len(failed)} version(s) failed to load ({'; '.join(failed)}); "
                    f"serving: {', '.join(serving_wanted) or 'previous versions'}",
                    metadata={"model": name},
                )
            return sorted(self._serving.get(name, {}), key=int)

    async def unload_model(self, name: str) -> None:
        """Retires every version of ``name``; queued requests finish first.

        Raises:
            ModelNotFound: ``name`` is not loaded.
        """
        async with self._lock:
            if name not in self._serving and name not in self.expected:
                raise ModelNotFound(f"model {name!r} is not loaded", metadata={"model": name})
            self.expected.discard(name)
            for version in list(self._serving.get(name, {})):
                await self._retire(name, version)
            for key in [k for k in self._status if k[0] == name]:
                del self._status[key]
            if self._on_change:
                await self._on_change()

    async def poll_forever(self, interval_s: float) -> None:
        """Scans the source every ``interval_s`` and loads what the policy now selects
        (:func:`mlpair.inference.sourcing.poll`)."""
        await poll(self, interval_s)

    async def _load_version(self, name: str, version: str) -> None:
        """Loads, verifies and warms one version in a thread, then publishes it."""
        status = VersionStatus(name, version, LOADING, source_stamp=self.source.stamp(name, version))
        self._status[(name, version)] = status
        started = time.perf_counter()
        try:
            path = await self.source.fetch(name, version)
            entry, runtime, max_batch_ms, known = await asyncio.to_thread(
                open_version, path, self._factory, self.settings
            )
        except ModelSourceUnavailable:
            del self._status[(name, version)]  # not the version's fault: tried again at the next poll or load
            raise
        except Exception as exc:
            status.state = UNAVAILABLE
            status.reason = (
                exc.message
                if isinstance(exc, InferenceError)
                else (
                    str(exc)
                    if isinstance(exc, (ManifestError, VersionRefused))
                    else f"load failed ({type(exc).__name__})"
                )
            )
            metrics.MODEL_LOAD_FAILURES.labels(name, version).inc()
            if self._on_change:
                await self._on_change()
            raise
        settings = self.settings
        # A model this fast costs less to run on the event loop than one executor hop per batch.
        inline = settings.execution_instances == 1 and max_batch_ms <= settings.inline_execution_max_ms
        health = VersionHealth(name, version, settings, known, self._health_changed, self._device_lost)
        batcher = DynamicBatcher(
            runtime.run,
            model=name,
            version=version,
            max_batch_size=settings.max_batch_size,
            max_queue_delay_ms=settings.max_queue_delay_ms,
            preferred_batch_sizes=settings.preferred_batch_sizes,
            max_queue_rows=settings.max_queue_rows,
            priority_levels=settings.priority_levels,
            default_priority_level=settings.default_level,
            priority_queue_rows=settings.priority_queue_rows,
            batching=settings.batching,
            instances=settings.execution_instances,
            inline=inline,
            health=health,
        )
        batcher.start()
        health.start(batcher)
        seconds = time.perf_counter() - started
        served = ServedVersion(entry, runtime, batcher, seconds, health)
        self._serving.setdefault(name, {})[version] = served
        self._refresh_default(name)
        status.state = READY
        metrics.MODEL_LOAD_DURATION.labels(name, version).observe(seconds)
        metrics.MODEL_READY.labels(name, version).set(1)
        memory = runtime.device_memory_bytes()
        if memory is not None:
            metrics.DEVICE_MEMORY.labels(name, version).set(memory)
        where = "runs on the event loop" if inline else "runs in the executor"
        logger.info(
            "model %s version %s ready in %.2f s (%s, batch of %d rows %.3f ms, %s, triple %s)",
            name,
            version,
            seconds,
            runtime.description,
            settings.max_batch_size,
            max_batch_ms,
            where,
            entry.manifest.versions.model_dump(),
        )
        if self._on_change:
            await self._on_change()

    async def _retire(self, name: str, version: str) -> None:
        """Unpublishes a version at once, then lets its batcher finish what is queued."""
        served = self._serving[name].pop(version)
        if not self._serving[name]:
            del self._serving[name]
        self._refresh_default(name)
        status = self._status.get((name, version))
        if status:
            status.state = UNLOADING
        if self._on_change:
            await self._on_change()
        await served.health.close()
        await served.batcher.close()
        self._status.pop((name, version), None)
        metrics.MODEL_READY.labels(name, version).set(0)
        logger.info("model %s version %s unloaded", name, version)

    def _refresh_default(self, name: str) -> None:
        versions = self._serving.get(name)
        if versions:
            self._default[name] = versions[max(versions, key=int)]
        else:
            self._default.pop(name, None)
        healthy = [v for v, served in (versions or {}).items() if served.health.healthy]
        if healthy:
            self._route[name] = versions[max(healthy, key=int)]  # type: ignore[index]
        else:
            self._route.pop(name, None)

    def _health_changed(self, health: VersionHealth) -> None:
        """A serving version turned healthy or unhealthy (on the event loop): requests are routed
        by its new state at once; readiness is republished in a task."""
        if self._serving.get(health.name, {}).get(health.version) is None:
            return  # already retired
        self._refresh_default(health.name)
        metrics.MODEL_READY.labels(health.name, health.version).set(1 if health.healthy else 0)
        if self._on_change:
            self._spawn(self._on_change())

    def _device_lost(self, reason: str) -> None:
        if self._on_device_lost:
            self._spawn(self._on_device_lost(reason))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Retires every version (queued requests finish first)."""
        async with self._lock:
            for name in list(self._serving):
                for version in list(self._serving.get(name, {})):
                    await self._retire(name, version)
