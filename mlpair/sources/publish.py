"""Publishing a trained version to a model source: a local folder, a bucket or an MLflow registry.

The version is copied to a staging folder, its manifest gets ``files`` and ``content_digest``
(:func:`mlpair.sources.digest.pin`), and the copy is checked as the services will check it
(:func:`~mlpair.contracts.manifest.load_entry`) before anything is written to the target. Readers
never see half a version: a local target gets it with one ``rename``; a bucket gets the manifest
last (readers list versions by their manifest); MLflow registers the model version only after
every artifact is logged. Publishing the same content again changes nothing; another content
under an existing version number is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from mlpair.contracts.manifest import MANIFEST_FILE, ModelEntry, load_entry
from mlpair.sources.base import redact
from mlpair.sources.digest import pin


class PublishError(Exception):
    """The version cannot be published there (exists with other content, unsupported target); one line."""


def publish(version_folder: Path, uri: str) -> str:
    """Publishes the version in ``version_folder`` (``<repo>/<name>/<version>``) to ``uri``.

    Args:
        uri: a local repository root (path or ``file://``), ``s3://bucket/prefix``, or ``models:/``
            / ``models:/name`` / ``models:/name@alias`` (MLflow; the alias is moved to the new version).

    Returns:
        The content digest published.

    Raises:
        ManifestError: the version is inconsistent (it would never load).
        PublishError: the target holds this version number with other content, the URI is unsupported,
            or the bucket or registry failed (its error's type and code only).
        ValueError: a malformed ``models:`` or ``s3://`` URI.
    """
    with tempfile.TemporaryDirectory(prefix="mlpair-publish-") as tmp:
        staged = Path(tmp) / version_folder.name
        shutil.copytree(version_folder, staged)
        digest = pin(staged)
        entry = load_entry(staged)
        if uri.startswith(("s3://", "models:")):
            try:
                (_to_s3 if uri.startswith("s3://") else _to_mlflow)(entry, uri, digest)
            except (PublishError, ValueError):
                raise
            except Exception as exc:  # noqa: BLE001  (a client's text may carry URLs: type and code only)
                response = getattr(exc, "response", None)
                code = response.get("Error", {}).get("Code", "") if isinstance(response, dict) else ""
                kind = type(exc).__name__ + (f" {code}" if code else "")
                raise PublishError(f"publishing {_label(entry)} to {redact(uri)} failed ({kind})") from None
        elif "://" in uri and not uri.startswith("file://"):
            raise PublishError(f"cannot publish to {redact(uri)}: use a path, s3://bucket/prefix or models:/name")
        else:
            _to_folder(entry, Path(uri.removeprefix("file://")), digest)
    return digest


def _refuse_other(label: str, existing: bytes, digest: str, where: str) -> bool:
    """True when the existing manifest pins ``digest`` (nothing to do); refuses any other content."""
    try:
        theirs = json.loads(existing).get("content_digest")
    except ValueError:
        theirs = None
    if theirs == digest:
        return True
    raise PublishError(
        f"{label} already exists at {where} with other content ({theirs or 'unpinned'}); train a new version"
    )


def _label(entry: ModelEntry) -> str:
    return f"{entry.manifest.model_name} version {entry.manifest.model_version}"


def _to_folder(entry: ModelEntry, root: Path, digest: str) -> None:
    target = root / entry.manifest.model_name / entry.manifest.model_version
    if (target / MANIFEST_FILE).is_file() and _refuse_other(
        _label(entry), (target / MANIFEST_FILE).read_bytes(), digest, str(root)
    ):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".publish-", dir=target.parent))
    try:
        shutil.copytree(entry.path, staging, dirs_exist_ok=True)
        for path in [staging, *staging.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _to_s3(entry: ModelEntry, uri: str, digest: str) -> None:
    from mlpair.sources.s3 import s3_client, split_s3_uri

    bucket, prefix = split_s3_uri(uri)
    client = s3_client()
    base = f"{prefix}{entry.manifest.model_name}/{entry.manifest.model_version}/"
    try:
        existing = client.get_object(Bucket=bucket, Key=base + MANIFEST_FILE)["Body"].read()
    except client.exceptions.NoSuchKey:
        existing = None
    if existing is not None and _refuse_other(_label(entry), existing, digest, redact(uri)):
        return
    files = sorted(p for p in entry.path.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    for path in files:
        client.upload_file(str(path), bucket, base + path.relative_to(entry.path).as_posix())
    client.upload_file(str(entry.path / MANIFEST_FILE), bucket, base + MANIFEST_FILE)  # last: now it is listed


def _to_mlflow(entry: ModelEntry, uri: str, digest: str) -> None:
    import mlflow
    from mlflow import MlflowClient

    from mlpair.sources.registry import VERSION_TAG, parse_models_uri

    name, version, alias = parse_models_uri(uri)
    manifest = entry.manifest
    if version or (name and name != manifest.model_name):
        raise PublishError(f"publish to models:/ or models:/{manifest.model_name}[@alias], not {uri}")
    client = MlflowClient()
    model = manifest.model_name
    for mv in client.search_model_versions(f"name = '{model}'"):
        if (mv.tags or {}).get(VERSION_TAG) == manifest.model_version:
            if (mv.tags or {}).get("mlpair.content_digest") != digest:
                raise PublishError(f"{_label(entry)} is already registered in MLflow with other content")
            if alias:
                client.set_registered_model_alias(model, alias, mv.version)
            return
    triple = manifest.versions
    tags = {
        VERSION_TAG: triple.model_version,
        "mlpair.feature_schema_version": triple.feature_schema_version,
        "mlpair.preprocessing_hash": triple.preprocessing_hash,
        "mlpair.content_digest": digest,
        "mlpair.data_source": json.dumps(manifest.data_source, sort_keys=True, default=str)[:5000],
        **{
            f"mlpair.metric.{split}.{k}": str(v)
            for split, values in manifest.metrics.items()
            for k, v in values.items()
        },
    }
    mlflow.set_experiment("mlpair-publish")
    with mlflow.start_run(run_name=f"{model}-{triple.model_version}") as run:
        mlflow.log_artifacts(str(entry.path), artifact_path="version")
        mlflow.set_tags(tags)
        source = f"{run.info.artifact_uri.rstrip('/')}/version"
    try:
        client.create_registered_model(model)
    except Exception as exc:  # noqa: BLE001  (already registered is the usual case)
        if "RESOURCE_ALREADY_EXISTS" not in str(getattr(exc, "error_code", "")):
            raise
    mv = client.create_model_version(model, source, run_id=run.info.run_id, tags=tags)
    if alias:
        client.set_registered_model_alias(model, alias, mv.version)
