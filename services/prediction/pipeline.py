"""The transport-neutral core of PredictionService.

``Predictor.predict``: feature assembly and guards (the same code training used) → cached,
single-flight inference within the caller's deadline budget (``cache``, ``resilience``) →
temperature calibration → decision policy → durable record in the outbox, delivered to the
CRM by the relay (``crm``). A retried request id returns the recorded decision unchanged.

When InferenceService cannot be used (unavailable, timed out, circuit open) a stale cached
result is served if one exists; otherwise the documented fallback decides: REVIEW with reason
code ``INFERENCE_UNAVAILABLE`` and no probability — never an automatic approval or decline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlpair.contracts.assembly import ConversionError, FeatureAssembler
from mlpair.contracts.calibration import temperature_probability
from mlpair.contracts.manifest import ManifestError, ModelEntry, load_latest
from mlpair.contracts.schema import FeatureSchema
from mlpair.errors import ServiceError
from mlpair.prediction import metrics
from mlpair.prediction.cache import CachedInference, Scored, Source
from mlpair.prediction.crm.recorder import DecisionRecorder
from mlpair.prediction.crm.store import StoredDecision
from mlpair.prediction.errors import InvalidRequest, UnknownModel
from mlpair.prediction.policy import DecisionPolicy

logger = logging.getLogger(__name__)

MAX_ID_LENGTH = 128
FALLBACK_DECISION = "REVIEW"  # without model output a human decides: never an automatic approve/decline
FALLBACK_REASON = "INFERENCE_UNAVAILABLE"
STALE_REASON = "STALE_CACHE_RESULT"


@dataclass(frozen=True)
class PredictInput:
    """One Predict call in domain terms; attribute values are float, str, bool or None."""

    request_id: str
    entity_id: str
    attributes: Mapping[str, Any]
    model_name: str = ""
    deadline: float | None = None  # the caller's deadline in time.monotonic() seconds; None = none


@dataclass(frozen=True)
class PredictionResult:
    """A recorded decision plus how it was served."""

    stored: StoredDecision
    from_cache: bool = False
    replayed: bool = False  # the request id was already recorded: this is that decision


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
                 scorer: CachedInference, recorder: DecisionRecorder) -> None:
        self.families = dict(families)
        self.default_model = default_model
        self.scorer = scorer
        self.recorder = recorder
        self.inference = scorer.client
        self.crm = recorder.crm

    async def predict(self, request: PredictInput) -> PredictionResult:
        """Decides and records one request; a retried ``request_id`` returns the recorded decision.

        Raises:
            InvalidRequest: bad ids or attribute values (all problems named together).
            UnknownModel: the named model family is not served here.
            InferenceContractError, InferenceFailed: InferenceService refused or failed; no decision.
            OutboxUnavailable: the decision could not be recorded (and so is not returned).
        """
        started = time.perf_counter()
        family = self._family(request.model_name)
        code = "OK"
        try:
            return await self._predict(family, request)
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

        manifest = family.entry.manifest
        scored = (await self._score(family, row.vector[None, :], request.deadline))[0]
        guard_reasons = tuple(dict.fromkeys(g.reason_code for g in row.guards))
        if scored.logits is None:
            return await self._record(self._fallback(family, request, scored, guard_reasons))
        probability = float(temperature_probability(scored.logits[None, :], manifest.calibration.temperature,
                                                    manifest.positive_index)[0])
        band = family.policy.decide(probability)
        reasons = (band.reason_code, *((STALE_REASON,) if scored.source is Source.STALE_CACHE else ()), *guard_reasons)
        decision = StoredDecision(
            decision_id="", request_id=request.request_id, entity_id=request.entity_id,
            model_name=family.name, model_version=scored.model_version,
            feature_schema_version=manifest.versions.feature_schema_version,
            policy_version=family.policy.version, probability=probability, decision=band.decision,
            reason_codes=reasons, served_from=scored.source.value, cache_age_ms=scored.age_ms,
            degraded_reason=scored.degraded_reason,
        )
        return await self._record(decision)

    async def _score(self, family: ModelFamily, rows, deadline: float | None) -> list[Scored]:
        """Logits per row of ``rows`` ``[batch, n_features] float32`` through cache, single-flight,
        deadline budget, retries and circuit breaker (see :class:`CachedInference`)."""
        manifest = family.entry.manifest
        return await self.scorer.score(family.name, manifest.model_version,
                                       manifest.versions.feature_schema_version, rows, deadline)

    @staticmethod
    def _fallback(family: ModelFamily, request: PredictInput, scored: Scored,
                  guard_reasons: tuple[str, ...]) -> StoredDecision:
        """The documented decision without model output: REVIEW, reason INFERENCE_UNAVAILABLE."""
        metrics.FALLBACKS.labels(family.name, scored.degraded_reason).inc()
        return StoredDecision(
            decision_id="", request_id=request.request_id, entity_id=request.entity_id,
            model_name=family.name, model_version="",
            feature_schema_version=family.entry.manifest.versions.feature_schema_version,
            policy_version=family.policy.version, probability=None, decision=FALLBACK_DECISION,
            reason_codes=(FALLBACK_REASON, *guard_reasons), served_from=Source.FALLBACK.value,
            degraded_reason=scored.degraded_reason,
        )

    async def _record(self, decision: StoredDecision) -> PredictionResult:
        """Commits the decision to the outbox before it is returned; a retried request id gets the
        decision recorded first."""
        recorded = await self.recorder.record(decision)
        stored = recorded.decision
        metrics.DECISIONS.labels(stored.model_name, stored.decision).inc()
        return PredictionResult(stored, from_cache=stored.served_from in (Source.CACHE.value, Source.STALE_CACHE.value),
                                replayed=recorded.replayed)


def _check_id(field: str, value: str) -> None:
    if not value or not value.strip():
        raise InvalidRequest(f"{field} is required", metadata={"field": field})
    if len(value) > MAX_ID_LENGTH:
        raise InvalidRequest(f"{field} is longer than {MAX_ID_LENGTH} characters", metadata={"field": field})
