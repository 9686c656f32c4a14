"""Decisions ⇄ database rows: how the domain values of :mod:`mlpair.prediction.records` are stored.

A decision is stored with its reason codes as a JSON list and its timestamp as the database
keeps it; the CRM table's columns are :class:`~mlpair.prediction.records.StoredDecision`'s fields
in order (:data:`CRM_COLUMNS`), and the ledger's are :data:`~.ledger.DECISION_COLUMNS` (request id
and fingerprint first). Plain functions over the domain types: no engine, no I/O.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from mlpair.prediction.records import DecisionColumns, StoredDecision

if TYPE_CHECKING:
    from sqlalchemy import Row

# The CRM columns a delivery writes: the decision's fields, in order (reason_codes as JSON text).
CRM_COLUMNS = tuple(StoredDecision.__dataclass_fields__)
CrmRow = tuple  # one decision's CRM_COLUMNS values

# What json.dumps(obj) and json.dumps(obj, separators=(",", ":")) do, without building an encoder
# per call (json.dumps makes a new JSONEncoder whenever an argument differs from the defaults).
_JSON = json.JSONEncoder()
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))
_REASONS_JSON: dict[tuple[str, ...], str] = {}  # reason-code tuples repeat: each is encoded once
_REASONS_MEMO_LIMIT = 4096


def reason_codes_json(codes: tuple[str, ...]) -> str:
    """The reason codes as stored: a JSON list (``json.dumps(list(codes))``)."""
    found = _REASONS_JSON.get(codes)
    if found is None:
        found = _JSON.encode(list(codes))
        if len(_REASONS_JSON) < _REASONS_MEMO_LIMIT:
            _REASONS_JSON[codes] = found
    return found


def reason_codes_from_json(stored: str) -> tuple[str, ...]:
    """The reason codes of a stored JSON list."""
    return tuple(json.loads(stored))


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; every timestamp here is UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


def fields(d: StoredDecision) -> dict[str, Any]:
    """The decision's fields by name, values as they are."""
    # Field by field, not dataclasses.asdict: asdict deep-copies every value, which cost more
    # than the rest of the decision's write on the request path (profiled).
    return {
        "decision_id": d.decision_id,
        "request_id": d.request_id,
        "entity_id": d.entity_id,
        "model_name": d.model_name,
        "model_version": d.model_version,
        "feature_schema_version": d.feature_schema_version,
        "policy_version": d.policy_version,
        "probability": d.probability,
        "decision": d.decision,
        "reason_codes": d.reason_codes,
        "served_from": d.served_from,
        "cache_age_ms": d.cache_age_ms,
        "degraded_reason": d.degraded_reason,
        "decided_at": d.decided_at,
        "caller": d.caller,
    }


def to_json(d: StoredDecision) -> str:
    """The decision as compact JSON (``decided_at`` in ISO 8601), as an outbox payload stores it."""
    data = fields(d)
    data["decided_at"] = d.decided_at.isoformat() if d.decided_at else None
    return _COMPACT_JSON.encode(data)


def from_json(payload: str) -> StoredDecision:
    """The decision :func:`to_json` wrote."""
    data = json.loads(payload)
    data["reason_codes"] = tuple(data["reason_codes"])
    data["decided_at"] = datetime.fromisoformat(data["decided_at"]) if data.get("decided_at") else None
    data.setdefault("caller", "")  # an outbox payload of a release before callers were recorded
    return StoredDecision(**data)


def from_record(r: Row[Any]) -> StoredDecision:
    """A decision from a selected CRM ``decisions`` row (:class:`~.models.DecisionRecord`'s columns)."""
    return StoredDecision(
        r.decision_id,
        r.request_id,
        r.entity_id,
        r.model_name,
        r.model_version,
        r.feature_schema_version,
        r.policy_version,
        r.probability,
        r.decision,
        tuple(json.loads(r.reason_codes)),
        r.served_from,
        r.cache_age_ms,
        r.degraded_reason,
        as_utc(r.decided_at),
        r.caller or "",
    )


def crm_row(d: StoredDecision) -> CrmRow:
    """The decision's :data:`CRM_COLUMNS` values."""
    return (
        d.decision_id,
        d.request_id,
        d.entity_id,
        d.model_name,
        d.model_version,
        d.feature_schema_version,
        d.policy_version,
        d.probability,
        d.decision,
        reason_codes_json(d.reason_codes),
        d.served_from,
        d.cache_age_ms,
        d.degraded_reason,
        d.decided_at,
        d.caller,
    )


def ledger_columns(batch: DecisionColumns) -> list[list]:
    """Every row of ``batch`` as the ledger's columns (``DECISION_COLUMNS``: request id,
    fingerprint, the decision's fields, reason codes as JSON), one list per column."""
    return [
        batch.request_id,
        batch.fingerprints,
        batch.decision_id,
        batch.entity_id,
        batch.model_name,
        batch.model_version,
        batch.feature_schema_version,
        batch.policy_version,
        batch.probability,
        batch.decision,
        list(map(reason_codes_json, batch.reason_codes)),
        batch.served_from,
        batch.cache_age_ms,
        batch.degraded_reason,
        batch.decided_at,
        batch.caller,
    ]
