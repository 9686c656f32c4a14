"""Feeding realised outcomes back to PredictionService (``RecordOutcomes``): :class:`Outcome`, and
``record_outcomes`` on both clients (:class:`RecordsOutcomes`, :class:`RecordsOutcomesAsync`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import grpc

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client.errors import item_results


@dataclass(frozen=True)
class Outcome:
    """What really happened to one decided entity.

    Attributes:
        label: one of the family's class names as its model's manifest names them, e.g. ``"bad"``
            or ``"not bad"`` for credit-risk, ``"Yes"`` or ``"not Yes"`` for churn.
        request_id: the decision's request id; or leave it empty and give ``entity_id`` and
            ``decided_at`` (the decision's ``decided_at`` exactly as it was returned).
        observed_at: when the outcome was observed (aware, or naive UTC); None = now.
        model_name: the family; empty = the decision's.
    """

    label: str
    request_id: str = ""
    observed_at: datetime | None = None
    model_name: str = ""
    entity_id: str = ""
    decided_at: datetime | None = None


@dataclass(frozen=True)
class OutcomeError:
    """A refused outcome: its status code, message, ErrorInfo reason (``INVALID_OUTCOME``,
    ``OUTCOME_CONFLICT``, ``UNKNOWN_MODEL``) and metadata (``item``, ``field``)."""

    code: grpc.StatusCode
    message: str
    reason: str
    metadata: dict[str, str]


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def outcomes_request(outcomes: Sequence[Outcome]) -> pb.RecordOutcomesRequest:
    """The ``RecordOutcomesRequest`` carrying ``outcomes``."""
    request = pb.RecordOutcomesRequest()
    now = datetime.now(UTC)
    for o in outcomes:
        message = request.outcomes.add(
            request_id=o.request_id, entity_id=o.entity_id, model_name=o.model_name, label=o.label
        )
        message.observed_at.FromDatetime(_utc(o.observed_at or now))
        if o.decided_at is not None:
            message.decided_at.FromDatetime(_utc(o.decided_at))
    return request


def outcome_results(reply: pb.RecordOutcomesResponse) -> list[pb.OutcomeStored | OutcomeError]:
    """Per outcome, in order: ``OutcomeStored`` (``request_id``, ``duplicate``, ``decision_found``)
    or the :class:`OutcomeError` it alone met."""
    return item_results(reply.results, "result", "stored", OutcomeError)


class RecordsOutcomes:
    """``record_outcomes`` of the blocking client (needs the client's ``_stub`` and ``_deadline``)."""

    _stub: Any

    def _deadline(self, timeout_s: float | None) -> float:  # the client's
        raise NotImplementedError

    def record_outcomes(
        self, outcomes: Sequence[Outcome], *, timeout_s: float | None = None
    ) -> list[pb.OutcomeStored | OutcomeError]:
        """Feeds realised outcomes back in one ``RecordOutcomes`` call; each is stored or refused on
        its own. The same outcome again is stored once (``duplicate``); another label for a decision
        that has one is refused (ALREADY_EXISTS, ``OUTCOME_CONFLICT``).

        Returns:
            One result per outcome, in order (:func:`outcome_results`).

        Raises:
            grpc.RpcError: the whole call was refused: INVALID_ARGUMENT (more outcomes than
                ``PREDICTION_MAX_OUTCOME_ITEMS``), UNAVAILABLE (nothing of the failed part was
                stored: send again), DEADLINE_EXCEEDED.
        """
        return outcome_results(self._stub.RecordOutcomes(outcomes_request(outcomes), timeout=self._deadline(timeout_s)))


class RecordsOutcomesAsync:
    """``record_outcomes`` of the ``grpc.aio`` client."""

    _stub: Any

    def _deadline(self, timeout_s: float | None) -> float:  # the client's
        raise NotImplementedError

    async def record_outcomes(
        self, outcomes: Sequence[Outcome], *, timeout_s: float | None = None
    ) -> list[pb.OutcomeStored | OutcomeError]:
        """As :meth:`RecordsOutcomes.record_outcomes`, awaited."""
        reply = await self._stub.RecordOutcomes(outcomes_request(outcomes), timeout=self._deadline(timeout_s))
        return outcome_results(reply)
