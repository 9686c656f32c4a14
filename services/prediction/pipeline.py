"""The transport-neutral core of PredictionService.

``Predictor.predict_batch`` (and ``predict``, a batch of one): per item, validation and
feature assembly with guards (the same code training used) → idempotency look-up → the rows
of all new items packed into InferenceService calls of at most ``max_inference_rows`` rows,
per model family and model version, with the version contract → calibration → decision
policy (with the ensemble spread) → explanation → CRM write. A bad item gets its own error
and never fails the others; results come back in request order. A retried request id
returns the recorded decision unchanged. With a shadow version, the same rows also go to it
in the background and the comparison is recorded as metrics, never served.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlpair.contracts.assembly import AssembledRow, ConversionError
from mlpair.errors import ServiceError
from mlpair.prediction import metrics
from mlpair.prediction.crm.store import CrmStore, StoredDecision
from mlpair.prediction.errors import CrmUnavailable, InvalidRequest, PredictionError, UnknownModel
from mlpair.prediction.explain import Explanation, explain, explanation_rows
from mlpair.prediction.families import ConfigurationError, ModelFamily, ModelVersion
from mlpair.prediction.inference_client import InferenceClient
from mlpair.prediction.shadow import ServedRow, ShadowComparison

__all__ = ["ConfigurationError", "ModelFamily", "PredictInput", "PredictionResult", "Predictor"]

logger = logging.getLogger(__name__)

MAX_ID_LENGTH = 128


@dataclass(frozen=True)
class PredictInput:
    """One Predict call (or BatchPredict item) in domain terms; values are float, str, bool or None."""

    request_id: str
    entity_id: str
    attributes: Mapping[str, Any]
    model_name: str = ""
    explain: bool = False


@dataclass(frozen=True)
class PredictionResult:
    """A recorded decision plus how it was served.

    ``spread``, ``calibration_method`` and ``explanation`` describe a fresh decision; a
    replayed one (retried request id) carries only what the CRM recorded.
    """

    stored: StoredDecision
    from_cache: bool = False
    spread: float = 0.0
    calibration_method: str = ""
    explanation: Explanation | None = None


class UnexpectedFailure(PredictionError):
    """An unexpected failure while deciding one item; the details are only in the log."""

    code = "INTERNAL"
    reason = "INTERNAL"


@dataclass(eq=False)
class _Item:
    """One item on its way through the batch."""

    index: int
    request: PredictInput
    family: ModelFamily
    row: AssembledRow
    rows: np.ndarray  # [1 or 1 + n_schema_features, n_features] float32 sent to inference
    probabilities: np.ndarray | None = None  # [n_members, len(rows)] calibrated
    primary_margin: float = 0.0  # first member's margin of the row itself (shadow comparison)
    model_version: str = ""
    error: ServiceError | None = None
    decision: str = ""


class Predictor:
    """Decides for many requests at once; shared by all concurrent calls."""

    def __init__(self, families: Mapping[str, ModelFamily], default_model: str,
                 inference: InferenceClient, crm: CrmStore, *, max_inference_rows: int = 1024,
                 max_batch_items: int = 1000, explain_top_k: int = 3) -> None:
        """Wires the served families to their clients.

        Raises:
            ConfigurationError: an explanation of some family would not fit in one inference call.
        """
        self.families = dict(families)
        self.default_model = default_model
        self.inference = inference
        self.crm = crm
        self.max_inference_rows = max_inference_rows
        self.max_batch_items = max_batch_items
        self.explain_top_k = explain_top_k
        self.shadows = ShadowComparison(self._infer, max_inference_rows)
        for family in self.families.values():
            if len(family.schema.features) + 1 > max_inference_rows:
                raise ConfigurationError(
                    f"model family {family.name!r}: an explanation needs {len(family.schema.features) + 1} rows "
                    f"in one inference call but max_inference_rows is {max_inference_rows}")

    async def predict(self, request: PredictInput) -> PredictionResult:
        """Decides and records one request; a retried ``request_id`` returns the recorded decision.

        Raises:
            InvalidRequest: bad ids or attribute values (all problems named together).
            UnknownModel: the named model family is not served here.
            InferenceUnavailable, InferenceContractError, InferenceFailed: from the inference hop.
            CrmUnavailable: the decision could not be recorded (and so is not returned).
        """
        started = time.perf_counter()
        [outcome] = await self._run([request])
        name = request.model_name or self.default_model
        metrics.REQUEST_DURATION.labels(name if name in self.families else "unknown").observe(time.perf_counter() - started)
        if isinstance(outcome, ServiceError):
            raise outcome
        return outcome

    async def predict_batch(self, requests: Sequence[PredictInput]) -> list[PredictionResult | PredictionError]:
        """Decides many requests; each result is a decision or that item's own error, in request order.

        Raises:
            InvalidRequest: more than ``max_batch_items`` items (nothing is decided).
        """
        if len(requests) > self.max_batch_items:
            raise InvalidRequest(f"a batch may carry at most {self.max_batch_items} items, got {len(requests)}",
                                 metadata={"max_batch_items": str(self.max_batch_items)})
        metrics.BATCH_ITEMS.observe(len(requests))
        return await self._run(requests)

    async def drain_background(self) -> None:
        """Waits for background shadow comparisons still running (call before closing clients)."""
        await self.shadows.drain()

    # -- the stages ------------------------------------------------------------------------

    async def _run(self, requests: Sequence[PredictInput]) -> list[PredictionResult | PredictionError]:
        outcomes: list[PredictionResult | PredictionError | None] = [None] * len(requests)
        items: list[_Item] = []
        seen: set[str] = set()
        for index, request in enumerate(requests):
            try:
                items.append(self._prepare(index, request, seen))
            except PredictionError as exc:
                outcomes[index] = exc

        fresh = []
        replays = await asyncio.gather(*(self._recorded(it.family, it.request.request_id) for it in items),
                                       return_exceptions=True)
        for it, replay in zip(items, replays):
            if isinstance(replay, BaseException):
                outcomes[it.index] = _as_item_error(replay)
            elif replay is not None:
                outcomes[it.index] = PredictionResult(replay)
            else:
                fresh.append(it)

        await self._score(fresh)
        decided = []
        for it in fresh:
            if it.error is not None:
                outcomes[it.index] = it.error
                continue
            try:
                decided.append((it, self._decide(it)))
            except Exception as exc:  # noqa: BLE001  (one item's failure must not fail the batch)
                outcomes[it.index] = _as_item_error(exc)
        stored = await asyncio.gather(*(self._record(it.family, d) for it, (d, _) in decided), return_exceptions=True)
        for (it, (_, result)), record in zip(decided, stored):
            if isinstance(record, BaseException):
                outcomes[it.index] = _as_item_error(record)
            else:
                outcomes[it.index] = PredictionResult(record, spread=result.spread,
                                                      calibration_method=result.calibration_method,
                                                      explanation=result.explanation)
                metrics.DECISIONS.labels(it.family.name, record.decision).inc()
        self._start_shadows([it for it, _ in decided])

        for request, outcome in zip(requests, outcomes):
            name = request.model_name or self.default_model
            label = name if name in self.families else "unknown"  # clients must not mint label values
            metrics.REQUESTS.labels(label, outcome.code if isinstance(outcome, ServiceError) else "OK").inc()
        return outcomes  # type: ignore[return-value]  # every slot is filled above

    def _prepare(self, index: int, request: PredictInput, seen: set[str]) -> _Item:
        """Validates ids, resolves the family and assembles the features (guards counted).

        Raises:
            InvalidRequest: bad or duplicated ids, or attribute values no rule converts.
            UnknownModel: the family is not served here.
        """
        family = self._family(request.model_name)
        _check_id("request_id", request.request_id)
        _check_id("entity_id", request.entity_id)
        if request.request_id in seen:
            raise InvalidRequest("request_id appears more than once in this batch",
                                 metadata={"field": "request_id"})
        seen.add(request.request_id)
        try:
            row = family.assembler.assemble(request.attributes)
        except ConversionError as exc:
            raise InvalidRequest(f"attribute values cannot be converted: {exc}",
                                 metadata={"attributes": ",".join(sorted(exc.problems))}) from exc
        for guard in row.guards:
            metrics.FEATURE_GUARDS.labels(family.name, guard.feature, guard.action).inc()
        if row.unknown_attributes:
            metrics.UNKNOWN_ATTRIBUTES.labels(family.name).inc(len(row.unknown_attributes))
        rows = explanation_rows(family.assembler, row.vector) if request.explain else row.vector[None, :]
        return _Item(index, request, family, row, rows)

    def _family(self, model_name: str) -> ModelFamily:
        family = self.families.get(model_name or self.default_model)
        if family is None:
            raise UnknownModel(f"model family {model_name!r} is not served here; served: "
                               f"{', '.join(sorted(self.families))}", metadata={"model": model_name[:64]})
        return family

    async def _score(self, items: list[_Item]) -> None:
        """Packs the items' rows per family into calls of at most ``max_inference_rows`` rows and
        fills each item's calibrated probabilities (or its error: that of its call)."""
        by_family: dict[str, list[_Item]] = {}
        for it in items:
            by_family.setdefault(it.family.name, []).append(it)
        calls = [self._score_chunk(self.families[name], chunk)
                 for name, family_items in by_family.items()
                 for chunk in pack(family_items, self.max_inference_rows)]
        await asyncio.gather(*calls)

    async def _score_chunk(self, family: ModelFamily, chunk: list[_Item]) -> None:
        matrix = np.concatenate([it.rows for it in chunk]) if len(chunk) > 1 else chunk[0].rows
        try:
            answers = await asyncio.gather(*(self._infer(family, m, matrix) for m in family.members))
            probabilities = np.stack([m.calibrator.probabilities(logits)
                                      for m, (logits, _) in zip(family.members, answers)])
            primary_margins = family.members[0].calibrator.margins(answers[0][0])
        except ServiceError as exc:
            for it in chunk:
                it.error = exc
            return
        except Exception as exc:  # noqa: BLE001  (one item's failure must not fail the batch)
            error = _as_item_error(exc)
            for it in chunk:
                it.error = error
            return
        version = "+".join(served for _, served in answers)
        offset = 0
        for it in chunk:
            n = len(it.rows)
            it.probabilities = probabilities[:, offset:offset + n]
            it.primary_margin = float(primary_margins[offset])
            it.model_version = version
            offset += n

    async def _infer(self, family: ModelFamily, model: ModelVersion, features: np.ndarray) -> tuple[np.ndarray, str]:
        """The one call site of InferenceService: ``[rows, n_features] float32`` (rows ≤
        ``max_inference_rows``) → logits ``[rows, n_classes]`` and the version that served them."""
        t0 = time.perf_counter()
        logits, served_version = await self.inference.infer(family.name, model.version, family.feature_version, features)
        metrics.INFERENCE_DURATION.labels(family.name).observe(time.perf_counter() - t0)
        metrics.INFERENCE_ROWS.labels(family.name).observe(len(features))
        return logits, served_version

    def _decide(self, it: _Item) -> tuple[StoredDecision, PredictionResult]:
        """Policy, reasons and explanation for a scored item (the CRM row and the extras to return)."""
        family = it.family
        members = it.probabilities[:, 0]
        probability = float(members.mean())
        spread = float(members.max() - members.min())
        verdict = family.policy.decide(probability, spread)
        if family.is_ensemble:
            metrics.ENSEMBLE_SPREAD.labels(family.name).observe(spread)
            if verdict.uncertain:
                metrics.UNCERTAIN_DECISIONS.labels(family.name).inc()
        explanation = None
        if it.request.explain:
            occluded = it.probabilities[:, 1:].mean(axis=0)
            explanation = explain(family.schema, probability, occluded, self.explain_top_k)
            metrics.EXPLANATIONS.labels(family.name).inc()
        it.decision = verdict.decision
        stored = StoredDecision(
            decision_id="", request_id=it.request.request_id, entity_id=it.request.entity_id,
            model_name=family.name, model_version=it.model_version, feature_schema_version=family.feature_version,
            policy_version=family.policy.version, probability=probability, decision=verdict.decision,
            reason_codes=(*verdict.reason_codes, *dict.fromkeys(g.reason_code for g in it.row.guards)),
        )
        methods = "+".join(dict.fromkeys(m.calibrator.method for m in family.members))
        return stored, PredictionResult(stored, spread=spread, calibration_method=methods, explanation=explanation)

    def _start_shadows(self, items: list[_Item]) -> None:
        by_family: dict[str, list[ServedRow]] = {}
        for it in items:
            by_family.setdefault(it.family.name, []).append(ServedRow(it.row.vector, it.primary_margin, it.decision))
        for name, rows in by_family.items():
            self.shadows.start(self.families[name], rows)

    async def _record(self, family: ModelFamily, decision: StoredDecision) -> StoredDecision:
        """The one CRM write site: records ``decision`` once per request id.

        Raises:
            CrmUnavailable: the write failed (the decision is not returned).
        """
        t0 = time.perf_counter()
        try:
            stored = await self.crm.record(decision)
        except Exception as exc:
            logger.exception("CRM write failed for model %s", family.name)
            raise CrmUnavailable("the decision could not be recorded; retry with the same request_id") from exc
        metrics.CRM_WRITE_DURATION.labels(family.name).observe(time.perf_counter() - t0)
        return stored

    async def _recorded(self, family: ModelFamily, request_id: str) -> StoredDecision | None:
        try:
            found = await self.crm.find(request_id)
        except Exception as exc:
            logger.exception("CRM look-up failed for model %s", family.name)
            raise CrmUnavailable("the CRM is unavailable; retry with the same request_id") from exc
        if found is not None:
            metrics.IDEMPOTENT_REPLAYS.labels(family.name).inc()
        return found


def pack(items: Sequence[_Item], max_rows: int) -> list[list[_Item]]:
    """Greedy, order-keeping packing of items into chunks of at most ``max_rows`` rows in total.

    An item's rows are never split across chunks (each item has at most ``max_rows`` rows).
    """
    chunks: list[list[_Item]] = []
    rows = 0
    for it in items:
        if not chunks or rows + len(it.rows) > max_rows:
            chunks.append([])
            rows = 0
        chunks[-1].append(it)
        rows += len(it.rows)
    return chunks


def _as_item_error(exc: BaseException) -> PredictionError:
    """An item's failure as a client-safe error; anything unexpected is logged and made generic."""
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    if isinstance(exc, PredictionError):
        return exc
    if isinstance(exc, ServiceError):
        return UnexpectedFailure(exc.message)
    logger.error("unexpected failure deciding one item", exc_info=exc)
    return UnexpectedFailure("internal error")


def _check_id(field: str, value: str) -> None:
    if not value or not value.strip():
        raise InvalidRequest(f"{field} is required", metadata={"field": field})
    if len(value) > MAX_ID_LENGTH:
        raise InvalidRequest(f"{field} is longer than {MAX_ID_LENGTH} characters", metadata={"field": field})
