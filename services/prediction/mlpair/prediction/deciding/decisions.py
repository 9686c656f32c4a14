"""Deciding a scored group at once: policy bands, reason codes and the records, as columns.

For each row of a :class:`~mlpair.prediction.preparing.batch.Group`, from its
:class:`~mlpair.prediction.scoring.scorer.GroupScores`, the same decision as deciding it alone:

* a row with usable model output: the mean of the members' calibrated probabilities (summed in
  member order, as ``ndarray.mean`` does for fewer than eight members), the ensemble spread
  (max − min), the fraction of schema features that took their default, then the policy's band
  and overrides (:meth:`DecisionPolicy.decide_many <mlpair.prediction.deciding.policy.DecisionPolicy.decide_many>`,
  then the missing-data rule on the attributes that took their default);
  reason codes = the verdict's, ``STALE_CACHE_RESULT`` when served stale, then each guard's once;
* no model output (inference unavailable, no stale entry): the policy's fallback decision with
  ``INFERENCE_UNAVAILABLE`` and no probability;
* output unusable for this row alone: the fallback decision with ``MODEL_OUTPUT_INVALID``.

The decisions come out as :class:`~mlpair.prediction.records.DecisionColumns` (no object per
row) plus, per row, what a response carries beside the record (:class:`Extras`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from datetime import datetime
from typing import cast

import numpy as np

from mlpair.prediction import metrics
from mlpair.prediction.deciding.explain import Explanation, explain_rows
from mlpair.prediction.deciding.policy import ROUTE_INSUFFICIENT_DATA, DecisionPolicy
from mlpair.prediction.preparing.batch import Group
from mlpair.prediction.preparing.columns import SMALL_BATCH
from mlpair.prediction.records import DecisionColumns, StoredDecision, decision_ids_for
from mlpair.prediction.scoring.rows import Source
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


@dataclass(eq=False)
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


def decide_columns(
    group: Group,
    scores: GroupScores,
    decided_at: datetime,
    explain_top_k: int,
    memo: dict[tuple[int, bool, tuple[str, ...]], Verdict],
) -> Decided:
    """Decides every row of ``group`` as ``scores`` say it was scored (see the module docstring); ``memo`` keeps the
    (verdict, stale, guards) → (decision, reason codes) pairs of the family between calls.
    A group of fewer than ``SMALL_BATCH`` rows goes through :func:`decide_rows` (the same
    decisions; NumPy's per-call cost would dominate)."""
    if len(group) < SMALL_BATCH:
        return decide_rows(group, scores, decided_at, explain_top_k)
    family, policy = group.family, group.family.policy
    n = len(group)
    errors: dict[int, Exception] = dict(scores.errors)
    usable = scores.usable.copy()
    if errors:
        usable[list(errors)] = False
    probs = scores.probabilities
    if len(probs) == 1:
        probability, spread = probs[0], np.zeros(n)
    elif len(probs) < 8:
        total = probs[0].copy()
        for member in probs[1:]:
            total += member
        probability, spread = total / len(probs), probs.max(axis=0) - probs.min(axis=0)
    else:  # ndarray.mean sums eight or more members pairwise: per row, as deciding alone does
        probability = np.array([probs[:, k].mean() for k in range(n)])
        spread = probs.max(axis=0) - probs.min(axis=0)
    defaulted = np.array([g.defaulted for g in group.guards], dtype=np.float64) / family.n_schema_features
    rows = np.flatnonzero(usable)
    band, route, valid = policy.decide_many(probability[rows], spread[rows], defaulted[rows])
    verdicts = np.full(n, -1, dtype=np.int64)
    verdicts[rows] = np.where(valid, band * 3 + route, -2)
    for k in np.flatnonzero(verdicts == -2).tolist():
        errors[k] = as_item_error(ValueError("the decision policy refused a calibrated probability"))
    if family.is_ensemble and len(rows):
        hist = metrics.ENSEMBLE_SPREAD.labels(family.name)
        for value in spread[rows[valid]].tolist():
            hist.observe(value)
        if n_uncertain := int(np.count_nonzero(route[valid] == 2)):
            metrics.UNCERTAIN_DECISIONS.labels(family.name).inc(n_uncertain)
    found: list[Verdict | None] = [None] * n
    stale_cache, get = Source.STALE_CACHE, memo.get
    requiring = policy.missing_data.decision if policy.missing_data is not None else None
    for k, (verdict, served, guards) in enumerate(zip(verdicts.tolist(), scores.served, group.guards)):
        if verdict >= 0:
            assert served is not None  # a row with a verdict was scored (its call did not fail)
            key = (verdict, served.source is stale_cache, guards.reason_codes)
            hit = get(key)
            if hit is None:
                hit = _verdict(policy, *key)
                if len(memo) < _MEMO_LIMIT:
                    memo[key] = hit
            # a missing-data rule the row breaks: its decision, as decide() makes it (insufficient data wins)
            if (
                guards.defaulted
                and requiring is not None
                and verdict % 3 != ROUTE_INSUFFICIENT_DATA
                and (codes := policy.missing_codes(guards.defaulted_features))
            ):
                stale = (STALE_REASON,) if key[1] else ()
                hit = requiring, (*codes, policy.bands[verdict // 3].reason_code, *stale, *guards.reason_codes)
            found[k] = hit
    return _records(group, scores, decided_at, explain_top_k, found, probability.tolist(), spread.tolist(), errors)


def decide_rows(group: Group, scores: GroupScores, decided_at: datetime, explain_top_k: int) -> Decided:
    """:func:`decide_columns` row by row, with :meth:`DecisionPolicy.decide
    <mlpair.prediction.deciding.policy.DecisionPolicy.decide>` (the code a single Predict used before the
    columnar path): the same decisions, records and metrics, for groups too small for NumPy to pay.
    The mean and spread are the same float64 operations in the same order (members summed in order
    and divided by their number, ``ndarray.mean`` from eight members on), so bit for bit the same."""
    family, policy = group.family, group.family.policy
    n, n_schema = len(group), family.n_schema_features
    errors: dict[int, Exception] = dict(scores.errors)
    found: list[Verdict | None] = [None] * n
    probability, spread = [0.0] * n, [0.0] * n
    columns, usable = scores.probabilities.T.tolist(), scores.usable.tolist()
    for k, (members, ok, served, guards) in enumerate(zip(columns, usable, scores.served, group.guards)):
        if not ok or k in errors:
            continue
        assert served is not None  # a usable row was scored (its call did not fail)
        if len(members) == 1:
            p, s = members[0], 0.0
        elif len(members) < 8:
            p = members[0]
            for member in members[1:]:  # not sum(): Python 3.12's sum() of floats is compensated
                p += member
            p, s = p / len(members), max(members) - min(members)
        else:
            p, s = float(scores.probabilities[:, k].mean()), max(members) - min(members)
        try:
            missing = guards.defaulted_features
            verdict = policy.decide(p, s, guards.defaulted / n_schema, missing)
        except ValueError:
            errors[k] = as_item_error(ValueError("the decision policy refused a calibrated probability"))
            continue
        if family.is_ensemble:
            metrics.ENSEMBLE_SPREAD.labels(family.name).observe(s)
            if verdict.uncertain:
                metrics.UNCERTAIN_DECISIONS.labels(family.name).inc()
        stale = (STALE_REASON,) if served.source is Source.STALE_CACHE else ()
        found[k] = verdict.decision, (*verdict.reason_codes, *stale, *guards.reason_codes)
        probability[k], spread[k] = p, s
    return _records(group, scores, decided_at, explain_top_k, found, probability, spread, errors)


def _records(
    group: Group,
    scores: GroupScores,
    decided_at: datetime,
    explain_top_k: int,
    verdicts: list[Verdict | None],
    probability_list: list[float],
    spread_list: list[float],
    errors: dict[int, Exception],
) -> Decided:
    """The decided rows' records: ``verdicts`` per row (decision, reason codes), None without model output."""
    if verdicts and not errors and None not in verdicts:
        every = cast(list[Verdict], verdicts)  # no None among them, just checked
        return _records_all_scored(group, scores, decided_at, explain_top_k, every, probability_list, spread_list)
    family, policy = group.family, group.family.policy
    fallback_decision = policy.fallback_decision
    out_rows: list[int] = []
    decision: list[str] = []
    reasons: list[tuple[str, ...]] = []
    served_from: list[str] = []
    age: list[int] = []
    degraded: list[str] = []
    prob: list[float | None] = []
    spreads: list[float] = []
    cached: list[bool] = []
    methods: list[str] = []
    without_model: dict[int, str] = {}
    method = family.calibration_method
    for k, (found, served, guards) in enumerate(zip(verdicts, scores.served, group.guards)):
        if k in errors:
            continue
        assert served is not None  # only a row whose call failed (in errors) was not scored
        if found is not None:
            decision.append(found[0])
            reasons.append(found[1])
            served_from.append(served.source.value)
            age.append(served.age_ms)
            degraded.append(served.degraded_reason)
            prob.append(probability_list[k])
            spreads.append(spread_list[k])
            cached.append(served.source in _FROM_CACHE)
            methods.append(method)
        else:
            invalid = served.source is not Source.FALLBACK
            reason = INVALID_OUTPUT_REASON if invalid else FALLBACK_REASON
            without_model[len(out_rows)] = INVALID_OUTPUT_REASON if invalid else served.degraded_reason
            decision.append(fallback_decision)
            reasons.append((reason, *guards.reason_codes))
            served_from.append(Source.FALLBACK.value)
            age.append(0)
            degraded.append(without_model[len(out_rows)])
            prob.append(None)
            spreads.append(0.0)
            cached.append(False)
            methods.append("")
        out_rows.append(k)
    m = len(out_rows)
    requests = group.requests
    request_ids = [requests[k].request_id for k in out_rows]
    versions = scores.model_versions
    columns = DecisionColumns(
        request_ids,
        decision_ids_for(request_ids),
        [requests[k].entity_id for k in out_rows],
        [family.name] * m,
        [versions[k] for k in out_rows],
        [family.feature_version] * m,
        [policy.version] * m,
        prob,
        decision,
        reasons,
        served_from,
        age,
        degraded,
        [decided_at] * m,
        [requests[k].caller for k in out_rows],
        [group.fingerprints[k] for k in out_rows],
    )
    explanations = explain_rows(group.family, scores.occluded, out_rows, prob, explain_top_k)
    return Decided(group, scores, out_rows, columns, spreads, cached, methods, explanations, without_model, errors)


def _records_all_scored(
    group: Group,
    scores: GroupScores,
    decided_at: datetime,
    explain_top_k: int,
    verdicts: list[Verdict],
    probability: list[float],
    spread: list[float],
) -> Decided:
    """:func:`_records` when every row was decided with model output (no error, no fallback): the
    same records, each column built in one pass over the rows instead of ten appends per row."""
    family, policy, n = group.family, group.family.policy, len(group)
    _, _, sources, age, degraded = zip(*scores.served)
    requests = group.requests
    request_ids = list(map(_REQUEST_ID, requests))  # map with a getter: no Python frame per row
    columns = DecisionColumns(
        request_ids,
        decision_ids_for(request_ids),
        list(map(_ENTITY_ID, requests)),
        [family.name] * n,
        list(scores.model_versions),
        [family.feature_version] * n,
        [policy.version] * n,
        list(probability),
        list(map(_DECISION, verdicts)),
        list(map(_REASON_CODES, verdicts)),
        list(map(_SERVED_FROM.__getitem__, sources)),
        list(age),
        list(degraded),
        [decided_at] * n,
        list(map(_CALLER, requests)),
        list(group.fingerprints),
    )
    rows = list(range(n))
    cached = [s in _FROM_CACHE for s in sources]
    explanations = explain_rows(group.family, scores.occluded, rows, probability, explain_top_k)
    return Decided(group, scores, rows, columns, spread, cached, [family.calibration_method] * n, explanations, {}, {})


def _verdict(policy: DecisionPolicy, verdict: int, stale: bool, guard_codes: tuple[str, ...]) -> Verdict:
    """(decision, reason codes) of a verdict code ``band * 3 + route`` (see ``DecisionPolicy.decide_many``)."""
    found = policy.verdict(verdict // 3, verdict % 3)
    return found.decision, (*found.reason_codes, *((STALE_REASON,) if stale else ()), *guard_codes)


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
