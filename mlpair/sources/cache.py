"""The node-local cache of downloaded model versions, keyed by content digest.

Layout: ``<root>/<digest hex>/<model name>/<version>/`` holds one verified version (its files and
manifest). A version is downloaded into ``<root>/.staging-*`` and moved into place with one
``rename``, so a reader never sees a partial version; when two processes download the same
version at once, the first rename wins and the other discards its copy. The cache outlives the
process: a restart, or a second process on the node given the same root, reuses what is there.

The size bound is kept by least-recently-used eviction of whole digest folders: every use
touches the digest folder's modification time, and after each download the oldest folders go
until the total is under the bound (the one just used always stays).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from mlpair.contracts.manifest import MANIFEST_FILE


class DigestCache:
    """Verified model versions on local disk, bounded in bytes.

    Args:
        root: the cache folder (created on first use).
        max_bytes: the bound on the files kept, in bytes; 0 = no bound.
    """

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def path(self, digest: str, name: str, version: str) -> Path:
        """Where version ``version`` of ``name`` with content ``digest`` (``sha256:<hex>``) lives."""
        return self.root / digest.removeprefix("sha256:") / name / version

    def lookup(self, digest: str, name: str, version: str, manifest: bytes) -> Path | None:
        """The cached version folder when present with exactly ``manifest`` as its manifest (its use
        is recorded for eviction); else None."""
        path = self.path(digest, name, version)
        try:
            if (path / MANIFEST_FILE).read_bytes() != manifest:
                return None
        except OSError:
            return None
        self._touch(path.parent.parent)
        return path

    def staging(self) -> Path:
        """A new empty folder inside the cache (same file system, so :meth:`install` is a rename)."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))

    def install(self, staging: Path, digest: str, name: str, version: str) -> Path:
        """Moves a verified version folder ``staging`` into place atomically, then evicts down to the bound.

        Returns:
            The version's cache folder (another process's identical copy if it got there first).
        """
        target = self.path(digest, name, version)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # already there: the first complete copy wins
            if not (target / MANIFEST_FILE).is_file():
                raise
        self._touch(target.parent.parent)
        self.evict(keep=target.parent.parent)
        return target

    def evict(self, keep: Path | None = None) -> list[str]:
        """Removes least recently used digest folders until the cache fits ``max_bytes``.

        Returns:
            The digests removed (hex), oldest first.
        """
        if self.max_bytes <= 0 or not self.root.is_dir():
            return []
        entries = []
        for folder in self.root.iterdir():
            if folder.is_dir() and not folder.name.startswith("."):
                size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
                entries.append((folder.stat().st_mtime, folder, size))
        total = sum(size for _, _, size in entries)
        removed = []
        for _, folder, size in sorted(entries, key=lambda e: e[0]):
            if total <= self.max_bytes:
                break
            if keep is not None and folder == keep:
                continue
            # renamed first, so a reader never sees a half-deleted version
            doomed = folder.with_name(f".evicting-{folder.name}-{os.getpid()}")
            try:
                os.rename(folder, doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            total -= size
            removed.append(folder.name)
        return removed

    @staticmethod
    def _touch(folder: Path) -> None:
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(folder, (now, now))
