"""Decisions as columns: what a batch records in the ledger without one object per decision.

A :class:`DecisionColumns` is a sequence of :class:`~mlpair.prediction.crm.store.StoredDecision`
whose items are built only when one is read (a replay, a test, a single Predict); the ledger's
bulk path (:meth:`DecisionColumns.ledger_arrays`) sends its columns as they are, one array per
column. A :class:`RecordedBatch` is the ledger's answer for such a batch: which rows were on
record already (replays, with what was recorded) and which could not be recorded; every other
row was recorded as given.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, overload

from mlpair.prediction.crm.store import StoredDecision
from mlpair.prediction.errors import LedgerUnavailable

if TYPE_CHECKING:
    from mlpair.prediction.crm.ledger import Recorded

_JSON = json.JSONEncoder()
_REASONS_JSON: dict[tuple[str, ...], str] = {}  # reason-code tuples repeat: each is encoded once
_REASONS_MEMO_LIMIT = 4096


def reason_codes_json(codes: tuple[str, ...]) -> str:
    """The reason codes as stored (a JSON list, as :meth:`StoredDecision.reason_codes_json`)."""
    found = _REASONS_JSON.get(codes)
    if found is None:
        found = _JSON.encode(list(codes))
        if len(_REASONS_JSON) < _REASONS_MEMO_LIMIT:
            _REASONS_JSON[codes] = found
    return found


@dataclass(eq=False)
class DecisionColumns(Sequence[StoredDecision]):
    """Decisions ``[n]`` column by column (the fields of :class:`StoredDecision`), with the
    fingerprint of each decision's request."""

    request_id: list[str]
    decision_id: list[str]
    entity_id: list[str]
    model_name: list[str]
    model_version: list[str]
    feature_schema_version: list[str]
    policy_version: list[str]
    probability: list[float | None]
    decision: list[str]
    reason_codes: list[tuple[str, ...]]
    served_from: list[str]
    cache_age_ms: list[int]
    degraded_reason: list[str]
    decided_at: list[datetime]
    fingerprints: list[str] = field(default_factory=list)

    FIELDS = (
        "request_id",
        "decision_id",
        "entity_id",
        "model_name",
        "model_version",
        "feature_schema_version",
        "policy_version",
        "probability",
        "decision",
        "reason_codes",
        "served_from",
        "cache_age_ms",
        "degraded_reason",
        "decided_at",
    )

    def __len__(self) -> int:
        return len(self.request_id)

    @overload
    def __getitem__(self, i: int) -> StoredDecision: ...

    @overload
    def __getitem__(self, i: slice) -> list[StoredDecision]: ...

    def __getitem__(self, i: int | slice) -> StoredDecision | list[StoredDecision]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return StoredDecision(
            self.decision_id[i],
            self.request_id[i],
            self.entity_id[i],
            self.model_name[i],
            self.model_version[i],
            self.feature_schema_version[i],
            self.policy_version[i],
            self.probability[i],
            self.decision[i],
            self.reason_codes[i],
            self.served_from[i],
            self.cache_age_ms[i],
            self.degraded_reason[i],
            self.decided_at[i],
        )

    def __iter__(self) -> Iterator[StoredDecision]:
        return (self[i] for i in range(len(self)))

    @classmethod
    def concat(cls, parts: Sequence[DecisionColumns]) -> DecisionColumns:
        """One batch of the parts' decisions, in order."""
        if len(parts) == 1:
            return parts[0]
        return cls(*([v for p in parts for v in getattr(p, name)] for name in (*cls.FIELDS, "fingerprints")))

    def ledger_arrays(self, order: Sequence[int]) -> list[list]:
        """The rows ``order`` as the ledger's columns (``DECISION_COLUMNS``: request id, fingerprint,
        the decision's fields, reason codes as JSON), one list per column."""

        def take(column: list) -> list:
            return [column[i] for i in order]

        return [
            take(self.request_id),
            take(self.fingerprints),
            take(self.decision_id),
            take(self.entity_id),
            take(self.model_name),
            take(self.model_version),
            take(self.feature_schema_version),
            take(self.policy_version),
            take(self.probability),
            take(self.decision),
            [reason_codes_json(self.reason_codes[i]) for i in order],
            take(self.served_from),
            take(self.cache_age_ms),
            take(self.degraded_reason),
            take(self.decided_at),
        ]


@dataclass(eq=False)
class RecordedBatch(Sequence["Recorded | LedgerUnavailable"]):
    """The ledger's outcome for each row of a :class:`DecisionColumns`: a
    :class:`~mlpair.prediction.crm.ledger.Recorded` (built when read) or a :class:`LedgerUnavailable`.

    Attributes:
        decisions: the batch as committed.
        replays: row → what was on record before (``replayed`` True), for rows already on record.
        errors: row → why it is not on record, for rows that could not be recorded.
    """

    decisions: DecisionColumns
    replays: dict[int, Recorded] = field(default_factory=dict)
    errors: dict[int, LedgerUnavailable] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.decisions)

    @overload
    def __getitem__(self, i: int) -> Recorded | LedgerUnavailable: ...

    @overload
    def __getitem__(self, i: slice) -> list[Recorded | LedgerUnavailable]: ...

    def __getitem__(self, i: int | slice) -> Recorded | LedgerUnavailable | list[Recorded | LedgerUnavailable]:
        from mlpair.prediction.crm.ledger import Recorded

        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i in self.errors:
            return self.errors[i]
        if i in self.replays:
            return self.replays[i]
        return Recorded(self.decisions[i], False, self.decisions.fingerprints[i])
