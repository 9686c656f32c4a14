"""Model repository entries and their manifests.

Layout (Triton-style): ``<root>/<model_name>/<version>/`` with ``model.onnx``,
``preprocessing.json`` (:class:`~mlpair.contracts.schema.Preprocessing`) and
``manifest.json`` (:class:`Manifest`). Versions are positive integers; the highest is the
latest. :func:`load_entry` checks the version triple before anything serves from an entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from mlpair.contracts.schema import Preprocessing

MANIFEST_FILE = "manifest.json"
PREPROCESSING_FILE = "preprocessing.json"
# Key of the calibrated-score baseline in ``Manifest.baselines`` (the others are feature names).
SCORE_BASELINE = "__score__"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class VersionTriple(_Model):
    """The three versions that must agree between a model and the features fed to it."""

    model_version: str
    feature_schema_version: str
    preprocessing_hash: str


class TensorSpec(_Model):
    """Name, element type and shape (-1 = dynamic) of a model input or output."""

    name: str
    data_type: str = "FP32"
    shape: list[int]


class Calibration(_Model):
    """Maps logits to a probability: ``p = softmax(logits / temperature)[positive_index]``.

    Temperature scaling: Guo et al., "On Calibration of Modern Neural Networks", ICML 2017.
    """

    method: str = "temperature"
    temperature: float = Field(gt=0)
    fitted_on: str = "calibration split"


class Manifest(_Model):
    """Everything a server needs to know about one model version."""

    model_name: str
    versions: VersionTriple
    model_file: str = "model.onnx"
    model_sha256: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    class_names: list[str]
    positive_index: int
    calibration: Calibration
    baselines: dict[str, dict]
    metrics: dict[str, dict[str, float]]
    data_source: dict[str, object]
    training: dict[str, object]

    @property
    def model_version(self) -> str:
        return self.versions.model_version

    @property
    def n_features(self) -> int:
        return self.inputs[0].shape[1]


class ManifestError(Exception):
    """A repository entry is missing, unreadable or inconsistent (message says which)."""


@dataclass(frozen=True)
class ModelEntry:
    """A verified repository entry: its folder, manifest and preprocessing."""

    path: Path
    manifest: Manifest
    preprocessing: Preprocessing

    @property
    def model_path(self) -> Path:
        return self.path / self.manifest.model_file


def file_sha256(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes."""
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def list_versions(root: Path, model_name: str) -> list[int]:
    """Versions present for a model, ascending (folders named by a positive integer)."""
    folder = root / model_name
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0)


def load_entry(path: Path) -> ModelEntry:
    """Loads and verifies one ``<root>/<model_name>/<version>/`` folder.

    Checks that the folder's name is the manifest's model version, the model file's hash
    matches, and the preprocessing file's schema version and hash match the version triple.

    Raises:
        ManifestError: naming the first inconsistency found.
    """
    try:
        manifest = Manifest.model_validate_json((path / MANIFEST_FILE).read_text())
        preprocessing = Preprocessing.load(path / PREPROCESSING_FILE)
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: unreadable model entry ({type(exc).__name__}: {exc})") from exc
    triple = manifest.versions
    if path.name != triple.model_version:
        raise ManifestError(f"{path}: folder is version {path.name} but manifest says {triple.model_version}")
    if preprocessing.feature_schema.version != triple.feature_schema_version:
        raise ManifestError(
            f"{path}: preprocessing is for feature schema {preprocessing.feature_schema.version} "
            f"but the manifest's triple says {triple.feature_schema_version}"
        )
    if preprocessing.hash != triple.preprocessing_hash:
        raise ManifestError(
            f"{path}: preprocessing hash {preprocessing.hash} does not match the manifest's "
            f"{triple.preprocessing_hash}"
        )
    model_file = path / manifest.model_file
    if not model_file.is_file() or file_sha256(model_file) != manifest.model_sha256:
        raise ManifestError(f"{path}: {manifest.model_file} is missing or does not match model_sha256")
    if manifest.n_features != preprocessing.n_features:
        raise ManifestError(
            f"{path}: model input has {manifest.n_features} features, preprocessing builds {preprocessing.n_features}"
        )
    return ModelEntry(path, manifest, preprocessing)


def load_latest(root: Path, model_name: str) -> ModelEntry:
    """Loads the highest version of a model.

    Raises:
        ManifestError: no version exists, or the latest is inconsistent.
    """
    versions = list_versions(root, model_name)
    if not versions:
        raise ManifestError(f"no versions of model {model_name!r} under {root}")
    return load_entry(root / model_name / str(versions[-1]))


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Writes ``manifest.json`` into an entry folder."""
    (path / MANIFEST_FILE).write_text(json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
