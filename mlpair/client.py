"""``mlpair predict``: one decision from a running PredictionService, from the command line.

Attributes come as ``NAME=VALUE`` pairs: a value that reads as a finite number travels as a
number, an empty one as null (missing), anything else as a string (the feature schema converts
it: ``yes`` for a boolean, a category name, ``"42"`` for a number). ``mlpair attributes`` lists
what each family accepts.
"""

from __future__ import annotations

import math
import uuid

import grpc

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc


def parse_attributes(pairs: list[str]) -> dict[str, pb.AttributeValue]:
    """``["Income=1290", "Home=rent", "Debt="]`` → the request's attribute map.

    Raises:
        ValueError: a pair has no ``=`` or an empty name.
    """
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--attr {pair!r}: expected NAME=VALUE (e.g. Income=1290)")
        out[name.strip()] = _value(text.strip())
    return out


def _value(text: str) -> pb.AttributeValue:
    if not text:
        return pb.AttributeValue()
    try:
        number = float(text)
    except ValueError:
        return pb.AttributeValue(string_value=text)
    return pb.AttributeValue(number_value=number) if math.isfinite(number) else pb.AttributeValue(string_value=text)


def predict(
    target: str,
    family: str,
    attributes: dict[str, pb.AttributeValue],
    *,
    request_id: str = "",
    entity_id: str = "",
    explain: bool = False,
    timeout_s: float = 10.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> pb.PredictResponse:
    """One ``PredictionService.Predict`` call; a new request id (UUID4) unless one is given.

    Raises:
        grpc.RpcError: the service refused the request or could not be reached.
    """
    request = pb.PredictRequest(
        request_id=request_id or str(uuid.uuid4()),
        entity_id=entity_id,
        model_name=family,
        attributes=attributes,
        explain=explain,
    )
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        return pb_grpc.PredictionServiceStub(channel).Predict(request, timeout=timeout_s)


def render(reply: pb.PredictResponse) -> str:
    """The decision as a few human-readable lines: decision, reasons, probability, versions, warnings."""
    lines = [
        f"decision      {reply.decision_label}" + (" (fallback: no model answer)" if reply.fallback else ""),
        f"reasons       {', '.join(reply.reason_codes) or '-'}",
        f"probability   {reply.probability:.4f}" + (" (none: fallback)" if reply.fallback else ""),
        f"model         version {reply.model_version}, feature schema {reply.feature_schema_version}, "
        f"policy {reply.policy_version}, calibration {reply.calibration_method}",
        f"request id    {reply.request_id} (decision {reply.decision_id}"
        + (", replayed" if reply.replayed else "")
        + ")",
    ]
    lines += [f"explanation   {text}" for text in reply.top_reasons]
    lines += [f"warning       {w.code} {w.field}: {w.message}" for w in reply.warnings]
    if reply.stale or reply.degraded_reason:
        lines.append(f"degraded      {reply.degraded_reason} (cached {reply.cache_age_ms} ms ago)")
    return "\n".join(lines)
