"""S3-compatible object storage: ``s3://bucket/prefix`` holding ``<prefix>/<model>/<version>/<file>``.

boto3 finds the endpoint, region and credentials the S3 ecosystem's usual way: ``AWS_ENDPOINT_URL``
/ ``AWS_ENDPOINT_URL_S3``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` with ``~/.aws/config`` and
``~/.aws/credentials``, or a workload identity (IRSA's web identity token, instance metadata).
A version is published when its ``manifest.json`` is present (publishers write it last).
"""

from __future__ import annotations

from pathlib import Path

from mlpair.contracts.manifest import MANIFEST_FILE
from mlpair.sources.base import RemoteSource
from mlpair.sources.cache import DigestCache
from mlpair.sources.digest import VersionRefused

_MISSING = {"404", "NoSuchKey", "NotFound"}


# botocore logs request headers (the signing key id, the signature) and credential lookups at DEBUG:
# these loggers stay at WARNING whatever the service's log level, so no credential reaches a log.
QUIET_LOGGERS = ("boto3", "botocore", "s3transfer", "urllib3")


def s3_client():
    """A boto3 S3 client configured from the environment, with short connect and read timeouts."""
    import logging

    import boto3
    from botocore.config import Config

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)

    config = Config(connect_timeout=3, read_timeout=20, retries={"max_attempts": 2, "mode": "standard"})
    return boto3.session.Session().client("s3", config=config)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → (``bucket``, ``a/b/``); the prefix is empty or ends in ``/``.

    Raises:
        ValueError: no bucket.
    """
    rest = uri.removeprefix("s3://").split("?", 1)[0]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError("model repository s3:// needs a bucket: s3://bucket/prefix")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


class S3Source(RemoteSource):
    """Model versions in a bucket, read with boto3 (one client per source, thread-safe)."""

    def __init__(self, uri: str, cache: DigestCache) -> None:
        super().__init__(uri, cache)
        self.bucket, self.prefix = split_s3_uri(uri)
        self._client = None

    @property
    def client(self):
        """The boto3 client, made on first use."""
        if self._client is None:
            self._client = s3_client()
        return self._client

    def _pages(self, what: str, **kwargs):
        try:
            yield from self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, **kwargs)
        except Exception as exc:  # noqa: BLE001  (boto's text may carry URLs: type and code only)
            raise self.unavailable(what, exc) from None

    def models(self) -> list[str]:
        """Top-level folders under the prefix."""
        names = set()
        for page in self._pages("listing models", Prefix=self.prefix, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                names.add(common["Prefix"][len(self.prefix) :].strip("/"))
        return sorted(n for n in names if n and not n.startswith("."))

    def versions(self, name: str) -> list[int]:
        """Versions of ``name`` whose manifest is present (their ETag is the stamp)."""
        found = {}
        base = f"{self.prefix}{name}/"
        for page in self._pages(f"listing {name}", Prefix=base):
            for obj in page.get("Contents", []):
                folder, _, file = obj["Key"][len(base) :].partition("/")
                if file == MANIFEST_FILE and folder.isdigit() and int(folder) > 0:
                    found[int(folder)] = obj.get("ETag", "")
        for version, etag in found.items():
            self._stamps[(name, str(version))] = etag
        return sorted(found)

    def _key(self, name: str, version: str, rel: str) -> str:
        return f"{self.prefix}{name}/{version}/{rel}"

    def _read_manifest(self, name: str, version: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(name, version, MANIFEST_FILE))[
                "Body"
            ].read()
        except Exception as exc:  # noqa: BLE001
            if _code(exc) in _MISSING:
                raise VersionRefused(f"{name} version {version}: manifest.json is missing at {self.uri}") from None
            raise self.unavailable(f"reading {name} version {version} manifest.json", exc) from None

    def _download(self, name: str, version: str, files: list[str], dest: Path) -> None:
        for rel in files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.client.download_file(self.bucket, self._key(name, version, rel), str(target))
            except Exception as exc:  # noqa: BLE001
                if _code(exc) in _MISSING:
                    raise VersionRefused(f"{name} version {version}: file {rel} is missing at {self.uri}") from None
                raise self.unavailable(f"downloading {name} version {version} {rel}", exc) from None


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
