"""One realised outcome, checked the same way whichever way it came in (RPC item or file row).

An outcome names its decision by request id, or by entity id with the decision's ``decided_at``;
its label is one of the family's class names as the trained model's manifest names them
(``class_names``: ``"not bad"``/``"bad"`` for credit-risk, ``"not Yes"``/``"Yes"`` for churn), and
``positive`` means the family's positive class (the event the probability estimates: a default, a
churn). The label is checked against the family once the store knows which family decided
(:mod:`.store`); everything else is checked here, without I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from mlpair.prediction.errors import PredictionError

MAX_ID_CHARS = 128  # the ledger's request_id and entity_id columns
FUTURE_SLACK = timedelta(minutes=5)  # clock skew tolerated on observed_at


class InvalidOutcome(PredictionError):
    """An outcome item or row is malformed: no id, a wrong type, an unknown label, a missing,
    malformed or future time, or another family than the decision's. ``metadata``: ``item`` (its
    index in the call, or ``row``: its 1-based data row in a file) and ``field``."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_OUTCOME"


class OutcomeConflict(PredictionError):
    """Another label is on record for the same decision: the first outcome stays, this one is refused."""

    code = "ALREADY_EXISTS"
    reason = "OUTCOME_CONFLICT"


class OutcomesUnavailable(PredictionError):
    """The ledger database could not be reached or refused the write: the outcomes of the chunk in
    progress were not stored (sending them all again is safe: outcomes are idempotent)."""

    code = "UNAVAILABLE"
    reason = "OUTCOMES_NOT_RECORDED"


class OutcomesNotServed(PredictionError):
    """This process was built without an outcome store (a test's or a benchmark's wiring)."""

    code = "UNIMPLEMENTED"
    reason = "OUTCOMES_NOT_SERVED"


@dataclass(frozen=True)
class FamilyLabels:
    """A family's class names (``class_names`` of its manifest) and the positive one."""

    labels: tuple[str, ...]
    positive: str

    @classmethod
    def of_manifest(cls, manifest: Any) -> FamilyLabels:
        """From a :class:`~mlpair.contracts.manifest.Manifest`'s ``class_names`` and ``positive_index``."""
        names = tuple(manifest.class_names)
        return cls(names, names[manifest.positive_index])


@dataclass(frozen=True)
class OutcomeItem:
    """One outcome, well formed (its label not yet checked against the family).

    Attributes:
        where: how errors name it, e.g. ``item 3`` or ``row 17``.
        request_id: the decision's request id; empty when named by ``entity_id`` and ``decided_at``.
        model_name: the family as given; empty = the decision's family, else the default one.
        observed_at: when the outcome was observed, UTC.
    """

    where: str
    request_id: str
    entity_id: str
    decided_at: datetime | None
    model_name: str
    label: str
    observed_at: datetime


def invalid(where: str, field: str, problem: str) -> InvalidOutcome:
    """The error of a malformed ``field`` of the item or row ``where`` (``"item 3"``, ``"row 17"``)."""
    kind, _, number = where.partition(" ")
    return InvalidOutcome(f"{where}: {field} {problem}", metadata={kind: number, "field": field})


def _text(where: str, raw: Mapping[str, Any], field: str) -> str:
    value = raw.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise invalid(where, field, f"must be a string, not {type(value).__name__}")
    value = value.strip()
    if len(value) > MAX_ID_CHARS:
        raise invalid(where, field, f"is longer than {MAX_ID_CHARS} characters")
    return value


def _time(where: str, raw: Mapping[str, Any], field: str) -> datetime | None:
    value = raw.get(field)
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip())
        except ValueError:
            raise invalid(where, field, "is not an ISO 8601 time (e.g. 2026-03-01T12:00:00+00:00)") from None
    if not isinstance(value, datetime):
        raise invalid(where, field, f"must be a time, not {type(value).__name__}")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)  # naive: UTC


def check(where: str, raw: Mapping[str, Any], now: datetime | None = None) -> OutcomeItem:
    """An :class:`OutcomeItem` from raw values: ``request_id``, ``entity_id``, ``model_name``,
    ``label`` (str or None), ``decided_at``, ``observed_at`` (an aware or naive-UTC ``datetime``, an
    ISO 8601 string, or None).

    Raises:
        InvalidOutcome: a value of the wrong type, an id too long, neither a request id nor an entity
            id with ``decided_at``, no label, no ``observed_at``, a malformed time, or an
            ``observed_at`` more than five minutes in the future.
    """
    request_id = _text(where, raw, "request_id")
    entity_id = _text(where, raw, "entity_id")
    model_name = _text(where, raw, "model_name")
    label = _text(where, raw, "label")
    decided_at = _time(where, raw, "decided_at")
    observed_at = _time(where, raw, "observed_at")
    if not request_id and not (entity_id and decided_at):
        raise invalid(where, "request_id", "is missing (or give entity_id with decided_at)")
    if not label:
        raise invalid(where, "label", "is missing")
    if observed_at is None:
        raise invalid(where, "observed_at", "is missing")
    if observed_at > (now or datetime.now(UTC)) + FUTURE_SLACK:
        raise invalid(where, "observed_at", "is in the future")
    return OutcomeItem(where, request_id, entity_id, None if request_id else decided_at, model_name, label, observed_at)
