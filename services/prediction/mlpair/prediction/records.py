"""The decision domain: what a decision is, as recorded, independent of any database.

:class:`StoredDecision` is one decision as recorded (in the decision ledger, then in the CRM);
:class:`DecisionColumns` is a batch of them column by column (no object per decision until one is
read); :class:`Recorded` is what the ledger holds for a request id after a commit, and
:class:`RecordedBatch` its answer for a whole :class:`DecisionColumns`. Decision ids are derived
from request ids (:func:`decision_id_for`). How these become database rows and back is
:mod:`mlpair.prediction.recording.codecs`; nothing here imports SQLAlchemy, so the pipeline that makes
decisions does not either.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import overload

import numpy as np

from mlpair.prediction.errors import LedgerUnavailable

# Decision ids are derived from the request id (the idempotency key), so every replica, every
# retry and every delivery attempt name a decision the same way (RFC 4122 name-based UUID).
_DECISION_NAMESPACE = uuid.UUID("6b1f4a3e-3c1d-5e0a-9b7e-6d6c70616972")
_NAMESPACE_BYTES = _DECISION_NAMESPACE.bytes


def decision_id_for(request_id: str) -> str:
    """The decision id of ``request_id``: UUIDv5 in mlpair's namespace (RFC 4122 §4.3).

    The same value as ``str(uuid.uuid5(namespace, request_id))``, written from the SHA-1 hex
    digest directly (the version nibble set to 5, the variant's two bits to 10 by a table): the
    ``uuid.UUID`` object costs more than the hash on the request path, and the bytes route
    (``bytearray``, bit masks, ``hex``) more than this (docs/decisions/0005-columnar-bulk-path.md).
    """
    h = hashlib.sha1(_NAMESPACE_BYTES + request_id.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


_VARIANT = {c: "89ab"[int(c, 16) & 3] for c in "0123456789abcdef"}  # hex digit → with RFC 4122's variant bits 10


def decision_ids_for(request_ids: Sequence[str]) -> list[str]:
    """:func:`decision_id_for` of each request id, in order.

    From 32 ids on, only the SHA-1 digests are taken per id; the version and variant bits and
    the hex text with its dashes are written for the whole batch at once (NumPy), then cut into
    ids (below 32 ids NumPy's per-call cost makes that slower than one id at a time). The same
    bytes as RFC 4122 §4.3: the digest's first 16 bytes, byte 6's high nibble set to 5, byte 8's
    two high bits to 10.
    """
    n = len(request_ids)
    if n < _BATCH_IDS_FROM:
        return [decision_id_for(r) for r in request_ids]
    sha1, namespace = hashlib.sha1, _NAMESPACE_BYTES
    digests = np.frombuffer(b"".join([sha1(namespace + r.encode()).digest() for r in request_ids]), np.uint8)
    raw = digests.reshape(n, 20)[:, :16].copy()
    raw[:, 6] = (raw[:, 6] & 0x0F) | 0x50
    raw[:, 8] = (raw[:, 8] & 0x3F) | 0x80
    text = np.full((n, 36), ord("-"), dtype=np.uint8)
    text[:, _HIGH_NIBBLE_AT] = _HEX_DIGITS[raw >> 4]
    text[:, _LOW_NIBBLE_AT] = _HEX_DIGITS[raw & 0x0F]
    ids = text.tobytes().decode("ascii")
    return [ids[i : i + 36] for i in range(0, 36 * n, 36)]


_BATCH_IDS_FROM = 32  # ids from which writing them at once costs less than one by one (measured)
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_HEX_AT = [i for i in range(36) if i not in (8, 13, 18, 23)]  # the 32 hex digits' places between the dashes
_HIGH_NIBBLE_AT, _LOW_NIBBLE_AT = _HEX_AT[0::2], _HEX_AT[1::2]  # of each byte's two digits


@dataclass(frozen=True)
class StoredDecision:
    """A decision as recorded (in the decision ledger, then in the CRM).

    ``probability`` is None when no model output was used (``served_from = "fallback"``);
    ``served_from`` is one of ``inference``, ``cache``, ``stale_cache``, ``fallback``.
    """

    decision_id: str
    request_id: str
    entity_id: str
    model_name: str
    model_version: str
    feature_schema_version: str
    policy_version: str
    probability: float | None
    decision: str
    reason_codes: tuple[str, ...]
    served_from: str = "inference"
    cache_age_ms: int = 0
    degraded_reason: str = ""
    decided_at: datetime | None = None
    caller: str = ""  # who asked (intake/callers.py); "" on decisions recorded before callers were


@dataclass(frozen=True)
class Recorded:
    """What the ledger holds for a request id after a commit.

    ``replayed`` is True when the decision was on record before this call (a retry, or a
    concurrent call that won); ``fingerprint`` is the recorded request's ("" when unknown: a
    decision imported from an outbox or backfilled from the CRM).
    """

    decision: StoredDecision
    replayed: bool
    fingerprint: str = ""


@dataclass(eq=False)
class DecisionColumns(Sequence[StoredDecision]):
    """Decisions ``[n]`` column by column (the fields of :class:`StoredDecision`), with the
    fingerprint of each decision's request and, when audit records are kept, each decision's
    (JSON text, :mod:`mlpair.prediction.recording.audit`; "" for none); the ledger's bulk path sends
    the columns as they are (:func:`mlpair.prediction.recording.codecs.ledger_columns`)."""

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
    caller: list[str]
    fingerprints: list[str] = field(default_factory=list)
    audit: list[str] | None = None

    # The column fields, in this order: StoredDecision's fields with the request id first.
    FIELDS = ("request_id", *(name for name in StoredDecision.__dataclass_fields__ if name != "request_id"))

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
            self.caller[i],
        )

    def __iter__(self) -> Iterator[StoredDecision]:
        return (self[i] for i in range(len(self)))

    @classmethod
    def concat(cls, parts: Sequence[DecisionColumns]) -> DecisionColumns:
        """One batch of the parts' decisions, in order."""
        if len(parts) == 1:
            return parts[0]
        # a part without audit records (none kept for it) gets "" for each decision: no record is written
        audit = None if all(p.audit is None for p in parts) else [v for p in parts for v in p.audit or [""] * len(p)]
        columns = {name: [v for p in parts for v in getattr(p, name)] for name in (*cls.FIELDS, "fingerprints")}
        return cls(**columns, audit=audit)


@dataclass(eq=False)
class RecordedBatch(Sequence[Recorded | LedgerUnavailable]):
    """The ledger's outcome for each row of a :class:`DecisionColumns`: a
    :class:`Recorded` (built when read) or a :class:`LedgerUnavailable`.

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
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i in self.errors:
            return self.errors[i]
        if i in self.replays:
            return self.replays[i]
        return Recorded(self.decisions[i], False, self.decisions.fingerprints[i])

    def split(self, parts: Sequence[DecisionColumns]) -> list[RecordedBatch]:
        """The outcome of each of ``parts``: the batches this one concatenates, in order."""
        if len(parts) == 1:
            return [self]
        split = [RecordedBatch(part) for part in parts]
        starts = list(itertools.accumulate(map(len, parts), initial=0))
        for i, recorded in self.replays.items():
            k = bisect.bisect_right(starts, i) - 1
            split[k].replays[i - starts[k]] = recorded
        for i, error in self.errors.items():
            k = bisect.bisect_right(starts, i) - 1
            split[k].errors[i - starts[k]] = error
        return split
