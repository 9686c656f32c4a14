"""The transport-neutral core of PredictionService.

``Predictor.predict``: idempotency look-up → feature assembly and guards (the same code
training used) → InferenceService with the version contract → temperature calibration →
decision policy → CRM write. A retried request id returns the recorded decision unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlpair import logs
from mlpair.contracts.assembly import ConversionError, FeatureAssembler
from mlpair.contracts.calibration import temperature_probability
from mlpair.contracts.manifest import ManifestError, ModelEntry, load_latest
from mlpair.contracts.schema import FeatureSchema
from mlpair.errors import ServiceError
from mlpair.prediction import metrics
from mlpair.prediction.crm.store import CrmStore, StoredDecision
from mlpair.prediction.drift import DriftMonitors
from mlpair.prediction.errors import CrmUnavailable, InvalidRequest, UnknownModel
from mlpair.prediction.inference_client import InferenceClient
from mlpair.prediction.policy import DecisionPolicy

logger = logging.getLogger(__name__)

MAX_ID_LENGTH = 128


@dataclass(frozen=True)
class PredictInput:
    """One Predict call in domain terms; attribute values are float, str, bool or None."""

    request_id: str
    entity_id: str
    attributes: Mapping[str, Any]
    model_name: str = ""


@dataclass(frozen=True)
class PredictionResult:
    """A recorded decision plus how it was served."""

    stored: StoredDecision
    from_cache: bool = False


class ConfigurationError(Exception):
    """Schema, policy and model repository disagree; the service must not start."""


@dataclass(frozen=True)
class ModelFamily:
    """What PredictionService needs for one model family, checked for consistency at start-up."""

    entry: ModelEntry
    assembler: FeatureAssembler
    policy: DecisionPolicy

    @property
    def name(self) -> str:
        return self.entry.manifest.model_name

    @classmethod
    def load(cls, name: str, config_dir: Path, model_repository: Path) -> ModelFamily:
        """Loads the schema and policy from ``config_dir/<name>/`` and the latest model entry.

        Raises:
            ConfigurationError: a file is missing or invalid, or the configured feature schema
                is not the one the model was trained on (the version triple would break).
        """
        try:
            schema = FeatureSchema.from_toml(config_dir / name / "feature-schema.toml")
            policy = DecisionPolicy.from_toml(config_dir / name / "policy.toml")
            entry = load_latest(model_repository, name)
        except (OSError, ValueError, ManifestError) as exc:
            raise ConfigurationError(f"model family {name!r}: {exc}") from exc
        trained_on = entry.preprocessing.feature_schema
        if schema != trained_on:
            raise ConfigurationError(
                f"model family {name!r}: configured feature schema {schema.version!r} differs from the one "
                f"model version {entry.manifest.model_version} was trained on ({trained_on.version!r}); "
                "retrain or deploy the matching schema")
        return cls(entry, FeatureAssembler(entry.preprocessing), policy)


class Predictor:
    """Decides for one request at a time; shared by all concurrent calls."""

    def __init__(self, families: Mapping[str, ModelFamily], default_model: str,
                 inference: InferenceClient, crm: CrmStore, *, drift: DriftMonitors | None = None) -> None:
        self.families = dict(families)
        self.default_model = default_model
        self.inference = inference
        self.crm = crm
        self.drift = drift or DriftMonitors({})

    async def predict(self, request: PredictInput) -> PredictionResult:
        """Decides and records one request; a retried ``request_id`` returns the recorded decision.

        Raises:
            InvalidRequest: bad ids or attribute values (all problems named together).
            UnknownModel: the named model family is not served here.
            InferenceUnavailable, InferenceContractError, InferenceFailed: from the inference hop.
            CrmUnavailable: the decision could not be recorded (and so is not returned).
        """
        started = time.perf_counter()
        family = self._family(request.model_name)
        code = "OK"
        try:
            result = await self._predict(family, request)
            s = result.stored  # one DEBUG (or sampled) line per decision, never INFO per RPC
            logs.log_decision(logger, decision=s.decision, reason_codes=s.reason_codes, from_cache=result.from_cache,
                              probability=s.probability, decision_id=s.decision_id, model_version=s.model_version)
            return result
        except ServiceError as exc:
            code = exc.code
            raise
        finally:
            metrics.REQUESTS.labels(family.name, code).inc()
            metrics.REQUEST_DURATION.labels(family.name).observe(time.perf_counter() - started)

    def _family(self, model_name: str) -> ModelFamily:
        family = self.families.get(model_name or self.default_model)
        if family is None:
            raise UnknownModel(f"model family {model_name!r} is not served here; served: "
                               f"{', '.join(sorted(self.families))}")
        return family

    async def _predict(self, family: ModelFamily, request: PredictInput) -> PredictionResult:
        _check_id("request_id", request.request_id)
        _check_id("entity_id", request.entity_id)
        try:
            row = family.assembler.assemble(request.attributes)
        except ConversionError as exc:
            raise InvalidRequest(f"attribute values cannot be converted: {exc}",
                                 metadata={"attributes": ",".join(sorted(exc.problems))}) from exc
        for guard in row.guards:
            metrics.FEATURE_GUARDS.labels(family.name, guard.feature, guard.action).inc()
        if row.unknown_attributes:
            metrics.UNKNOWN_ATTRIBUTES.labels(family.name).inc(len(row.unknown_attributes))

        replay = await self._recorded(family, request.request_id)
        if replay is not None:
            return PredictionResult(replay)

        manifest = family.entry.manifest
        t0 = time.perf_counter()
        logits, served_version = await self.inference.infer(
            family.name, manifest.model_version, manifest.versions.feature_schema_version, row.vector[None, :])
        metrics.INFERENCE_DURATION.labels(family.name).observe(time.perf_counter() - t0)
        probability = float(temperature_probability(logits, manifest.calibration.temperature, manifest.positive_index)[0])
        band = family.policy.decide(probability)
        self.drift.observe(family.name, row.vector, probability)
        reasons = (band.reason_code, *dict.fromkeys(g.reason_code for g in row.guards))
        decision = StoredDecision(
            decision_id="", request_id=request.request_id, entity_id=request.entity_id,
            model_name=family.name, model_version=served_version,
            feature_schema_version=manifest.versions.feature_schema_version,
            policy_version=family.policy.version, probability=probability, decision=band.decision,
            reason_codes=reasons,
        )
        t0 = time.perf_counter()
        try:
            stored = await self.crm.record(decision)
        except Exception as exc:
            metrics.CRM_WRITES.labels(family.name, "error").inc()
            logger.exception("CRM write failed for model %s", family.name)
            raise CrmUnavailable("the decision could not be recorded; retry with the same request_id") from exc
        metrics.CRM_WRITES.labels(family.name, "ok").inc()
        metrics.CRM_WRITE_DURATION.labels(family.name).observe(time.perf_counter() - t0)
        metrics.DECISIONS.labels(family.name, stored.decision).inc()
        return PredictionResult(stored)

    async def _recorded(self, family: ModelFamily, request_id: str) -> StoredDecision | None:
        try:
            found = await self.crm.find(request_id)
        except Exception as exc:
            logger.exception("CRM look-up failed for model %s", family.name)
            raise CrmUnavailable("the CRM is unavailable; retry with the same request_id") from exc
        if found is not None:
            metrics.IDEMPOTENT_REPLAYS.labels(family.name).inc()
        return found


def _check_id(field: str, value: str) -> None:
    if not value or not value.strip():
        raise InvalidRequest(f"{field} is required", metadata={"field": field})
    if len(value) > MAX_ID_LENGTH:
        raise InvalidRequest(f"{field} is longer than {MAX_ID_LENGTH} characters", metadata={"field": field})
