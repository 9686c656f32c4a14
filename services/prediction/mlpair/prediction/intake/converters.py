"""Proto ⇄ domain conversions for PredictionService (the only place that knows both)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from google.protobuf import any_pb2, duration_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.errors import ServiceError
from mlpair.prediction.errors import DOMAIN
from mlpair.prediction.outcomes import Outcomes, PredictInput, PredictionResult
from mlpair.prediction.records import DecisionColumns

if TYPE_CHECKING:
    from mlpair.prediction.deciding.decisions import Decided
    from mlpair.prediction.deciding.explain import Explanation

# Decision labels that the wire enum also names; any other label travels only as decision_label.
_DECISION_ENUM = {
    name.removeprefix("DECISION_"): number for name, number in pb.Decision.items() if number != pb.DECISION_UNSPECIFIED
}


def attribute_values(wire: Mapping[str, pb.AttributeValue]) -> dict[str, Any]:
    """A request's attribute map → name → Python value: the typed oneof's value (float, str or
    bool; a set zero value stays a value), or None when the oneof is unset (missing).

    Keys are iterated and looked up, and each value converted inline: the map's ``items()`` is a
    Python-level view, slower than this, as is a function call per value or ``ListFields``.
    """
    out = {}
    for name in wire:
        value = wire[name]
        kind = value.WhichOneof("kind")
        out[name] = None if kind is None else getattr(value, kind)
    return out


def deadline(context) -> float | None:
    """The caller's gRPC deadline as ``time.monotonic()`` seconds; None when it set none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def predict_input(request: pb.PredictRequest, deadline: float | None = None, caller: str = "") -> PredictInput:
    """A Predict call (or BatchPredict item) in domain terms, read from the message protobuf parsed;
    ``caller``: who asked (:mod:`~mlpair.prediction.intake.callers`)."""
    return PredictInput(
        request.request_id,
        request.entity_id,
        attribute_values(request.attributes),
        request.model_name,
        request.explain,
        deadline,
        caller,
    )


def batch_inputs(
    request: pb.BatchPredictRequest, deadline: float | None = None, caller: str = ""
) -> list[PredictInput]:
    """Each item of a BatchPredict as :func:`predict_input` gives it."""
    values = attribute_values
    return [
        PredictInput(
            item.request_id, item.entity_id, values(item.attributes), item.model_name, item.explain, deadline, caller
        )
        for item in request.requests
    ]


def predict_response(result: PredictionResult) -> pb.PredictResponse:
    """``result`` as a ``PredictResponse``: the recorded decision (its label, and the wire enum where
    the enum names that label), reason codes, calibrated probability, the versions that decided it,
    how it was served (cache, stale cache with its age in ms, fallback, replayed), its decision time,
    and any warnings and explanation. The one encoder (:func:`_write`) writes it, as it writes a
    BatchPredict's fresh decisions from their columns.
    """
    response = pb.PredictResponse()
    _write(_result_rows(result), [(response, 0)], {})
    return response


class _Rows(NamedTuple):
    """Decisions as the encoder reads them: their records column by column and, per decided row
    ``j``, what a response adds (``warnings`` and ``rows``: keyed by ``rows[j]``)."""

    columns: DecisionColumns
    from_cache: Sequence[bool]
    spread: Sequence[float]
    calibration_method: Sequence[str]
    rows: Sequence[int]
    warnings: Mapping[int, tuple]
    explanations: Mapping[int, Explanation]
    replayed: bool


def _result_rows(result: PredictionResult) -> _Rows:
    """One result (a replay, or a fresh decision read already) as one row of columns."""
    s = result.stored
    return _Rows(
        DecisionColumns(*([getattr(s, name)] for name in DecisionColumns.FIELDS)),
        [result.from_cache],
        [result.spread],
        [result.calibration_method],
        [0],
        {0: result.warnings} if result.warnings else {},
        {0: result.explanation} if result.explanation is not None else {},
        result.replayed,
    )


def _decided_rows(decided: Decided) -> _Rows:
    """A group's fresh decisions (``deciding.decisions.Decided``) as they are, no object per row."""
    return _Rows(
        decided.columns,
        decided.from_cache,
        decided.spread,
        decided.calibration_method,
        decided.rows,
        decided.group.warnings,
        decided.explanations,
        False,
    )


def error_status(error: ServiceError) -> status_pb2.Status:
    """A per-item error as ``google.rpc.Status`` with one ErrorInfo, exactly as Predict would fail."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata))
    details = [info]
    if (retry_after_s := getattr(error, "retry_after_s", None)) is not None:  # a caller's rate limit
        details.append(retry_info(retry_after_s))
    return status_pb2.Status(code=getattr(code_pb2, error.code), message=error.message, details=details)


def retry_info(retry_after_s: float) -> any_pb2.Any:
    """``google.rpc.RetryInfo`` with ``retry_delay`` = ``retry_after_s`` seconds, packed."""
    packed = any_pb2.Any()
    delay = duration_pb2.Duration(seconds=int(retry_after_s), nanos=int((retry_after_s % 1) * 1e9))
    packed.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return packed


def batch_response(outcomes: Sequence[PredictionResult | ServiceError]) -> pb.BatchPredictResponse:
    """Each item's response or error, in order, built by protobuf; fresh decisions are read
    straight from their columns (an :class:`Outcomes`' unread ``(decided, j)`` slots), never
    turned into result objects first, and written into results added in place (a message built
    first would be copied in again), the fields set one by one (keyword arguments cost more)."""
    slots = outcomes.slots if isinstance(outcomes, Outcomes) else outcomes
    response = pb.BatchPredictResponse()
    add = response.results.add
    fresh: dict[int, tuple[Any, list]] = {}  # id(decided) → (decided, [(its result's prediction, row)])
    for o in slots:
        if isinstance(o, tuple):
            decided, j = o
            group = fresh.get(id(decided))
            if group is None:
                group = fresh[id(decided)] = (decided, [])
            group[1].append((add().prediction, j))
        else:
            add(**_result_fields(o))
    timestamps: dict = {}
    for decided, rows in fresh.values():
        _write(_decided_rows(decided), rows, timestamps)
    return response


def _result_fields(o: PredictionResult | ServiceError | None) -> dict:
    """A replayed or failed item's ``BatchPredictResult`` fields."""
    if isinstance(o, ServiceError):
        return {"error": error_status(o)}
    if o is None:  # the pipeline gives every item an outcome
        raise ValueError("a batch item was left without an outcome")
    return {"prediction": predict_response(o)}


def _write(decided: _Rows, rows: list[tuple[pb.PredictResponse, int]], timestamps: dict) -> None:
    """The one response encoder: writes each ``(response, j)`` of ``rows`` with row ``j`` of
    ``decided``. Fields left at their default are not set (proto3 sends the same bytes either
    way); fields are set one by one, cheaper than keyword arguments (docs/decisions)."""
    c = decided.columns
    request_id, decision_id, probability, label = c.request_id, c.decision_id, c.probability, c.decision
    reason_codes, model_version, schema_version = c.reason_codes, c.model_version, c.feature_schema_version
    policy_version, served_from = c.policy_version, c.served_from
    cache_age_ms, degraded = c.cache_age_ms, c.degraded_reason
    from_cache, spread, method = decided.from_cache, decided.spread, decided.calibration_method
    stamps = _timestamps(c.decided_at, timestamps)
    enum = _DECISION_ENUM
    warned, explained, group_rows, replayed = decided.warnings, decided.explanations, decided.rows, decided.replayed
    for x, j in rows:
        x.request_id = request_id[j]
        x.decision_id = decision_id[j]
        if p := probability[j]:  # None and -0.0 as 0.0
            x.probability = p
        if d := enum.get(label[j]):
            x.decision = d
        x.decision_label = label[j]
        x.reason_codes.extend(reason_codes[j])
        x.model_version = model_version[j]
        x.feature_schema_version = schema_version[j]
        if from_cache[j]:
            x.from_cache = True
        x.policy_version = policy_version[j]
        x.spread = spread[j]
        x.calibration_method = method[j]
        if (source := served_from[j]) == "stale_cache":
            x.stale = True
        elif source == "fallback":
            x.fallback = True
        if age := cache_age_ms[j]:
            x.cache_age_ms = age
        if reason := degraded[j]:
            x.degraded_reason = reason
        if (stamp := stamps[j]) is not None:
            x.decided_at.CopyFrom(stamp)
        if replayed:
            x.replayed = True
        if warned or explained:
            warnings, explanation = warned.get(group_rows[j]), explained.get(j)
            if warnings or explanation is not None:
                _add_extras(x, warnings or (), explanation)


def _timestamps(values: list, timestamps: dict) -> list[timestamp_pb2.Timestamp | None]:
    """:func:`_timestamp` of each of ``values``; a column that is one datetime object throughout
    (a call's decisions share theirs: ``list.count`` matches them by identity in C) costs one."""
    if values and values.count(values[0]) == len(values):
        return [_timestamp(values[0], timestamps)] * len(values)
    return [_timestamp(at, timestamps) for at in values]


def _timestamp(at, timestamps: dict) -> timestamp_pb2.Timestamp | None:
    """``at`` (a datetime, or None: not set) as a protobuf Timestamp, made once per distinct value
    in ``timestamps`` (a call's decisions share theirs)."""
    if at is None:
        return None
    stamp = timestamps.get(at)
    if stamp is None:
        stamp = timestamps[at] = timestamp_pb2.Timestamp()
        stamp.FromDatetime(at)
    return stamp


def _add_extras(response: pb.PredictResponse, warnings, explanation) -> None:
    for w in warnings:
        response.warnings.add(code=w.code, field=w.field, message=w.message)
    if explanation is not None:
        response.contributions.extend(
            pb.FeatureContribution(
                feature=c.feature, contribution=c.contribution, reason_code=c.reason_code, text=c.text
            )
            for c in explanation.contributions
        )
        response.top_reasons.extend(explanation.top_reasons)
