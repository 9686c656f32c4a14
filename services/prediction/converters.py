"""Proto ⇄ domain conversions for PredictionService (the only place that knows both)."""

from __future__ import annotations

import time
from typing import Any

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.prediction.pipeline import PredictInput, PredictionResult


def attribute_value(value: pb.AttributeValue) -> Any:
    """Typed wire value → Python value; an unset oneof is None (missing)."""
    kind = value.WhichOneof("kind")
    return None if kind is None else getattr(value, kind)


def deadline(context) -> float | None:
    """The caller's gRPC deadline as ``time.monotonic()`` seconds; None when it set none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def predict_input(request: pb.PredictRequest, deadline: float | None = None) -> PredictInput:
    return PredictInput(
        request_id=request.request_id, entity_id=request.entity_id, model_name=request.model_name,
        attributes={name: attribute_value(v) for name, v in request.attributes.items()}, deadline=deadline,
    )


def predict_response(result: PredictionResult) -> pb.PredictResponse:
    s = result.stored
    return pb.PredictResponse(
        request_id=s.request_id, decision_id=s.decision_id, probability=s.probability or 0.0,
        decision=pb.Decision.Value(f"DECISION_{s.decision}"), reason_codes=s.reason_codes,
        model_version=s.model_version, feature_schema_version=s.feature_schema_version,
        from_cache=result.from_cache, policy_version=s.policy_version,
        stale=s.served_from == "stale_cache", cache_age_ms=s.cache_age_ms, degraded_reason=s.degraded_reason,
        fallback=s.served_from == "fallback",
    )


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
