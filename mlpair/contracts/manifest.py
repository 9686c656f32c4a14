"""Model repository entries and their manifests.

Layout (Triton-style): ``<root>/<model_name>/<version>/`` with ``model.onnx``,
``preprocessing.json`` (:class:`~mlpair.contracts.preprocessing.Preprocessing`) and
``manifest.json`` (:class:`Manifest`). Versions are positive integers; the highest is the
latest. :func:`load_entry` checks the manifest against its published format
(:mod:`mlpair.contracts.manifest_format`, ``docs/model-format.md``) and the version triple
before anything serves from an entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlpair.contracts import calibration
from mlpair.contracts.manifest_format import FORMAT_VERSION, FormatError, check_manifest
from mlpair.contracts.preprocessing import Preprocessing

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


class PlattParams(_Model):
    """Platt scaling: ``p = sigmoid(a * margin + b)``."""

    a: float = Field(gt=0)
    b: float


class IsotonicParams(_Model):
    """Isotonic calibration: piecewise-linear through ``(knots, values)``, constant beyond the ends."""

    knots: list[float] = Field(min_length=1)
    values: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _monotone(self) -> IsotonicParams:
        k, v = np.asarray(self.knots), np.asarray(self.values)
        if len(k) != len(v) or not np.isfinite(k).all() or (np.diff(k) <= 0).any():
            raise ValueError("isotonic knots must be finite, strictly increasing and as many as values")
        if (v < 0).any() or (v > 1).any() or (np.diff(v) < 0).any():
            raise ValueError("isotonic values must be non-decreasing and in [0, 1]")
        return self


CalibrationMethod = Literal["temperature", "platt", "isotonic"]


class Calibration(_Model):
    """Maps logits to a probability of the positive class (formulas and sources in
    :mod:`mlpair.contracts.calibration`).

    ``method`` is the one PredictionService applies; the parameters of every method fitted
    are kept so their holdout metrics can be compared. ``label_smoothing`` is the epsilon the
    model was trained with (0 = none); temperature scaling undoes it.
    """

    method: CalibrationMethod = "temperature"
    temperature: float = Field(gt=0)
    label_smoothing: float = Field(default=0.0, ge=0, lt=1)
    platt: PlattParams | None = None
    isotonic: IsotonicParams | None = None
    fitted_on: str = "calibration split"
    n_samples: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _method_is_fitted(self) -> Calibration:
        if self.method == "platt" and self.platt is None:
            raise ValueError("calibration method platt needs platt parameters")
        if self.method == "isotonic":
            if self.isotonic is None:
                raise ValueError("calibration method isotonic needs isotonic parameters")
            if self.n_samples < calibration.MIN_ISOTONIC_SAMPLES:
                raise ValueError(
                    f"isotonic calibration needs at least {calibration.MIN_ISOTONIC_SAMPLES} "
                    f"calibration samples, got {self.n_samples}"
                )
        return self

    def probabilities(
        self, logits: np.ndarray, positive_index: int, method: CalibrationMethod | Literal["none"] | None = None
    ) -> np.ndarray:
        """Positive-class probabilities ``[batch]`` float64 in [0, 1] for logits ``[batch, n_classes]``.

        Args:
            method: override of ``self.method``; "none" is the plain softmax (T = 1, no correction).

        Raises:
            ValueError: non-finite logits, or the method was not fitted.
        """
        method = method or self.method
        if method == "none":
            return calibration.temperature_probability(logits, 1.0, positive_index)
        if method == "temperature":
            return calibration.temperature_probability(logits, self.temperature, positive_index, self.label_smoothing)
        params = getattr(self, method)
        if params is None:
            raise ValueError(f"calibration method {method} was not fitted")
        m = calibration.margin(logits, positive_index)
        if method == "platt":
            return calibration.platt_probability(m, params.a, params.b)
        return calibration.isotonic_probability(m, np.asarray(params.knots), np.asarray(params.values))


class Manifest(_Model):
    """Everything a server needs to know about one model version (format: ``manifest.schema.json``)."""

    format_version: int = FORMAT_VERSION
    """The manifest format (:mod:`mlpair.contracts.manifest_format`); absent in older files, read as 1."""
    model_name: str
    versions: VersionTriple
    model_file: str = "model.onnx"
    model_sha256: str
    torch_program: str | None = None
    """Optional ``torch.export`` program of the same model (the PyTorch runtime's input)."""
    torch_program_sha256: str | None = None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    class_names: list[str]
    positive_index: int
    calibration: Calibration
    baselines: dict[str, dict]
    metrics: dict[str, dict[str, float]]
    data_source: dict[str, object]
    training: dict[str, object]
    files: dict[str, str] | None = None
    """Every file of the version but the manifest: relative path → ``sha256:<hex>``; written at publish
    time (:mod:`mlpair.sources.digest`) and checked after every download."""
    content_digest: str | None = None
    """``sha256:<hex>`` over ``files`` (:func:`mlpair.sources.digest.content_digest`): what a version is pinned by."""

    @property
    def model_version(self) -> str:
        """The model version, e.g. ``"3"`` (the version triple's, which names the entry's folder)."""
        return self.versions.model_version

    @property
    def n_features(self) -> int:
        """Columns of the feature vector the model takes: its first input's ``[batch, n_features]`` second dimension."""
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
        """The model file (ONNX) inside the entry's folder, as the manifest names it."""
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
        raw = json.loads((path / MANIFEST_FILE).read_text())
        check_manifest(raw)
    except FormatError as exc:
        raise ManifestError(f"{path}: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: unreadable model entry ({type(exc).__name__}: {exc})") from exc
    try:
        manifest = Manifest.model_validate(raw)
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
            f"{path}: preprocessing hash {preprocessing.hash} does not match the manifest's {triple.preprocessing_hash}"
        )
    model_file = path / manifest.model_file
    if not model_file.is_file() or file_sha256(model_file) != manifest.model_sha256:
        raise ManifestError(f"{path}: {manifest.model_file} is missing or does not match model_sha256")
    if manifest.torch_program is not None:
        program = path / manifest.torch_program
        if not program.is_file() or file_sha256(program) != manifest.torch_program_sha256:
            raise ManifestError(f"{path}: {manifest.torch_program} is missing or does not match torch_program_sha256")
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
    """Writes ``manifest.json`` into an entry folder (the optional pinning fields only when set).
    Format 1 is written without ``format_version`` (absent reads as 1): releases from before the
    format was published refuse a field they do not know, and keep reading versions written now.

    Raises:
        FormatError: the manifest would not follow its format (never written then).
    """
    unset = {name for name in ("files", "content_digest") if getattr(manifest, name) is None}
    if manifest.format_version == 1:
        unset.add("format_version")
    raw = manifest.model_dump(mode="json", exclude=unset)
    check_manifest(raw)
    (path / MANIFEST_FILE).write_text(json.dumps(raw, indent=2) + "\n")
