"""PredictionService's model repository when it lives in a bucket or a registry.

PredictionService reads each family's fitted preprocessing and calibration from the model versions
it decides with. With ``model_source`` set (:mod:`mlpair.sources`), those versions (the latest of
each family, plus the configured ensemble members and shadow) are fetched into the node-local
cache and verified, and a local view of the repository is made of links to them:
``<model_cache_dir>/views/<hash of the URI>/<name>/<version>`` → the cached version. The families
then load from that view as from a folder. An unreachable source at start is retried with
exponential backoff (``source_retry_max_s`` at most between tries), the reason logged and counted
in ``prediction_model_source_errors_total``; the service is not ready (not yet listening) meanwhile.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

from mlpair.prediction import metrics
from mlpair.prediction.settings import PredictionSettings
from mlpair.sources import SourceUnavailable, open_source
from mlpair.startup import StartupError

logger = logging.getLogger(__name__)


def repository_root(settings: PredictionSettings, names: list[str]) -> Path:
    """The local folder the families of ``names`` load from: ``model_repository``, or a view of the
    versions fetched from ``model_source``.

    Raises:
        StartupError: an unsupported URI, or a family with no published version.
        VersionRefused: a version's files are missing, corrupt or unpinned (one line).
    """
    if not settings.model_source:
        return settings.model_repository
    try:
        source = open_source(settings.model_source, settings.model_cache_dir, settings.model_cache_max_bytes)
    except ValueError as exc:
        raise StartupError(f"{exc} (PREDICTION_MODEL_SOURCE)") from None
    view = settings.model_cache_dir / "views" / hashlib.sha256(settings.model_source.encode()).hexdigest()[:16]
    delay = 0.5
    while True:
        try:
            for name in names:
                _link_family(source, view, name, settings)
            return view
        except SourceUnavailable as exc:
            metrics.MODEL_SOURCE_ERRORS.inc()
            logger.warning("not ready: %s; retrying in %.1f s", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, settings.source_retry_max_s)


def _link_family(source, view: Path, name: str, settings: PredictionSettings) -> None:
    versions = source.versions(name)
    if not versions:
        raise StartupError(
            f"no published version of {name!r} at {source.uri}: publish one with `mlpair publish --to {source.uri}` "
            "or point PREDICTION_MODEL_SOURCE elsewhere"
        )
    wanted = {str(versions[-1]), *settings.ensembles.get(name, ()), *filter(None, [settings.shadows.get(name)])}
    folder = view / name
    folder.mkdir(parents=True, exist_ok=True)
    for version in sorted(wanted):
        if not version.isdigit() or int(version) not in versions:
            continue  # named but not published: the family's own check names the available ones
        target = source.fetch(name, version)
        link = folder / version
        temporary = folder / f".{version}.{os.getpid()}"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(target, target_is_directory=True)
        os.replace(temporary, link)  # atomic: another process reads the old link or the new one
    for stale in folder.iterdir():
        if stale.name not in wanted and stale.is_symlink():
            stale.unlink(missing_ok=True)
