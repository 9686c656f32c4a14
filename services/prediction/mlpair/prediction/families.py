"""The model families PredictionService serves, loaded and cross-checked at start-up.

A family is everything needed to decide for one ``model_name``: its feature schema (and the
fitted preprocessing of the pinned model version), its decision policy, the model versions
that decide (the latest alone, or an ensemble of versions) with their calibrations, and an
optional shadow version. Nothing here is specific to one family.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import ManifestError, ModelEntry, list_versions, load_entry, load_latest
from mlpair.contracts.schema import FeatureSchema
from mlpair.contracts.target import ModelTarget
from mlpair.prediction.deciding.policy import DecisionPolicy
from mlpair.prediction.preparing.idempotency import SchemaReading
from mlpair.prediction.scoring.calibration import Calibrator
from mlpair.startup import StartupError, require_trained

SCHEMA_FILE = "feature-schema.toml"
POLICY_FILE = "policy.toml"


class ConfigurationError(StartupError):
    """Schema, policy and model repository disagree; the service must not start (``mlpair serve
    prediction`` prints it in one line and exits 2)."""


@dataclass(frozen=True)
class ModelVersion:
    """One pinned model version and its calibration."""

    entry: ModelEntry
    calibrator: Calibrator

    @property
    def version(self) -> str:
        """The pinned model version's name, e.g. ``"3"``, as its manifest gives it."""
        return self.entry.manifest.model_version

    @classmethod
    def of(cls, entry: ModelEntry) -> ModelVersion:
        """The version ``entry`` holds, with a calibrator that applies its manifest's calibration."""
        return cls(entry, Calibrator(entry.manifest))


@dataclass(frozen=True)
class ModelFamily:
    """What PredictionService needs for one model family, checked for consistency at start-up.

    ``entry`` is the pinned latest version whose preprocessing builds the feature vectors;
    ``members`` decide (their calibrated probabilities are averaged); ``shadow`` is called
    alongside and compared, never served. All of them share ``entry``'s preprocessing.
    """

    entry: ModelEntry
    assembler: FeatureAssembler
    policy: DecisionPolicy
    members: tuple[ModelVersion, ...]
    shadow: ModelVersion | None = None

    # Cached: read several times per decision, and the fields they derive from never change.
    @functools.cached_property
    def name(self) -> str:
        """The family's model name (``credit-risk``, ``churn``), as the pinned version's manifest gives it."""
        return self.entry.manifest.model_name

    @functools.cached_property
    def schema(self) -> FeatureSchema:
        """The feature schema the pinned version's preprocessing was built on; it reads every request."""
        return self.entry.preprocessing.feature_schema

    @functools.cached_property
    def n_schema_features(self) -> int:
        """Features in the schema (not vector columns: a categorical feature is one)."""
        return len(self.schema.features)

    @functools.cached_property
    def feature_version(self) -> str:
        """The feature schema version InferenceService is asked to check (``x-feature-version``)."""
        return self.entry.manifest.versions.feature_schema_version

    def target(self, model: ModelVersion) -> ModelTarget:
        """What InferenceService is asked to run for ``model`` (a member or the shadow of this family)."""
        return ModelTarget(self.name, model.version, self.feature_version)

    @functools.cached_property
    def is_ensemble(self) -> bool:
        """Whether more than one member decides (their calibrated probabilities averaged)."""
        return len(self.members) > 1

    @functools.cached_property
    def reading(self) -> SchemaReading:
        """How the schema reads each attribute value: what a request's fingerprint is taken over."""
        return SchemaReading(self.schema)

    @functools.cached_property
    def calibration_method(self) -> str:
        """The members' calibration methods, e.g. ``temperature`` or ``temperature+platt``."""
        return "+".join(dict.fromkeys(m.calibrator.method for m in self.members))

    @classmethod
    def load(
        cls,
        name: str,
        config_dir: Path,
        model_repository: Path,
        *,
        ensemble: Sequence[str] = (),
        shadow: str | None = None,
    ) -> ModelFamily:
        """Loads the schema and policy from ``config_dir/<name>/`` and the model versions.

        Args:
            ensemble: versions whose mean calibrated probability decides; empty = the latest alone.
            shadow: a version to compare against in the background, or None.

        Raises:
            StartupError: the model repository holds no trained version of ``name`` (the
                message says to run ``mlpair train``).
            ConfigurationError: a file is missing or invalid; the configured feature schema is
                not the one the model was trained on (the version triple would break); the
                policy's missing-data rule names an attribute the schema does not have; or an
                ensemble member or the shadow builds its features differently from the latest.
        """
        require_trained(model_repository, [name], "PREDICTION_MODEL_REPOSITORY")
        try:
            schema = FeatureSchema.from_toml(config_dir / name / SCHEMA_FILE)
            policy = DecisionPolicy.from_toml(config_dir / name / POLICY_FILE)
            entry = load_latest(model_repository, name)
            members = tuple(_version(model_repository, name, v) for v in ensemble) or (entry,)
            shadow_entry = _version(model_repository, name, shadow) if shadow else None
        except (OSError, ValueError, ManifestError) as exc:
            raise ConfigurationError(f"model family {name!r}: {exc}") from exc
        trained_on = entry.preprocessing.feature_schema
        if schema != trained_on:
            raise ConfigurationError(
                f"model family {name!r}: configured feature schema {schema.version!r} differs from the one "
                f"model version {entry.manifest.model_version} was trained on ({trained_on.version!r}); "
                "retrain or deploy the matching schema"
            )
        if policy.missing_data is not None and (
            unknown := policy.missing_data.attributes - set(schema.attribute_names)
        ):
            raise ConfigurationError(
                f"model family {name!r}: policy {policy.version!r} requires attributes its feature schema "
                f"does not have: {', '.join(sorted(unknown))}"
            )
        for other in (*members, *([shadow_entry] if shadow_entry else [])):
            if other.manifest.versions.preprocessing_hash != entry.manifest.versions.preprocessing_hash:
                raise ConfigurationError(
                    f"model family {name!r}: version {other.manifest.model_version} was trained with other "
                    f"preprocessing than version {entry.manifest.model_version}; ensemble members and the "
                    "shadow must share the feature vector"
                )
        return cls(
            entry,
            FeatureAssembler(entry.preprocessing),
            policy,
            tuple(ModelVersion.of(m) for m in members),
            ModelVersion.of(shadow_entry) if shadow_entry else None,
        )


def _version(root: Path, name: str, version: str) -> ModelEntry:
    """Loads one named version, naming the available ones when it is missing.

    Raises:
        ManifestError: missing or inconsistent.
    """
    if not version.isdigit() or int(version) not in list_versions(root, name):
        available = ", ".join(str(v) for v in list_versions(root, name)) or "none"
        raise ManifestError(f"no version {version!r} of {name!r} under {root}; available: {available}")
    return load_entry(root / name / str(int(version)))
