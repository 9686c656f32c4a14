"""Where the model repository reads versions from: the source its settings name
(:mod:`mlpair.sources`), with what InferenceService does when that source cannot be read.

At start an unreachable source is retried with exponential backoff (``source_retry_max_s`` at
most between tries), the reason logged and published as the server-level readiness condition
``model_source``: the process stays live and not ready, never a crash loop. While serving, a
failed read (a poll, an explicit load) keeps the serving versions and counts in
``inference_model_source_errors_total``. Reads run in a thread (network I/O).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mlpair.inference import metrics
from mlpair.inference.errors import InferenceError, ModelSourceUnavailable
from mlpair.inference.settings import InferenceSettings
from mlpair.inference.versions import UNAVAILABLE
from mlpair.sources import ModelSource, SourceUnavailable, open_source
from mlpair.startup import StartupError, require_trained

if TYPE_CHECKING:
    from mlpair.inference.repository import ModelRepository

logger = logging.getLogger(__name__)


class SourceReader:
    """The repository's model source, read off the event loop.

    Args:
        settings: ``model_source`` (empty = the local ``model_repository``), the cache folder and bound.

    Raises:
        StartupError: the URI's scheme is not supported.
    """

    def __init__(self, settings: InferenceSettings) -> None:
        self.settings = settings
        try:
            self.source: ModelSource = open_source(
                settings.model_source or settings.model_repository,
                settings.model_cache_dir,
                settings.model_cache_max_bytes,
            )
        except ValueError as exc:
            raise StartupError(f"{exc} (INFERENCE_MODEL_SOURCE)") from None
        self.names: list[str] = []
        """The models found in a remote source at start (when ``models`` is empty)."""
        for operation in ("list", "fetch"):  # the series exist at zero: increase() sees a first failure
            metrics.MODEL_SOURCE_ERRORS.labels(operation)

    @property
    def local(self) -> bool:
        """Whether the source is a local folder read in place."""
        return self.source.local_root is not None

    def model_names(self) -> list[str]:
        """Models to serve: the configured ones, else the local folders or those found at start."""
        if self.settings.models or self.local:
            return self.settings.models_to_serve()
        return list(self.names)

    async def versions(self, name: str) -> list[int]:
        """Published versions of ``name``.

        Raises:
            ModelSourceUnavailable: the source cannot be read now (counted).
        """
        return await self._read("list", self.source.versions, name)

    async def fetch(self, name: str, version: str) -> Path:
        """A local, verified folder of the version (downloaded into the node cache when remote).

        Raises:
            ModelSourceUnavailable: the source cannot be read now (counted).
            VersionRefused: the version's files are missing, corrupt or unpinned.
        """
        return await self._read("fetch", self.source.fetch, name, version)

    def stamp(self, name: str, version: str) -> str:
        """Changes when the version's published content changes (a failed version is retried then)."""
        return self.source.stamp(name, version)

    async def _read(self, operation: str, call: Callable, *args):
        try:
            return await asyncio.to_thread(call, *args)
        except SourceUnavailable as exc:
            metrics.MODEL_SOURCE_ERRORS.labels(operation).inc()
            raise ModelSourceUnavailable(str(exc)) from None

    async def check_trained(self) -> list[str]:
        """The models to serve, each with at least one version (remote: models found at start).

        Raises:
            StartupError: nothing to serve, or a model to serve has no version (the fix in the message).
            ModelSourceUnavailable: the source cannot be read now.
        """
        if self.local:
            names = self.model_names()
            require_trained(self.settings.model_repository, names, "INFERENCE_MODEL_REPOSITORY")
            return names
        if not self.settings.models:
            self.names = await self._read("list", self.source.models)
        names = self.model_names()
        fix = f"publish one with `mlpair publish --to {self.source.uri}` or point INFERENCE_MODEL_SOURCE elsewhere"
        if not names:
            raise StartupError(f"model source {self.source.uri} holds no model: {fix}")
        for name in names:
            if not await self.versions(name):
                raise StartupError(f"no published version of {name!r} at {self.source.uri}: {fix}")
        return names


async def with_backoff(
    attempt: Callable[[], Awaitable[None]],
    set_condition: Callable[[str, str | None], Awaitable[None]],
    max_delay_s: float,
) -> None:
    """Runs ``attempt`` until it no longer fails with ModelSourceUnavailable, waiting 0.5 s, 1 s, 2 s …
    (at most ``max_delay_s``) between tries; meanwhile the readiness condition ``model_source`` holds
    the reason (cleared once an attempt gets through). Any other error is raised as it came."""
    delay = 0.5
    while True:
        try:
            await attempt()
        except ModelSourceUnavailable as exc:
            logger.warning("not ready: %s; retrying in %.1f s", exc.message, delay)
            await set_condition("model_source", exc.message)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
            continue
        await set_condition("model_source", None)
        return


async def poll(repository: ModelRepository, interval_s: float) -> None:
    """Scans the source every ``interval_s`` and loads what the version policy now selects, beside the
    serving versions (:meth:`ModelRepository.load_model`: loaded and warmed first, then switched).

    A version that failed is retried only after its published content changes (its stamp); an
    unreadable source is logged and counted, and the serving versions stay.
    """
    while True:
        await asyncio.sleep(interval_s)
        for name in repository.model_names():
            try:
                if await _needs_load(repository, name):
                    await repository.load_model(name)
            except InferenceError as exc:
                logger.warning("repository poll: %s", exc.message)


async def _needs_load(repository: ModelRepository, name: str) -> bool:
    source = repository.source
    wanted = [str(v) for v in repository.policy.select(await source.versions(name))]
    if not wanted:
        return False
    serving = set(repository.serving().get(name, []))
    statuses = {s.version: s for s in repository.index() if s.name == name}
    for version in wanted:
        status = statuses.get(version)
        if version in serving:
            continue
        changed = status is not None and status.source_stamp != source.stamp(name, version)
        if status is None or status.state != UNAVAILABLE or changed:
            return True
    return bool(serving - set(wanted))
