"""The transport-neutral core of PredictionService.

``Predictor.predict_batch`` (and ``predict``, a batch of one) runs the stages in request order, column
by column: ``intake`` admits the items, ``preparing`` assembles each family's rows with guards (the
arithmetic training used), ``scoring`` sends them in calls of at most ``max_inference_rows`` rows
through cache, single-flight, deadline budget, retries and circuit breaker and calibrates them,
``deciding`` applies the policy and explains, ``recording`` commits each decision with its audit
record to the ledger in one statement per call (the relay delivers it to the CRM). A bad item gets
its own error and never fails the others; results come back in request order. A decision is
recorded before it is returned: a request id already on record (by any replica, at any time) returns
the recorded decision, marked ``replayed``; one sent with another payload is refused
(``IDEMPOTENCY_KEY_REUSED``). A shadow version scores the same rows in the background, compared in
metrics, never served.

When InferenceService cannot be used (unavailable, timed out, circuit open) a stale cached
result is served if one exists; otherwise the policy's fallback decision (REVIEW) is made
with reason code ``INFERENCE_UNAVAILABLE`` and no probability — never an automatic approval
or decline.

Every row is judged on its own: a row whose model output is unusable (a non-finite logit, or a
probability calibration cannot place in [0, 1]) gets the fallback decision with ``MODEL_OUTPUT_INVALID``,
recorded and counted like any decision; every other row of the call is decided as if sent alone.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import numpy as np

from mlpair import logs
from mlpair.contracts.columns import ColumnAssembler
from mlpair.errors import ServiceError
from mlpair.prediction import metrics
from mlpair.prediction.deciding.decisions import (
    FALLBACK_REASON,
    INVALID_OUTPUT_REASON,
    STALE_REASON,
    Decided,
    decide,
)
from mlpair.prediction.deciding.replays import recorded_maps, replayed
from mlpair.prediction.errors import InvalidRequest, PredictionError, UnknownModel
from mlpair.prediction.families import ConfigurationError, ModelFamily, ModelVersion
from mlpair.prediction.intake.checks import MAX_ECHO, admit
from mlpair.prediction.intake.merging import MergedCall, PredictMerger
from mlpair.prediction.intake.tables import Chunk
from mlpair.prediction.monitoring.drift import DriftMonitors
from mlpair.prediction.monitoring.shadow import ServedRow, ShadowComparison
from mlpair.prediction.outcomes import Outcomes, PredictInput, PredictionResult, RequestWarning, Slot
from mlpair.prediction.preparing.batch import Group, prepare, rows_of
from mlpair.prediction.records import DecisionColumns
from mlpair.prediction.scoring.cache import CachedInference
from mlpair.prediction.scoring.coalescer import Infers
from mlpair.prediction.scoring.rows import ScoredRows
from mlpair.prediction.scoring.scorer import Infer, UnexpectedFailure, as_item_error, score_groups

__all__ = [
    "ConfigurationError",
    "FALLBACK_REASON",
    "INVALID_OUTPUT_REASON",
    "ModelFamily",
    "PredictInput",
    "PredictionResult",
    "Predictor",
    "RequestWarning",
    "STALE_REASON",
    "UnexpectedFailure",
]

if TYPE_CHECKING:  # the ledger's engines bring SQLAlchemy: the pipeline only calls the one it is given
    from mlpair.prediction.recording.audit import AuditRecords
    from mlpair.prediction.recording.ledger import DecisionLedger

logger = logging.getLogger(__name__)
_MODEL_NAME = operator.attrgetter("model_name")


class Predictor:
    """Decides for many requests at once; shared by all concurrent calls."""

    def __init__(
        self,
        families: Mapping[str, ModelFamily],
        default_model: str,
        scorer: CachedInference,
        ledger: DecisionLedger,
        inference: Infers,
        *,
        max_inference_rows: int = 1024,
        max_batch_items: int = 1000,
        merge_max_calls: int = 64,
        merge_max_delay_s: float = 0.005,
        merge_deadline_window_s: float = 0.01,
        merge_scoring_bound_s: float = 8.0,
        merge_wait_from_calls: int = 4,
        explain_top_k: int = 3,
        drift: DriftMonitors | None = None,
        unknown_attributes: str = "warn",
        audit: AuditRecords | None = None,
    ) -> None:
        """Wires the served families to inference (``scorer``: behind its cache; ``inference``: the
        client itself, for shadow calls, never cached nor served) and the decision ledger.

        ``merge_*``: concurrent Predict calls decided together (:class:`~mlpair.prediction.intake.merging.PredictMerger`; 1 decides each alone).
        ``unknown_attributes``: ``warn`` decides a request with attributes the schema does not know
        and names each in the result's warnings; ``refuse`` refuses it (:class:`UnknownAttribute`).
        ``audit``: builds each decision's audit record, committed with it (None: none kept).

        Raises:
            ConfigurationError: an explanation of some family would not fit in one inference call.
        """
        self.families = dict(families)
        self.default_model = default_model
        self.scorer = scorer
        self.ledger = ledger
        self.inference = inference
        self.max_inference_rows = max_inference_rows
        self.max_batch_items = max_batch_items
        self.explain_top_k = explain_top_k
        self.refuse_unknown_attributes, self.audit = unknown_attributes == "refuse", audit
        self.drift = drift or DriftMonitors({})
        self.shadows = ShadowComparison(self._infer_shadow, max_inference_rows)
        self.merger = PredictMerger(
            self._run,
            min(merge_max_calls, max_batch_items),
            merge_max_delay_s,
            merge_deadline_window_s,
            merge_scoring_bound_s,
            merge_wait_from_calls,
        )
        self._columns = {name: ColumnAssembler(f.assembler) for name, f in self.families.items()}
        self._verdicts: dict[str, dict] = {name: {} for name in self.families}  # (verdict, stale, guards) → record
        for family in self.families.values():
            if len(family.schema.features) + 1 > max_inference_rows:
                raise ConfigurationError(
                    f"model family {family.name!r}: an explanation needs {len(family.schema.features) + 1} rows "
                    f"in one inference call but max_inference_rows is {max_inference_rows}"
                )

    async def predict(self, request: PredictInput) -> PredictionResult:
        """Decides and records one request; a ``request_id`` already on record returns the
        recorded decision (``replayed``). Under load it is decided together with concurrent calls,
        as one batch (:class:`~mlpair.prediction.intake.merging.PredictMerger`), with the same outcome.

        Raises:
            InvalidRequest: bad ids or attribute values (all problems named together).
            UnknownModel: the named model family is not served here.
            IdempotencyKeyReused: the request id is on record for another payload.
            InferenceContractError, InferenceFailed: InferenceService refused or failed; no decision.
            LedgerUnavailable: the decision could not be recorded (and so is not returned).
        """
        started = time.perf_counter()
        if request.explain or self.merger.max_calls <= 1:  # an explanation's occlusions: a batch of its own
            [outcome] = await self._run([request])
        else:
            outcome = await self.merger.decide(request)
        name = request.model_name or self.default_model
        metrics.labelled(metrics.REQUEST_DURATION, name if name in self.families else "unknown").observe(
            time.perf_counter() - started
        )
        if isinstance(outcome, ServiceError):
            raise outcome
        s = outcome.stored  # one DEBUG (or sampled) line per decision, never INFO per RPC; it never raises
        logs.log_decision(
            logger,
            decision=s.decision,
            reason_codes=s.reason_codes,
            from_cache=outcome.from_cache,
            probability=s.probability,
            decision_id=s.decision_id,
            model_version=s.model_version,
            replayed=outcome.replayed,
            caller=request.caller,
        )
        return outcome

    async def predict_batch(self, requests: Sequence[PredictInput]) -> Outcomes:
        """Decides many requests; each result is a :class:`PredictionResult` or that item's own
        :class:`PredictionError`, in request order (an :class:`Outcomes` sequence).

        Raises:
            InvalidRequest: more than ``max_batch_items`` items (nothing is decided).
        """
        if len(requests) > self.max_batch_items:
            raise InvalidRequest(
                f"a batch may carry at most {self.max_batch_items} items, got {len(requests)}",
                metadata={"max_batch_items": str(self.max_batch_items)},
            )
        metrics.BATCH_ITEMS.observe(len(requests))
        return await self._run(requests)

    async def decide_table(self, model_name: str, chunk: Chunk, deadline: float | None = None, caller="") -> Outcomes:
        """Decides a table's chunk of one family (PredictColumns) for ``caller``: every row as the
        same values sent as a Predict would be, each with its own outcome, in row order (an :class:`Outcomes`).

        Raises:
            UnknownModel: ``model_name`` is not served here (nothing is decided).
        """
        family = self._family(model_name)
        name = family.name
        metrics.CHUNK_ROWS.observe(len(chunk))
        requests = [
            PredictInput(rid, eid, chunk.row(k), name, False, deadline, caller)
            for k, (rid, eid) in enumerate(zip(chunk.request_ids, chunk.entity_ids))
        ]
        assembler = self._columns[name]
        slots: list[Slot] = [None] * len(requests)
        for k, error in chunk.refusals(assembler.attribute_names).items():
            slots[k] = error
        admitted = admit(requests, lambda _: family, slots).get(name, (family, []))[1]
        index = [i for i in admitted if slots[i] is None]  # admitted, and not refused by the chunk
        table = chunk.attribute_columns(assembler.attribute_names)
        if len(index) < len(requests):
            table = rows_of(table, index)
        group = prepare(family, assembler, requests, index, self.refuse_unknown_attributes, slots, table)
        return await self._run(requests, prepared=([group] if group else [], slots), infer=self._infer_bulk)

    async def drain_background(self) -> None:
        """Waits for merged Predict batches and background shadow comparisons still running
        (call before closing clients)."""
        await self.merger.drain()
        await self.shadows.drain()

    # -- the stages ------------------------------------------------------------------------

    async def _run(
        self,
        requests: Sequence[PredictInput],
        callers: Sequence[MergedCall] | None = None,
        prepared: tuple[list[Group], list[Slot]] | None = None,
        infer: Infer | None = None,
    ) -> Outcomes:
        """Decides ``requests`` as one batch, stage after stage: admit, prepare, score (through
        ``infer``, by default :meth:`_infer`), decide, record (:meth:`_record`), then count.
        ``callers``: each item's caller when they are separate Predicts decided together
        (:class:`PredictMerger`): each item is then scored in its caller's context, and one whose
        caller has left is neither decided, recorded nor counted. ``prepared``: the groups already
        prepared (a table's chunk) with the slots holding the errors of the items refused so far."""
        if prepared is None:
            slots: list[Slot] = [None] * len(requests)
            groups = [
                group
                for family, index in admit(requests, self._family, slots).values()
                if (
                    group := prepare(
                        family, self._columns[family.name], requests, index, self.refuse_unknown_attributes, slots
                    )
                )
            ]
        else:
            groups, slots = prepared
        every_scores = await score_groups(groups, infer or self._infer, self.max_inference_rows, callers)
        decided_at = datetime.now(UTC)
        decided: list[Decided] = []
        for group, scores in zip(groups, every_scores):
            try:
                d = decide(group, scores, decided_at, self.explain_top_k, self._verdicts[group.family.name])
            except Exception as exc:  # noqa: BLE001  (one family's failure must not fail the batch)
                error = as_item_error(exc)
                for index in group.index:
                    slots[index] = error
                continue
            for k, row_error in d.errors.items():
                slots[group.index[k]] = (
                    row_error if isinstance(row_error, PredictionError) else as_item_error(row_error)
                )
            if d.rows:
                decided.append(d)
        if decided:
            await self._record(decided, slots)
        by_outcome: Counter[tuple[str, str]]
        if callers is None and list(map(type, slots)).count(tuple) == len(slots):  # every item decided
            by_outcome = Counter(zip(map(_MODEL_NAME, requests), itertools.repeat("OK")))
        else:
            pairs: Iterable[tuple[PredictInput, Slot]] = zip(requests, slots)
            if callers is not None:  # a caller gone is as a call cancelled alone: not counted
                pairs = ((r, s) for (r, s), c in zip(pairs, callers) if not c.gone)
            by_outcome = Counter((r.model_name, s.code if isinstance(s, ServiceError) else "OK") for r, s in pairs)
        for (name, code), n in by_outcome.items():  # the names as sent, each resolved once
            name = name or self.default_model
            label = name if name in self.families else "unknown"  # clients must not mint label values
            metrics.labelled(metrics.REQUESTS, label, code).inc(n)
        return Outcomes(slots)

    async def _record(self, decided: list[Decided], slots: list[Slot]) -> None:
        """The one write site: commits every decision of the call to the shared decision ledger (one
        bulk statement when they fit) before any is returned. A request id already on record gets
        the decision recorded first (``replayed``), or ``IDEMPOTENCY_KEY_REUSED`` when it was
        recorded for another payload; a decision kept from the record by ``LedgerUnavailable`` is
        not returned. Then the per-call metrics, drift and shadow comparisons of what was decided."""
        batch = DecisionColumns.concat([d.columns for d in decided])
        if self.audit is not None:  # what each decision was based on, committed with it
            batch.audit = [text for d in decided for text in self.audit.records(d)]
        recorded = await self.ledger.record_many(batch, batch.fingerprints)
        replays, failed = recorded_maps(recorded)
        decisions: Counter[tuple[str, str]] = Counter()
        fallbacks: Counter[tuple[str, str]] = Counter()
        offset = 0
        for d in decided:
            group, name = d.group, d.group.family.name
            labels = d.columns.decision
            recorded_now: Sequence[int] = range(len(d.rows))  # decided rows recorded by this call (usually all)
            if failed or replays:
                kept: list[int] = []
                for j, k in enumerate(d.rows):
                    i = offset + j
                    if i in failed:
                        slots[group.index[k]] = as_item_error(failed[i])
                    elif i in replays:
                        slots[group.index[k]] = replayed(replays[i], d, j, batch.fingerprints[i], decisions)
                    else:
                        kept.append(j)
                recorded_now = kept
            for j in recorded_now:
                slots[group.index[d.rows[j]]] = (d, j)
            counted = labels if len(recorded_now) == len(labels) else [labels[j] for j in recorded_now]
            for label, n in Counter(counted).items():
                decisions[name, label] += n
            fresh = list(recorded_now)  # decided rows with model output, returned as decided now
            if d.without_model:
                fresh = []
                for j in recorded_now:
                    if j in d.without_model:
                        fallbacks[name, d.without_model[j]] += 1
                    else:
                        fresh.append(j)
            offset += len(d.rows)
            if fresh:
                rows = [d.rows[j] for j in fresh]
                probabilities = group_probabilities(d, fresh)
                self.drift.observe_many(name, group.vectors[rows], probabilities)
                if group.family.shadow is not None:
                    band = group.family.policy.band  # the primary's band, before missing-data or uncertainty reviews
                    self.shadows.start(
                        group.family,
                        [
                            ServedRow(group.vectors[k], float(d.scores.margins[k]), band(float(p)).decision)
                            for k, p in zip(rows, probabilities)
                        ],
                    )
        for labels_, n in decisions.items():
            metrics.labelled(metrics.DECISIONS, *labels_).inc(n)
        for (name, reason), n in fallbacks.items():
            if reason == INVALID_OUTPUT_REASON:
                metrics.labelled(metrics.MODEL_OUTPUT_INVALID, name).inc(n)
            metrics.FALLBACKS.labels(name, reason).inc(n)

    def _family(self, model_name: str) -> ModelFamily:
        family = self.families.get(model_name or self.default_model)
        if family is None:  # the name is echoed cut short: an error never carries a client's huge input back
            shown = repr(model_name[:MAX_ECHO]) + ("…" if len(model_name) > MAX_ECHO else "")
            raise UnknownModel(
                f"model family {shown} is not served here; served: {', '.join(sorted(self.families))}",
                metadata={"model": model_name[:MAX_ECHO]},
            )
        return family

    async def _infer(
        self, family: ModelFamily, model: ModelVersion, features: np.ndarray, deadline: float | None
    ) -> ScoredRows:
        """The one call site of InferenceService for decisions: ``[rows, n_features] float32``
        (rows ≤ ``max_inference_rows``) → their logits ``[rows, n_classes] float32`` as one matrix and how
        each row was served (:class:`ScoredRows`), through the cache,
        single-flight, deadline budget, retries and circuit breaker (:class:`CachedInference`)."""
        metrics.labelled(metrics.INFERENCE_ROWS, family.name).observe(len(features))
        return await self.scorer.score(
            family.target(model), features, deadline, n_classes=len(model.entry.manifest.class_names)
        )

    async def _infer_bulk(
        self, family: ModelFamily, model: ModelVersion, features: np.ndarray, deadline: float | None
    ) -> ScoredRows:
        """:meth:`_infer` for a table's rows: past the cache (:meth:`CachedInference.score_uncached`);
        a row InferenceService cannot score now fails with its ``INFERENCE_UNAVAILABLE`` rather than
        taking the fallback decision, which would stay its request id's decision for good."""
        metrics.labelled(metrics.INFERENCE_ROWS, family.name).observe(len(features))
        return await self.scorer.score_uncached(
            family.target(model), features, deadline, n_classes=len(model.entry.manifest.class_names)
        )

    async def _infer_shadow(
        self, family: ModelFamily, model: ModelVersion, features: np.ndarray
    ) -> tuple[np.ndarray, str]:
        """Shadow calls go straight to InferenceService: never cached, never served."""
        return await self.inference.infer(family.target(model), features)


def group_probabilities(d: Decided, rows: list[int]) -> np.ndarray:
    """The recorded probabilities ``[len(rows)] float64`` of decided rows ``rows`` (all with model output)."""
    column = d.columns.probability
    return np.array([column[j] for j in rows], dtype=np.float64)
