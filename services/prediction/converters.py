"""Proto ⇄ domain conversions for PredictionService (the only place that knows both)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.errors import ServiceError
from mlpair.prediction.errors import DOMAIN
from mlpair.prediction.pipeline import PredictInput, PredictionResult

# Decision labels that the wire enum also names; any other label travels only as decision_label.
_DECISION_ENUM = {name.removeprefix("DECISION_"): number for name, number in pb.Decision.items()
                  if number != pb.DECISION_UNSPECIFIED}


def attribute_values(wire: Mapping[str, pb.AttributeValue]) -> dict[str, Any]:
    """A request's attribute map → name → Python value: the typed oneof's value (float, str or
    bool; a set zero value stays a value), or None when the oneof is unset (missing).

    Keys are iterated and looked up, and each value converted inline: the map's ``items()`` is a
    Python-level view, and with a function call per value it cost 7.1 µs per 13-attribute
    request against 5.2 µs this way (measured on 500 holdout applicants).
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


def predict_input(request: pb.PredictRequest, deadline: float | None = None) -> PredictInput:
    return PredictInput(
        request_id=request.request_id, entity_id=request.entity_id, model_name=request.model_name,
        attributes=attribute_values(request.attributes),
        explain=request.explain, deadline=deadline,
    )


def batch_inputs(request: pb.BatchPredictRequest, deadline: float | None = None) -> list[PredictInput]:
    return [predict_input(item, deadline) for item in request.requests]


def predict_response(result: PredictionResult) -> pb.PredictResponse:
    s = result.stored
    response = pb.PredictResponse(
        request_id=s.request_id, decision_id=s.decision_id, probability=s.probability or 0.0,
        decision=_DECISION_ENUM.get(s.decision, pb.DECISION_UNSPECIFIED), decision_label=s.decision,
        reason_codes=s.reason_codes, model_version=s.model_version,
        feature_schema_version=s.feature_schema_version, from_cache=result.from_cache,
        policy_version=s.policy_version, spread=result.spread, calibration_method=result.calibration_method,
        stale=s.served_from == "stale_cache", cache_age_ms=s.cache_age_ms, degraded_reason=s.degraded_reason,
        fallback=s.served_from == "fallback", replayed=result.replayed,
    )
    if s.decided_at is not None:
        response.decided_at.FromDatetime(s.decided_at)
    for w in result.warnings:
        response.warnings.add(code=w.code, field=w.field, message=w.message)
    if result.explanation is not None:
        response.contributions.extend(
            pb.FeatureContribution(feature=c.feature, contribution=c.contribution, reason_code=c.reason_code, text=c.text)
            for c in result.explanation.contributions)
        response.top_reasons.extend(result.explanation.top_reasons)
    return response


def error_status(error: ServiceError) -> status_pb2.Status:
    """A per-item error as ``google.rpc.Status`` with one ErrorInfo, exactly as Predict would fail."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata))
    return status_pb2.Status(code=getattr(code_pb2, error.code), message=error.message, details=[info])


def batch_response(outcomes: Sequence[PredictionResult | ServiceError]) -> pb.BatchPredictResponse:
    response = pb.BatchPredictResponse()
    results = response.results
    for o in outcomes:  # added in place: a BatchPredictResult built first would be copied in again
        if isinstance(o, ServiceError):
            results.add(error=error_status(o))
        else:
            results.add(prediction=predict_response(o))
    return response


def to_attributes(record: dict[str, Any]) -> dict[str, pb.AttributeValue]:
    """Python values → wire values (for clients: the demo and tests); None/NaN → null."""
    out = {}
    for name, value in record.items():
        if value is None or (isinstance(value, float) and value != value):
            out[name] = pb.AttributeValue()
        elif isinstance(value, bool):
            out[name] = pb.AttributeValue(bool_value=value)
        elif isinstance(value, (int, float)):
            out[name] = pb.AttributeValue(number_value=float(value))
        else:
            out[name] = pb.AttributeValue(string_value=str(value))
    return out
