"""The transport-neutral core of PredictionService.

``Predictor.predict_batch`` (and ``predict``, a batch of one): per item, validation and
feature assembly with guards (the same code training used) → the rows of all items packed
into InferenceService calls of at most ``max_inference_rows`` rows, per model family and
model version, through the cache, single-flight, the caller's deadline budget, retries and
the circuit breaker (``cache``, ``resilience``) → calibration → decision policy (with the
ensemble spread) → explanation → durable record in the decision ledger, delivered to the CRM by the
relay (``crm``). A bad item gets its own error and never fails the others; results come
back in request order. A decision is recorded in the decision ledger every replica shares
before it is returned: a request id already on record (by any replica, at any time) returns
the recorded decision unchanged, marked ``replayed``, and one sent with another payload is
refused (``IDEMPOTENCY_KEY_REUSED``). With a shadow version, the same rows also go to it in the
background and the comparison is recorded as metrics, never served.

When InferenceService cannot be used (unavailable, timed out, circuit open) a stale cached
result is served if one exists; otherwise the policy's fallback decision (REVIEW) is made
with reason code ``INFERENCE_UNAVAILABLE`` and no probability — never an automatic approval
or decline.

Every row is judged on its own: a row whose model output is unusable (a non-finite logit, or
a probability calibration cannot place in [0, 1]) gets the policy's fallback decision with
reason code ``MODEL_OUTPUT_INVALID``, recorded and counted like any decision, while every other
row of the same call — another item of the batch, or another caller's row merged into the same
Infer call — is decided exactly as if it had been sent alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from mlpair import logs
from mlpair.contracts.assembly import MISSING_DEFAULTED, SENTINEL_DEFAULTED, AssembledRow, ConversionError
from mlpair.errors import ServiceError
from mlpair.prediction import metrics
from mlpair.prediction.cache import CachedInference, Scored, Source
from mlpair.prediction.crm.recorder import DecisionRecorder
from mlpair.prediction.crm.store import StoredDecision, decision_id_for
from mlpair.prediction.drift import DriftMonitors
from mlpair.prediction.checks import (MAX_ECHO, RequestWarning, check_id, key_reused, unknown_attribute_warnings,
                                      unknown_attributes_error)
from mlpair.prediction.errors import InvalidRequest, PredictionError, UnknownModel
from mlpair.prediction.explain import Explanation, explain, explanation_rows
from mlpair.prediction.families import ConfigurationError, ModelFamily, ModelVersion
from mlpair.prediction.idempotency import request_fingerprint
from mlpair.prediction.shadow import ServedRow, ShadowComparison

__all__ = ["ConfigurationError", "ModelFamily", "PredictInput", "PredictionResult", "Predictor", "RequestWarning"]

logger = logging.getLogger(__name__)

FALLBACK_REASON = "INFERENCE_UNAVAILABLE"
INVALID_OUTPUT_REASON = "MODEL_OUTPUT_INVALID"  # reason code and degraded reason of a row with unusable output
DEFAULTED_ACTIONS = frozenset({MISSING_DEFAULTED, SENTINEL_DEFAULTED})  # the value was absent: a default stood in
STALE_REASON = "STALE_CACHE_RESULT"


@dataclass(frozen=True)
class PredictInput:
    """One Predict call (or BatchPredict item) in domain terms; values are float, str, bool or None."""

    request_id: str
    entity_id: str
    attributes: Mapping[str, Any]
    model_name: str = ""
    explain: bool = False
    deadline: float | None = None  # the caller's deadline in time.monotonic() seconds; None = none


@dataclass(frozen=True)
class PredictionResult:
    """A recorded decision plus how it was served.

    ``spread``, ``calibration_method`` and ``explanation`` describe a fresh decision; a
    replayed one (a request id already on record, by any replica) carries only what was recorded.
    """

    stored: StoredDecision
    from_cache: bool = False
    spread: float = 0.0
    calibration_method: str = ""
    explanation: Explanation | None = None
    replayed: bool = False  # the request id was already on record: this is that decision
    warnings: tuple[RequestWarning, ...] = ()  # about this request (not recorded: a replay computes its own)


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
    fingerprint: str  # the canonical request's SHA-256 (idempotency.request_fingerprint)
    warnings: tuple[RequestWarning, ...] = ()
    probabilities: np.ndarray | None = None  # [n_members, 1 or len(rows)] calibrated
    primary_margin: float = 0.0  # first member's margin of the row itself (shadow comparison)
    model_version: str = ""
    served: Scored | None = None  # how the item's own row was scored (source, age, degraded reason)
    invalid_output: bool = False  # the model's output for the item's own row is unusable
    error: ServiceError | None = None
    decision: str = ""

    @property
    def fallback(self) -> bool:
        """No model output for the item's own row: the policy's fallback decides."""
        return self.served is not None and self.served.source is Source.FALLBACK

    @property
    def without_model(self) -> bool:
        """The policy's fallback decides: no model output, or none usable, for the item's own row."""
        return self.invalid_output or self.fallback


class Predictor:
    """Decides for many requests at once; shared by all concurrent calls."""

    def __init__(self, families: Mapping[str, ModelFamily], default_model: str,
                 scorer: CachedInference, recorder: DecisionRecorder, *, max_inference_rows: int = 1024,
                 max_batch_items: int = 1000, explain_top_k: int = 3, drift: DriftMonitors | None = None,
                 unknown_attributes: str = "warn") -> None:
        """Wires the served families to inference (behind its cache) and the decision recorder.

        ``unknown_attributes``: ``warn`` decides a request with attributes the schema does not know
        and names each in the result's warnings; ``refuse`` refuses it (:class:`UnknownAttribute`).

        Raises:
            ConfigurationError: an explanation of some family would not fit in one inference call.
        """
        self.families = dict(families)
        self.default_model = default_model
        self.scorer = scorer
        self.recorder = recorder
        self.inference = scorer.client
        self.crm = recorder.crm
        self.max_inference_rows = max_inference_rows
        self.max_batch_items = max_batch_items
        self.explain_top_k = explain_top_k
        self.refuse_unknown_attributes = unknown_attributes == "refuse"
        self.drift = drift or DriftMonitors({})
        self.shadows = ShadowComparison(self._infer_shadow, max_inference_rows)
        for family in self.families.values():
            if len(family.schema.features) + 1 > max_inference_rows:
                raise ConfigurationError(
                    f"model family {family.name!r}: an explanation needs {len(family.schema.features) + 1} rows "
                    f"in one inference call but max_inference_rows is {max_inference_rows}")

    async def predict(self, request: PredictInput) -> PredictionResult:
        """Decides and records one request; a ``request_id`` already on record returns the
        recorded decision (``replayed``).

        Raises:
            InvalidRequest: bad ids or attribute values (all problems named together).
            UnknownModel: the named model family is not served here.
            IdempotencyKeyReused: the request id is on record for another payload.
            InferenceContractError, InferenceFailed: InferenceService refused or failed; no decision.
            LedgerUnavailable: the decision could not be recorded (and so is not returned).
        """
        started = time.perf_counter()
        [outcome] = await self._run([request])
        name = request.model_name or self.default_model
        metrics.labelled(metrics.REQUEST_DURATION, name if name in self.families else "unknown").observe(time.perf_counter() - started)
        if isinstance(outcome, ServiceError):
            raise outcome
        s = outcome.stored  # one DEBUG (or sampled) line per decision, never INFO per RPC; it never raises
        logs.log_decision(logger, decision=s.decision, reason_codes=s.reason_codes, from_cache=outcome.from_cache,
                          probability=s.probability, decision_id=s.decision_id, model_version=s.model_version,
                          replayed=outcome.replayed)
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

        await self._score(items)
        decided: list[tuple[_Item, PredictionResult]] = []
        decided_at = datetime.now(timezone.utc)
        for it in items:
            if it.error is not None:
                outcomes[it.index] = it.error
                continue
            try:
                decided.append((it, self._fallback(it, decided_at) if it.without_model else self._decide(it, decided_at)))
            except Exception as exc:  # noqa: BLE001  (one item's failure must not fail the batch)
                outcomes[it.index] = _as_item_error(exc)
        recorded = await self._record(decided) if decided else []
        served = []
        decisions: Counter[tuple[str, str]] = Counter()  # counted once per batch, not per item
        for (it, result), record in zip(decided, recorded):
            if isinstance(record, BaseException):
                outcomes[it.index] = _as_item_error(record)
                continue
            if it.warnings:
                result = dataclasses.replace(result, warnings=it.warnings)
            stored = record.decision
            if record.replayed:  # on record already: return that, not what was just computed
                if record.fingerprint and record.fingerprint != it.fingerprint:
                    metrics.labelled(metrics.IDEMPOTENCY_KEY_REUSED, it.family.name).inc()
                    outcomes[it.index] = key_reused(it.request.request_id)
                    continue
                metrics.labelled(metrics.IDEMPOTENT_REPLAYS, it.family.name).inc()
                from_cache = stored.served_from in (Source.CACHE.value, Source.STALE_CACHE.value)
                outcomes[it.index] = PredictionResult(stored, from_cache=from_cache, replayed=True, warnings=it.warnings)
            else:
                outcomes[it.index] = result if stored is result.stored else dataclasses.replace(result, stored=stored)
                if it.invalid_output:
                    metrics.labelled(metrics.MODEL_OUTPUT_INVALID, it.family.name).inc()
                    metrics.FALLBACKS.labels(it.family.name, INVALID_OUTPUT_REASON).inc()
                elif it.fallback:
                    metrics.FALLBACKS.labels(it.family.name, it.served.degraded_reason).inc()
                else:
                    self.drift.observe(it.family.name, it.row.vector, stored.probability)
                    served.append(it)
            decisions[it.family.name, stored.decision] += 1
        for labels, n in decisions.items():
            metrics.labelled(metrics.DECISIONS, *labels).inc(n)
        self._start_shadows(served)

        requests_by_outcome: Counter[tuple[str, str]] = Counter()
        for request, outcome in zip(requests, outcomes):
            name = request.model_name or self.default_model
            label = name if name in self.families else "unknown"  # clients must not mint label values
            requests_by_outcome[label, outcome.code if isinstance(outcome, ServiceError) else "OK"] += 1
        for labels, n in requests_by_outcome.items():
            metrics.labelled(metrics.REQUESTS, *labels).inc(n)
        return outcomes  # type: ignore[return-value]  # every slot is filled above

    def _prepare(self, index: int, request: PredictInput, seen: set[str]) -> _Item:
        """Validates ids, resolves the family and assembles the features (guards counted).

        Raises:
            InvalidRequest: bad or duplicated ids, or attribute values no rule converts.
            UnknownModel: the family is not served here.
        """
        family = self._family(request.model_name)
        check_id("request_id", request.request_id)
        check_id("entity_id", request.entity_id)
        if request.request_id in seen:
            raise InvalidRequest("request_id appears more than once in this batch",
                                 metadata={"field": "request_id"})
        seen.add(request.request_id)
        try:
            row = family.assembler.assemble(request.attributes)
        except ConversionError as exc:
            raise InvalidRequest(f"attribute values cannot be converted: {exc}",
                                 metadata={"attributes": ",".join(sorted(exc.problems))}) from exc
        warnings = ()
        if row.unknown_attributes:
            metrics.UNKNOWN_ATTRIBUTES.labels(family.name).inc(len(row.unknown_attributes))
            if self.refuse_unknown_attributes:
                raise unknown_attributes_error(family, row.unknown_attributes)
            warnings = unknown_attribute_warnings(family, row.unknown_attributes)
        for guard in row.guards:
            metrics.labelled(metrics.FEATURE_GUARDS, family.name, guard.feature, guard.action).inc()
        rows = explanation_rows(family.assembler, row.vector) if request.explain else row.vector[None, :]
        return _Item(index, request, family, row, rows,
                     request_fingerprint(family.name, request.entity_id, request.attributes), warnings)

    def _family(self, model_name: str) -> ModelFamily:
        family = self.families.get(model_name or self.default_model)
        if family is None:  # the name is echoed cut short: an error never carries a client's huge input back
            shown = repr(model_name[:MAX_ECHO]) + ("…" if len(model_name) > MAX_ECHO else "")
            raise UnknownModel(f"model family {shown} is not served here; served: "
                               f"{', '.join(sorted(self.families))}", metadata={"model": model_name[:MAX_ECHO]})
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
        await _all(calls)

    async def _score_chunk(self, family: ModelFamily, chunk: list[_Item]) -> None:
        matrix = np.concatenate([it.rows for it in chunk]) if len(chunk) > 1 else chunk[0].rows
        deadlines = [it.request.deadline for it in chunk if it.request.deadline is not None]
        deadline = min(deadlines) if deadlines else None
        try:
            answers = await _all([self._infer(family, m, matrix, deadline) for m in family.members])
            stacked = [_stack(rows, len(m.entry.manifest.class_names)) for m, rows in zip(family.members, answers)]
            calibrated = [m.calibrator.probabilities_per_row(z) for m, z in zip(family.members, stacked)]
            probabilities = np.stack([p for p, _ in calibrated])
            usable = np.logical_and.reduce([ok for _, ok in calibrated])  # every member's output usable
            # margins only feed the shadow comparison (unusable rows: zeros, never compared)
            primary_margins = family.members[0].calibrator.margins(
                np.where(usable[:, None], stacked[0], np.float32(0.0))) if family.shadow else None
        except ServiceError as exc:
            for it in chunk:
                it.error = exc
            return
        except Exception as exc:  # noqa: BLE001  (one item's failure must not fail the batch)
            error = _as_item_error(exc)
            for it in chunk:
                it.error = error
            return
        offset = 0
        for it in chunk:
            n = len(it.rows)
            own = [rows[offset] for rows in answers]  # each member's result for the item's own row
            it.served = _served(own)
            if it.fallback:
                pass
            elif not usable[offset]:
                it.invalid_output = True  # this row alone: the other rows of the call are untouched
            else:
                # an explanation needs every occluded row scored; otherwise decide without one
                complete = n == 1 or bool(usable[offset:offset + n].all())
                it.probabilities = probabilities[:, offset:offset + (n if complete else 1)]
                it.primary_margin = 0.0 if primary_margins is None else float(primary_margins[offset])
                it.model_version = own[0].model_version if len(own) == 1 else "+".join(r.model_version for r in own)
            offset += n

    async def _infer(self, family: ModelFamily, model: ModelVersion, features: np.ndarray,
                     deadline: float | None) -> list[Scored]:
        """The one call site of InferenceService for decisions: ``[rows, n_features] float32``
        (rows ≤ ``max_inference_rows``) → one :class:`Scored` per row, through the cache,
        single-flight, deadline budget, retries and circuit breaker (:class:`CachedInference`)."""
        metrics.labelled(metrics.INFERENCE_ROWS, family.name).observe(len(features))
        return await self.scorer.score(family.name, model.version, family.feature_version, features, deadline,
                                       n_classes=len(model.entry.manifest.class_names))

    async def _infer_shadow(self, family: ModelFamily, model: ModelVersion, features: np.ndarray) -> tuple[np.ndarray, str]:
        """Shadow calls go straight to InferenceService: never cached, never served."""
        return await self.inference.infer(family.name, model.version, family.feature_version, features)

    def _decide(self, it: _Item, decided_at: datetime) -> PredictionResult:
        """Policy, reasons and explanation for a scored item (the record and the extras to return)."""
        family = it.family
        if family.is_ensemble:
            members = it.probabilities[:, 0]
            probability, spread = float(members.mean()), float(members.max() - members.min())
        else:
            probability, spread = float(it.probabilities[0, 0]), 0.0
        defaulted = {g.feature for g in it.row.guards if g.action in DEFAULTED_ACTIONS}
        verdict = family.policy.decide(probability, spread, len(defaulted) / family.n_schema_features)
        if family.is_ensemble:
            metrics.ENSEMBLE_SPREAD.labels(family.name).observe(spread)
            if verdict.uncertain:
                metrics.UNCERTAIN_DECISIONS.labels(family.name).inc()
        explanation = None
        if it.request.explain and it.probabilities.shape[1] > 1:
            occluded = it.probabilities[:, 1:].mean(axis=0)
            explanation = explain(family.schema, probability, occluded, self.explain_top_k)
            metrics.EXPLANATIONS.labels(family.name).inc()
        it.decision = verdict.decision
        served = it.served
        stale = (STALE_REASON,) if served.source is Source.STALE_CACHE else ()
        stored = StoredDecision(
            decision_id=decision_id_for(it.request.request_id), request_id=it.request.request_id,
            entity_id=it.request.entity_id, decided_at=decided_at,
            model_name=family.name, model_version=it.model_version, feature_schema_version=family.feature_version,
            policy_version=family.policy.version, probability=probability, decision=verdict.decision,
            reason_codes=(*verdict.reason_codes, *stale, *dict.fromkeys(g.reason_code for g in it.row.guards)),
            served_from=served.source.value, cache_age_ms=served.age_ms, degraded_reason=served.degraded_reason,
        )
        return PredictionResult(stored, from_cache=served.source in (Source.CACHE, Source.STALE_CACHE), spread=spread,
                                calibration_method=family.calibration_method, explanation=explanation)

    @staticmethod
    def _fallback(it: _Item, decided_at: datetime) -> PredictionResult:
        """The documented decision without usable model output: the policy's fallback (REVIEW)
        and no probability, with reason ``INFERENCE_UNAVAILABLE`` (inference could not be used)
        or ``MODEL_OUTPUT_INVALID`` (the model's output for this row is unusable)."""
        family = it.family
        it.decision = family.policy.fallback_decision
        reason = INVALID_OUTPUT_REASON if it.invalid_output else FALLBACK_REASON
        stored = StoredDecision(
            decision_id=decision_id_for(it.request.request_id), request_id=it.request.request_id,
            entity_id=it.request.entity_id, decided_at=decided_at,
            model_name=family.name, model_version="", feature_schema_version=family.feature_version,
            policy_version=family.policy.version, probability=None, decision=family.policy.fallback_decision,
            reason_codes=(reason, *dict.fromkeys(g.reason_code for g in it.row.guards)),
            served_from=Source.FALLBACK.value,
            degraded_reason=INVALID_OUTPUT_REASON if it.invalid_output else it.served.degraded_reason,
        )
        return PredictionResult(stored)

    def _start_shadows(self, items: list[_Item]) -> None:
        by_family: dict[str, list[ServedRow]] = {}
        for it in items:
            if it.family.shadow is not None:
                by_family.setdefault(it.family.name, []).append(ServedRow(it.row.vector, it.primary_margin, it.decision))
        for name, rows in by_family.items():
            self.shadows.start(self.families[name], rows)

    async def _record(self, decided: list[tuple[_Item, PredictionResult]]) -> list:
        """The one write site: commits the decisions to the shared decision ledger (in one group
        commit when they fit) before any is returned; a request id already on record gets the
        decision recorded first (``Recorded.replayed``, with the recorded request's fingerprint).
        Each outcome is a ``Recorded`` or the ``LedgerUnavailable`` that kept that decision from
        the record (it is then not returned)."""
        return await self.recorder.record_many([result.stored for _, result in decided],
                                               [it.fingerprint for it, _ in decided])


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


async def _all(calls: list) -> list:
    """``asyncio.gather`` without its task per call when there is only one (a single Predict)."""
    if len(calls) == 1:
        return [await calls[0]]
    return await asyncio.gather(*calls)


def _stack(rows: list[Scored], n_classes: int) -> np.ndarray:
    """Per-row results → logits ``[rows, n_classes]``. A row without logits (fallback), or
    whose logits are not ``[n_classes]``, is NaN: the per-row calibration marks it unusable, and
    it can fail no other row."""
    logits = np.full((len(rows), n_classes), np.nan, dtype=np.float32)
    for i, r in enumerate(rows):
        if r.logits is not None and r.logits.shape == (n_classes,):
            logits[i] = r.logits
    return logits


def _served(own: list[Scored]) -> Scored:
    """How an item's own row was scored across ensemble members: fallback if any member has no
    output, stale if any member's is stale, from cache only if all are, else fresh inference."""
    if len(own) == 1:  # one member: each rule above picks its result
        return own[0]
    for source in (Source.FALLBACK, Source.STALE_CACHE):
        if found := next((r for r in own if r.source is source), None):
            return found
    return own[0] if all(r.source is Source.CACHE for r in own) else next(r for r in own if r.source is Source.INFERENCE)


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
