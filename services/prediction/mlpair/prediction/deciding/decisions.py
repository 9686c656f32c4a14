"""Deciding a scored group at once: policy bands, reason codes and the records, as columns.

For each row of a :class:`~mlpair.prediction.preparing.batch.Group`, from its
:class:`~mlpair.prediction.scoring.scorer.GroupScores`, the same decision as deciding it alone:

* a row with usable model output: the mean of the members' calibrated probabilities (summed in
  member order, as ``ndarray.mean`` does for fewer than eight members), the ensemble spread
  (max − min), the fraction of schema features that took their default, then the policy's band
  and overrides (:meth:`DecisionPolicy.verdict_code <mlpair.prediction.deciding.policy.DecisionPolicy.verdict_code>`,
  then the missing-data rule on the attributes that took their default), as ``DecisionPolicy.decide`` gives them;
  reason codes = the verdict's, ``STALE_CACHE_RESULT`` when served stale, then each guard's once;
* no model output (inference unavailable, no stale entry): the policy's fallback decision with
  ``INFERENCE_UNAVAILABLE`` and no probability;
* output unusable for this row alone: the fallback decision with ``MODEL_OUTPUT_INVALID``.

The decisions come out as :class:`~mlpair.prediction.records.DecisionColumns` (no object per
row) plus, per row, what a response carries beside the record (:class:`Decided`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from datetime import datetime
from typing import cast

import numpy as np

from mlpair.prediction import metrics
from mlpair.prediction.deciding.explain import Explanation, explain_rows
from mlpair.prediction.deciding.policy import ROUTE_UNCERTAIN
from mlpair.prediction.preparing.batch import Group
from mlpair.prediction.records import DecisionColumns, StoredDecision, decision_ids_for
from mlpair.prediction.scoring.rows import Scored, Source
from mlpair.prediction.scoring.scorer import GroupScores, as_item_error

FALLBACK_REASON = "INFERENCE_UNAVAILABLE"
INVALID_OUTPUT_REASON = "MODEL_OUTPUT_INVALID"  # reason code and degraded reason of a row with unusable output
STALE_REASON = "STALE_CACHE_RESULT"
_FROM_CACHE = (Source.CACHE, Source.STALE_CACHE)
_SERVED_FROM = {s: s.value for s in Source}  # a dict look-up: cheaper than the enum's ``value`` property
_REQUEST_ID, _ENTITY_ID = operator.attrgetter("request_id"), operator.attrgetter("entity_id")
_CALLER = operator.attrgetter("caller")
_DECISION, _REASON_CODES = operator.itemgetter(0), operator.itemgetter(1)  # of a Verdict
_MEMO_LIMIT = 4096
Verdict = tuple[str, tuple[str, ...]]  # (decision, reason codes) of a row with model output


@dataclass(frozen=True, eq=False)
class Decided:
    """One group's decisions: the records of its decided rows and what responses add to them.

    Attributes:
        group, scores: what was decided: the prepared rows and how they were scored.
        rows: the group's rows that were decided, in order (others are in ``errors``).
        columns: their records, in the same order.
        spread, from_cache: per decided row. calibration_method: per decided row ("" without model output).
        explanations: decided row → its explanation (explained rows with every occlusion scored).
        without_model: decided row → ``INFERENCE_UNAVAILABLE``'s degraded reason or ``MODEL_OUTPUT_INVALID``.
        errors: group row → why it was not decided.
    """

    group: Group
    scores: GroupScores
    rows: list[int]
    columns: DecisionColumns
    spread: list[float]
    from_cache: list[bool]
    calibration_method: list[str]
    explanations: dict[int, Explanation] = field(default_factory=dict)
    without_model: dict[int, str] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)


def decide(
    group: Group,
    scores: GroupScores,
    decided_at: datetime,
    explain_top_k: int,
    memo: dict[tuple[int, bool, tuple[str, ...]], Verdict],
) -> Decided:
    """Decides every row of ``group`` as ``scores`` say it was scored (see the module docstring); ``memo`` keeps the
    (verdict, stale, guards) → (decision, reason codes) pairs of the family between calls.

    A row decided in a group of any size gets the decision, record and explanation it gets decided alone:
    the mean and spread are the same float64 operations in the same order per row (members summed in
    order and divided by their number, ``ndarray.mean`` from eight members on)."""
    family, policy, n = group.family, group.family.policy, len(group)
    probability, spread = (a.tolist() for a in _mean_and_spread(scores.probabilities))
    errors: dict[int, Exception] = dict(scores.errors)
    # per decided row: (decision, reason codes) = the verdict's, STALE_CACHE_RESULT when served stale,
    # each guard's once; a missing-data rule the row breaks makes its decision (insufficient data wins)
    out: list[int] = []  # the decided rows
    found: list[Verdict | None] = []  # None: no usable model output
    code_of, n_schema, usable = policy.verdict_code, family.n_schema_features, scores.usable.tolist()
    stale_cache, get, guards_of = Source.STALE_CACHE, memo.get, group.guards
    spreads: list[float] | None = [] if family.is_ensemble else None  # the ensemble spreads decided on
    n_uncertain = 0
    for k, (s, guards) in enumerate(zip(scores.served, guards_of)):
        if k in errors:
            continue
        if not usable[k]:
            out.append(k)
            found.append(None)
            continue
        try:
            verdict = code_of(probability[k], spread[k], guards.defaulted / n_schema)
        except ValueError:
            errors[k] = as_item_error(ValueError("the decision policy refused a calibrated probability"))
            continue
        if spreads is not None:
            spreads.append(spread[k])
            n_uncertain += verdict % 3 == ROUTE_UNCERTAIN
        key = (verdict, s.source is stale_cache, guards.reason_codes)  # type: ignore[union-attr]  # usable: scored
        hit = get(key)
        if hit is None:
            decision = policy.verdict(verdict // 3, verdict % 3)
            hit = decision.decision, (*decision.reason_codes, *((STALE_REASON,) if key[1] else ()), *key[2])
            if len(memo) < _MEMO_LIMIT:
                memo[key] = hit
        if guards.defaulted and (override := policy.missing_override(verdict, guards.defaulted_features)):
            hit = override.decision, (*override.reason_codes, *((STALE_REASON,) if key[1] else ()), *key[2])
        out.append(k)
        found.append(hit)
    if spreads:
        hist = metrics.ENSEMBLE_SPREAD.labels(family.name)
        for value in spreads:
            hist.observe(value)
    if n_uncertain:
        metrics.UNCERTAIN_DECISIONS.labels(family.name).inc(n_uncertain)
    every_row = len(out) == n
    served = cast(list[Scored], list(scores.served) if every_row else [scores.served[k] for k in out])  # scored
    # rows without model output: the policy's fallback decision, recorded as served by the fallback
    p_list, s_list = (probability, spread) if every_row else ([probability[k] for k in out], [spread[k] for k in out])
    methods = [family.calibration_method] * len(out)
    without_model: dict[int, str] = {}
    if None in found:
        for j, (hit, s) in enumerate(zip(found, served)):
            if hit is None:
                invalid = s.source is not Source.FALLBACK
                reason = without_model[j] = INVALID_OUTPUT_REASON if invalid else s.degraded_reason
                code = INVALID_OUTPUT_REASON if invalid else FALLBACK_REASON
                found[j] = policy.fallback_decision, (code, *guards_of[out[j]].reason_codes)
                served[j] = s._replace(source=Source.FALLBACK, age_ms=0, degraded_reason=reason)
                p_list[j], s_list[j], methods[j] = None, 0.0, ""
    every = cast(list[Verdict], found)  # each row has its verdict now
    _, _, sources, age, degraded = zip(*served) if served else ((),) * 5
    requests = group.requests if every_row else [group.requests[k] for k in out]
    request_ids = list(map(_REQUEST_ID, requests))  # map with a getter: no Python frame per row
    m, versions = len(requests), scores.model_versions
    columns = DecisionColumns(
        request_ids,
        decision_ids_for(request_ids),
        list(map(_ENTITY_ID, requests)),
        [family.name] * m,
        list(versions) if every_row else [versions[k] for k in out],
        [family.feature_version] * m,
        [policy.version] * m,
        cast(list[float | None], p_list),
        list(map(_DECISION, every)),
        list(map(_REASON_CODES, every)),
        list(map(_SERVED_FROM.__getitem__, sources)),
        list(age),
        list(degraded),
        [decided_at] * m,
        list(map(_CALLER, requests)),
        list(group.fingerprints) if every_row else [group.fingerprints[k] for k in out],
    )
    cached = [s in _FROM_CACHE for s in sources]
    explanations = explain_rows(family, scores.occluded, out, p_list, explain_top_k)
    return Decided(group, scores, out, columns, s_list, cached, methods, explanations, without_model, errors)


def _mean_and_spread(probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``[n_members, n] float64`` calibrated probabilities: the members' mean and spread (max − min)."""
    n = probs.shape[1]
    if len(probs) == 1:
        return probs[0], np.zeros(n)
    spread = probs.max(axis=0) - probs.min(axis=0)
    if len(probs) < 8:
        total = probs[0].copy()
        for member in probs[1:]:
            total += member
        return total / len(probs), spread
    # ndarray.mean sums eight or more members pairwise: per row, as deciding one row alone does
    return np.array([probs[:, k].mean() for k in range(n)]), spread


REPLAY_TOLERANCE = 1e-6  # probability units: one model's output for one row, in calls of other sizes


def replay_explanation(stored: StoredDecision, d: Decided, j: int) -> Explanation | None:
    """The explanation of a recorded decision, from decided row ``j`` of ``d`` (the same request
    decided again now, with the same values as the schema reads them): the one computed now when
    the model version that made the recorded decision made this one and the two probabilities
    agree within ``REPLAY_TOLERANCE``; None otherwise (another model version serves now, the
    decision was made without model output, or there is no explanation now)."""
    explanation = d.explanations.get(j)
    now = d.columns.probability[j]
    if explanation is None or stored.probability is None or now is None:
        return None
    if stored.model_version != d.columns.model_version[j] or abs(stored.probability - now) > REPLAY_TOLERANCE:
        return None
    return explanation
