"""An MLflow model registry as a model source, through MLflow's own client.

URIs: ``models:/name`` (every registered version of ``name``; the version policy picks),
``models:/name/3`` (registry version 3 alone), ``models:/name@champion`` (the version the alias
points to, looked up again at every poll: moving the alias switches the served version) and
``models:/`` (every registered model). The tracking server and its credentials come from MLflow's
own environment variables (``MLFLOW_TRACKING_URI``, ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD`` or ``MLFLOW_TRACKING_TOKEN``).

A registry version's artifacts are one mlpair version folder; its tag ``mlpair.model_version``
is the mlpair version number the services use (registry numbers may differ from it).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from mlpair.contracts.manifest import MANIFEST_FILE
from mlpair.sources.base import RemoteSource
from mlpair.sources.cache import DigestCache
from mlpair.sources.digest import VersionRefused

VERSION_TAG = "mlpair.model_version"


def parse_models_uri(uri: str) -> tuple[str, str, str]:
    """``models:/name/3`` → (name, "3", ""); ``models:/name@a`` → (name, "", "a"); ``models:/`` → ("", "", "").

    Raises:
        ValueError: any other shape.
    """
    rest = uri.removeprefix("models:").lstrip("/").rstrip("/")
    name, _, alias = rest.partition("@")
    name, _, version = name.partition("/")
    if (
        "/" in version
        or (version and not version.isdigit())
        or (alias and version)
        or ((alias or version) and not name)
    ):
        raise ValueError(f"model repository {uri}: use models:/name, models:/name/version or models:/name@alias")
    return name, version, alias


class MlflowSource(RemoteSource):
    """Model versions registered in MLflow (client made on first use)."""

    def __init__(self, uri: str, cache: DigestCache) -> None:
        super().__init__(uri, cache)
        self.name, self.version, self.alias = parse_models_uri(uri)
        self._client = None
        self._registry: dict[tuple[str, str], str] = {}  # (name, mlpair version) → registry version

    @property
    def client(self):
        """MLflow's client, configured from MLflow's environment variables."""
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient()
        return self._client

    def models(self) -> list[str]:
        """The URI's model, or every registered model for ``models:/``."""
        if self.name:
            return [self.name]
        try:
            return sorted(m.name for m in self.client.search_registered_models())
        except Exception as exc:  # noqa: BLE001  (type only: the client's text may carry the tracking URL)
            raise self.unavailable("listing registered models", exc) from None

    def versions(self, name: str) -> list[int]:
        """mlpair versions of ``name`` the URI selects (their registry update time is the stamp)."""
        if self.name and name != self.name:
            return []
        try:
            if self.alias:
                found = [self.client.get_model_version_by_alias(name, self.alias)]
            elif self.version:
                found = [self.client.get_model_version(name, self.version)]
            else:
                found = list(self.client.search_model_versions(f"name = '{name}'"))
        except Exception as exc:  # noqa: BLE001
            if type(exc).__name__ == "RestException" and "RESOURCE_DOES_NOT_EXIST" in str(
                getattr(exc, "error_code", "")
            ):
                return []
            raise self.unavailable(f"listing {name}", exc) from None
        versions = []
        for mv in found:
            ours = (mv.tags or {}).get(VERSION_TAG, "")
            if ours.isdigit() and int(ours) > 0:
                versions.append(int(ours))
                self._registry[(name, ours)] = str(mv.version)
                self._stamps[(name, ours)] = f"{mv.version}:{mv.last_updated_timestamp}"
        return sorted(set(versions))

    def _artifacts(self, name: str, version: str) -> str:
        registry = self._registry.get((name, version))
        if registry is None:
            self.versions(name)
            registry = self._registry.get((name, version))
        if registry is None:
            raise VersionRefused(f"{name} version {version}: not registered at {self.uri}")
        try:
            return self.client.get_model_version_download_uri(name, registry)
        except Exception as exc:  # noqa: BLE001
            raise self.unavailable(f"resolving {name} version {version}", exc) from None

    def _read_manifest(self, name: str, version: str) -> bytes:
        uri = self._artifacts(name, version)
        with tempfile.TemporaryDirectory() as tmp:
            path = self._get(f"{uri.rstrip('/')}/{MANIFEST_FILE}", Path(tmp), f"{name} version {version} manifest.json")
            if not path.is_file():
                raise VersionRefused(f"{name} version {version}: manifest.json is missing at {self.uri}")
            return path.read_bytes()

    def _download(self, name: str, version: str, files: list[str], dest: Path) -> None:
        uri = self._artifacts(name, version)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            folder = self._get(uri, Path(tmp), f"{name} version {version} artifacts")
            for rel in files:
                if (folder / rel).is_file():
                    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(folder / rel, dest / rel)

    def _get(self, artifact_uri: str, dst: Path, what: str) -> Path:
        import mlflow.artifacts

        try:
            return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(dst)))
        except Exception as exc:  # noqa: BLE001
            if "RESOURCE_DOES_NOT_EXIST" in str(getattr(exc, "error_code", "")) or isinstance(exc, FileNotFoundError):
                raise VersionRefused(f"{what} missing at {self.uri}") from None
            raise self.unavailable(f"downloading {what}", exc) from None
