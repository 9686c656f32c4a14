"""The model source interface, the local-folder source and the shared download path of remote ones.

URIs: a plain path (or ``file://``) is a local repository read in place, as before;
``s3://bucket/prefix`` is :class:`~mlpair.sources.s3.S3Source`; ``models:/…`` is
:class:`~mlpair.sources.registry.MlflowSource`. Errors name the source by :func:`redact`\\ ed URI
only: never credentials, query strings or a library's own message (which may carry signed URLs).
"""

from __future__ import annotations

import abc
import shutil
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from mlpair.contracts.manifest import MANIFEST_FILE, list_versions
from mlpair.sources.cache import DigestCache
from mlpair.sources.digest import VersionRefused, pinned, verify_files


class SourceUnavailable(Exception):
    """The source cannot be read now (unreachable, refused, timed out): retry later. One line, with
    the source's redacted URI and the error's type or code, never its text."""


def redact(uri: str) -> str:
    """``uri`` without user information, query string or fragment (``https://u:p@h/x?sig=1`` → ``https://h/x``)."""
    parts = urlsplit(uri)
    if not parts.scheme or len(parts.scheme) == 1:  # a path (a Windows drive letter is no scheme)
        return uri.split("?", 1)[0]
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class ModelSource(abc.ABC):
    """A model repository: ``<model name>/<version>/`` entries, wherever they are kept.

    Methods may block (network I/O): the services call them in a thread.
    """

    uri: str
    """The source's URI as it may be shown (redacted)."""
    local_root: Path | None = None
    """The repository folder when the source is a local one (read in place), else None."""

    @abc.abstractmethod
    def models(self) -> list[str]:
        """Model names the source holds, sorted.

        Raises:
            SourceUnavailable: the source cannot be read now.
        """

    @abc.abstractmethod
    def versions(self, name: str) -> list[int]:
        """Published versions of ``name``, ascending (none: an empty list).

        Raises:
            SourceUnavailable: the source cannot be read now.
        """

    @abc.abstractmethod
    def stamp(self, name: str, version: str) -> str:
        """A token that changes when the version's published content changes (a failed version is
        retried only then); as of the last :meth:`versions` call for remote sources."""

    @abc.abstractmethod
    def fetch(self, name: str, version: str) -> Path:
        """A local folder, named ``version``, holding the version's verified files and manifest.

        Raises:
            SourceUnavailable: the source cannot be read now.
            VersionRefused: the version's files are missing, corrupt or not pinned by digest.
        """


class LocalSource(ModelSource):
    """A repository folder read in place (no copy, no cache)."""

    def __init__(self, root: Path) -> None:
        self.local_root = Path(root)
        self.uri = str(root)

    def models(self) -> list[str]:
        """Folders of the repository (dot folders skipped); none when it does not exist."""
        root = self.local_root
        if root is None or not root.is_dir():
            return []
        return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))

    def versions(self, name: str) -> list[int]:
        """Version folders of ``name`` (:func:`~mlpair.contracts.manifest.list_versions`)."""
        assert self.local_root is not None
        return list_versions(self.local_root, name)

    def stamp(self, name: str, version: str) -> str:
        """Newest modification time of the version folder's files."""
        assert self.local_root is not None
        try:
            path = self.local_root / name / version
            return str(max((p.stat().st_mtime for p in path.iterdir()), default=path.stat().st_mtime))
        except OSError:
            return ""

    def fetch(self, name: str, version: str) -> Path:
        """The version folder itself (checked when it loads, as before)."""
        assert self.local_root is not None
        return self.local_root / name / version


class RemoteSource(ModelSource):
    """A source downloaded through the node-local cache; subclasses list and read objects."""

    def __init__(self, uri: str, cache: DigestCache) -> None:
        self.uri = redact(uri)
        self.cache = cache
        self._stamps: dict[tuple[str, str], str] = {}

    @abc.abstractmethod
    def _read_manifest(self, name: str, version: str) -> bytes:
        """The version's manifest bytes (VersionRefused when it has none)."""

    @abc.abstractmethod
    def _download(self, name: str, version: str, files: list[str], dest: Path) -> None:
        """Writes each of ``files`` (relative paths) of the version under ``dest``."""

    def stamp(self, name: str, version: str) -> str:
        """The stamp of the last listing (ETag, registry update time)."""
        return self._stamps.get((name, version), "")

    def fetch(self, name: str, version: str) -> Path:
        """The cached copy when its manifest is the published one; else downloaded, verified, cached."""
        label = f"{name} version {version}"
        manifest = self._read_manifest(name, version)
        files, digest = pinned(manifest, label)
        cached = self.cache.lookup(digest, name, version, manifest)
        if cached is not None:
            return cached
        staging = self.cache.staging()
        try:
            self._download(name, version, sorted(files), staging)
            verify_files(staging, files, label)
            extra = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
            if unexpected := [rel for rel in extra if rel not in files]:
                raise VersionRefused(f"{label}: file {unexpected[0]} is not listed in the manifest's files")
            (staging / MANIFEST_FILE).write_bytes(manifest)
            return self.cache.install(staging, digest, name, version)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def unavailable(self, what: str, exc: BaseException) -> SourceUnavailable:
        """The one-line error for a failed read: the source, what was read, the error's type and code only."""
        code = getattr(exc, "response", {}) or {}
        detail = code.get("Error", {}).get("Code") if isinstance(code, dict) else None
        kind = type(exc).__name__ + (f" {detail}" if detail else "")
        return SourceUnavailable(f"model source {self.uri}: {what} failed ({kind})")


def open_source(uri: str | Path, cache_dir: Path, cache_max_bytes: int) -> ModelSource:
    """The source a repository URI names.

    Args:
        uri: a local path or ``file://`` URI, ``s3://bucket/prefix``, or ``models:/name``,
            ``models:/name/version``, ``models:/name@alias``, ``models:/`` (an MLflow registry).
        cache_dir, cache_max_bytes: the node-local cache of remote sources and its bound in bytes.

    Raises:
        ValueError: an unsupported scheme, naming the supported ones.
    """
    text = str(uri)
    cache = DigestCache(cache_dir, cache_max_bytes)
    if text.startswith("s3://"):
        from mlpair.sources.s3 import S3Source

        return S3Source(text, cache)
    if text.startswith("models:"):
        from mlpair.sources.registry import MlflowSource

        return MlflowSource(text, cache)
    if text.startswith("file://"):
        return LocalSource(Path(urlsplit(text).path))
    if "://" in text:
        raise ValueError(
            f"model repository {redact(text)}: unsupported scheme; use a path, file://, s3://bucket/prefix or models:/name"
        )
    return LocalSource(Path(text))
