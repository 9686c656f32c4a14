"""Content digests of a model version: what a version is pinned by.

A version is a folder of files plus its ``manifest.json``. At publish time the manifest records
``files`` (every file of the version except the manifest, by its path relative to the version
folder with ``/`` separators, mapped to ``sha256:<64 hex>`` of its bytes) and ``content_digest``
(:func:`content_digest` of those entries). A reader checks every downloaded file against
``files`` (:func:`verify_files`) before anything loads from it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mlpair.contracts.manifest import MANIFEST_FILE, file_sha256


class VersionRefused(Exception):
    """A version's files are missing, corrupt, unpinned or inconsistent: it never loads. The message is
    one line naming the version, the file, and what was expected against what was found."""


def content_digest(files: dict[str, str]) -> str:
    """``sha256:<64 hex>`` pinning a version's content.

    The SHA-256 of the UTF-8 bytes of one line per ``files`` entry, sorted by path, each
    ``<path>\\t<file digest>\\n`` (e.g. ``model.onnx\\tsha256:ab…\\n``). The manifest itself is not
    among the entries (it holds the digest).
    """
    lines = "".join(f"{path}\t{digest}\n" for path, digest in sorted(files.items()))
    return "sha256:" + hashlib.sha256(lines.encode("utf-8")).hexdigest()


def files_of(folder: Path) -> dict[str, str]:
    """Path (relative, ``/``-separated) → ``sha256:<hex>`` of every file under ``folder`` but the manifest."""
    return {
        p.relative_to(folder).as_posix(): file_sha256(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() != MANIFEST_FILE
    }


def pin(folder: Path) -> str:
    """Records ``files`` and ``content_digest`` in ``folder``'s manifest (rewritten in place).

    Returns:
        The content digest.
    """
    path = folder / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    files = files_of(folder)
    manifest["files"] = files
    manifest["content_digest"] = content_digest(files)
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest["content_digest"]


def pinned(manifest_bytes: bytes, label: str) -> tuple[dict[str, str], str]:
    """The ``files`` and ``content_digest`` of a manifest, checked against each other.

    Args:
        label: how the version is named in an error, e.g. ``credit-risk version 3``.

    Raises:
        VersionRefused: unreadable manifest, no ``files``/``content_digest``, a path leaving the
            version folder, or a digest that is not the one of ``files``.
    """
    try:
        manifest = json.loads(manifest_bytes)
        files, digest = manifest.get("files"), manifest.get("content_digest")
    except (ValueError, AttributeError):
        raise VersionRefused(f"{label}: manifest.json is not a JSON object") from None
    if not isinstance(files, dict) or not isinstance(digest, str):
        raise VersionRefused(f"{label}: manifest.json has no files and content_digest; publish it with mlpair publish")
    for rel in files:
        if rel.startswith("/") or ".." in rel.split("/") or rel == MANIFEST_FILE:
            raise VersionRefused(f"{label}: manifest lists an unsafe file path {rel!r}")
    if content_digest(files) != digest:
        raise VersionRefused(
            f"{label}: content_digest expected {content_digest(files)} (from files) got {digest} in manifest.json"
        )
    return files, digest


def verify_files(folder: Path, files: dict[str, str], label: str) -> None:
    """Checks every file of ``files`` under ``folder`` against its digest.

    Raises:
        VersionRefused: the first file missing or whose bytes do not match, as one line.
    """
    for rel, expected in sorted(files.items()):
        path = folder / rel
        if not path.is_file():
            raise VersionRefused(f"{label}: file {rel} is missing (expected {expected})")
        got = file_sha256(path)
        if got != expected:
            raise VersionRefused(f"{label}: file {rel} expected {expected} got {got}")
