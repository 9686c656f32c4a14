"""RecordOutcomes' messages ⇄ outcome items (:mod:`mlpair.prediction.feedback`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.prediction.errors import InvalidRequest, PredictionError
from mlpair.prediction.feedback.items import OutcomeItem, check, invalid
from mlpair.prediction.feedback.store import Stored
from mlpair.prediction.intake.converters import error_status

_MAX_SECONDS = 253402300799  # 9999-12-31T23:59:59Z, the last second a Timestamp may hold
_MIN_SECONDS = -62135596800  # 0001-01-01T00:00:00Z


def _time(where: str, field: str, message: pb.DecisionOutcome) -> datetime | None:
    if not message.HasField(field):
        return None
    value: timestamp_pb2.Timestamp = getattr(message, field)
    if not (_MIN_SECONDS <= value.seconds <= _MAX_SECONDS and 0 <= value.nanos < 1_000_000_000):
        raise invalid(where, field, "is not a valid timestamp")
    return value.ToDatetime(tzinfo=UTC)


def outcome_items(request: pb.RecordOutcomesRequest, max_items: int) -> list[OutcomeItem | PredictionError]:
    """One item per outcome, in order, or the error that item alone met (:func:`~mlpair.prediction.feedback.items.check`).

    Raises:
        InvalidRequest: more than ``max_items`` outcomes (nothing is stored).
    """
    if len(request.outcomes) > max_items:
        raise InvalidRequest(
            f"{len(request.outcomes)} outcomes in one call; at most {max_items} (PREDICTION_MAX_OUTCOME_ITEMS)"
        )
    now = datetime.now(UTC)
    items: list[OutcomeItem | PredictionError] = []
    for i, message in enumerate(request.outcomes):
        where = f"item {i}"
        try:
            raw = {
                "request_id": message.request_id,
                "entity_id": message.entity_id,
                "model_name": message.model_name,
                "label": message.label,
                "decided_at": _time(where, "decided_at", message),
                "observed_at": _time(where, "observed_at", message),
            }
            items.append(check(where, raw, now))
        except PredictionError as exc:
            items.append(exc)
    return items


def outcomes_response(results: Sequence[Stored | PredictionError]) -> pb.RecordOutcomesResponse:
    """Each item's result, in order, with the call's counts."""
    response = pb.RecordOutcomesResponse()
    for result in results:
        if isinstance(result, Stored):
            response.results.add(
                stored=pb.OutcomeStored(
                    request_id=result.request_id, duplicate=result.duplicate, decision_found=result.decision_found
                )
            )
            response.duplicates += result.duplicate
            response.stored += not result.duplicate
        else:
            response.results.add(error=error_status(result))
            response.refused += 1
    return response
