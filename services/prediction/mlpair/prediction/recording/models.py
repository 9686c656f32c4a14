"""Tables (SQLAlchemy 2.x declarative). Their schema is owned by the Alembic migrations in
``migrations/``; these classes only map it — change both together.

Two databases, two metadata objects:

* the **CRM database** (``CrmBase``): ``decisions``, one row per request id, what the business reads;
* the **decision ledger** (``LedgerBase``): ``decision_ledger``, PredictionService's own table,
  shared by every replica: one row per request id, written before the decision is returned, with
  the request's fingerprint; the relay delivers its rows to the CRM. On PostgreSQL it lives in the
  ``prediction`` schema (:data:`LEDGER_SCHEMA`) beside ``decision_outbox``, the relays' work list
  (one row per group commit); a SQLite ledger (the embedded default) is a file of its own, where
  each row carries its delivery state. ``decision_outcomes`` beside it holds the realised outcomes
  fed back (:mod:`mlpair.prediction.feedback`), ``decision_audit`` what each decision was based on
  (:mod:`mlpair.prediction.recording.audit`), and on PostgreSQL ``decision_event_outbox`` the event
  relay's work list.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

LEDGER_SCHEMA = "prediction"  # PostgreSQL schema owned by PredictionService (SQLite has none)
LEDGER_TABLE = "decision_ledger"
OUTBOX_TABLE = "decision_outbox"  # PostgreSQL only
OUTCOMES_TABLE = "decision_outcomes"
AUDIT_TABLE = "decision_audit"
EVENT_OUTBOX_TABLE = "decision_event_outbox"  # PostgreSQL only


class CrmBase(DeclarativeBase):
    """Tables of the CRM database."""


class LedgerBase(DeclarativeBase):
    """Tables of PredictionService's decision ledger."""


class DecisionRecord(CrmBase):
    """One decision as the business sees it; ``request_id`` is the idempotency key."""

    __tablename__ = "decisions"

    decision_id: Mapped[str] = mapped_column(String(36), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)
    entity_id: Mapped[str] = mapped_column(String(128), index=True, nullable=False)
    model_name: Mapped[str] = mapped_column(String(64), nullable=False)
    model_version: Mapped[str] = mapped_column(String(32), nullable=False)  # "" when no model output was used
    feature_schema_version: Mapped[str] = mapped_column(String(64), nullable=False)
    policy_version: Mapped[str] = mapped_column(String(64), nullable=False)
    probability: Mapped[float | None] = mapped_column(Float, nullable=True)  # NULL for the fallback decision
    decision: Mapped[str] = mapped_column(String(32), nullable=False)
    reason_codes: Mapped[str] = mapped_column(Text, nullable=False)  # JSON list
    served_from: Mapped[str] = mapped_column(String(16), nullable=False, server_default="inference")
    cache_age_ms: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    degraded_reason: Mapped[str] = mapped_column(String(64), nullable=False, server_default="")
    decided_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    caller: Mapped[str] = mapped_column(String(128), nullable=False, server_default="")  # crm_0003
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


class LedgerEntry(LedgerBase):
    """A decision on record for its request id, shared by every replica (see ``crm/ledger.py``).

    The decision's columns are the CRM's; ``fingerprint`` is the SHA-256 of the canonical request
    (empty when unknown: a decision imported from an outbox or backfilled from the CRM).
    ``recorded_at``, ``delivered_at`` and ``lease_until`` are timestamps on PostgreSQL and Unix
    seconds on SQLite, whose ledger is read and written by plain ``sqlite3``.

    ``delivered_at`` is the per-row delivery state: NULL until a relay delivers the row. On
    PostgreSQL this release writes ``'infinity'`` instead, meaning "delivered through
    :class:`OutboxEntry`", and only rows of the previous release (or imported) are NULL;
    ``lease_until`` is SQLite's (a claim's expiry).
    """

    __tablename__ = LEDGER_TABLE
    __table_args__ = (
        # the relay's work list: undelivered rows in commit order, cheap however long the ledger grows
        Index(
            "ix_decision_ledger_undelivered",
            "seq",
            postgresql_where=text("delivered_at IS NULL"),
            sqlite_where=text("delivered_at IS NULL"),
        ),
        {"schema": LEDGER_SCHEMA},
    )

    seq: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)
    fingerprint: Mapped[str] = mapped_column(String(64), nullable=False, server_default="")
    decision_id: Mapped[str] = mapped_column(String(36), nullable=False)
    entity_id: Mapped[str] = mapped_column(String(128), nullable=False)
    model_name: Mapped[str] = mapped_column(String(64), nullable=False)
    model_version: Mapped[str] = mapped_column(String(32), nullable=False)
    feature_schema_version: Mapped[str] = mapped_column(String(64), nullable=False)
    policy_version: Mapped[str] = mapped_column(String(64), nullable=False)
    probability: Mapped[float | None] = mapped_column(Float, nullable=True)
    decision: Mapped[str] = mapped_column(String(32), nullable=False)
    reason_codes: Mapped[str] = mapped_column(Text, nullable=False)  # JSON list
    served_from: Mapped[str] = mapped_column(String(16), nullable=False)
    cache_age_ms: Mapped[int] = mapped_column(Integer, nullable=False)
    degraded_reason: Mapped[str] = mapped_column(String(64), nullable=False)
    decided_at: Mapped[datetime] = mapped_column(DateTime(timezone=True).with_variant(Text(), "sqlite"), nullable=False)
    caller: Mapped[str] = mapped_column(String(128), nullable=False, server_default="")  # ledger_0004
    recorded_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True).with_variant(Float(), "sqlite"), nullable=False
    )
    delivered_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True).with_variant(Float(), "sqlite"), nullable=True
    )
    lease_until: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True).with_variant(Float(), "sqlite"), nullable=True
    )


class OutboxEntry(LedgerBase):
    """The relays' work list on PostgreSQL: one row per group commit, naming the ``seq`` of each
    decision it inserted, deleted by the relay that delivered them (``recording/ledger_postgres.py``)."""

    __tablename__ = OUTBOX_TABLE
    __table_args__ = {"schema": LEDGER_SCHEMA}

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    seqs: Mapped[list[int]] = mapped_column(postgresql.ARRAY(BigInteger), nullable=False)
    n: Mapped[int] = mapped_column(Integer, nullable=False)  # len(seqs)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


class OutcomeEntry(LedgerBase):
    """A realised outcome of one decision (migration ``ledger_0003``; :mod:`mlpair.prediction.feedback.store`).

    Keyed by ``request_id``, or, for an outcome named by entity and time whose decision was not on
    record, by ``entity_id`` with ``decided_at`` (``request_id`` NULL). ``decided_at`` has the
    ledger's encoding (ISO text on SQLite); ``observed_at`` and ``recorded_at`` are Unix seconds on
    SQLite. ``positive`` is 1 when ``label`` is the family's positive class.
    """

    __tablename__ = OUTCOMES_TABLE
    __table_args__ = (
        UniqueConstraint("entity_id", "decided_at", name="uq_decision_outcomes_entity_time"),
        {"schema": LEDGER_SCHEMA},
    )

    seq: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str | None] = mapped_column(String(128), unique=True, nullable=True)
    entity_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    decided_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True).with_variant(Text(), "sqlite"), nullable=True
    )
    model_name: Mapped[str] = mapped_column(String(64), nullable=False)
    label: Mapped[str] = mapped_column(String(64), nullable=False)
    positive: Mapped[int] = mapped_column(SmallInteger, nullable=False)
    observed_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True).with_variant(Float(), "sqlite"), nullable=False
    )
    recorded_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True).with_variant(Float(), "sqlite"), nullable=False, server_default=func.now()
    )


class AuditEntry(LedgerBase):
    """What one decision was based on, as one JSON text (migration ``ledger_0005``;
    :mod:`mlpair.prediction.recording.audit`); deleted after the retention period, the decision kept."""

    __tablename__ = AUDIT_TABLE
    __table_args__ = (
        Index("ix_decision_audit_recorded_at", "recorded_at", postgresql_using="brin"),
        {"schema": LEDGER_SCHEMA},
    )

    seq: Mapped[int] = mapped_column(  # the decision's seq in decision_ledger
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=False
    )
    record: Mapped[str] = mapped_column(Text, nullable=False)
    recorded_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True).with_variant(Float(), "sqlite"), nullable=False, server_default=func.now()
    )


class EventOutboxEntry(LedgerBase):
    """The event relay's work list on PostgreSQL, shaped like :class:`OutboxEntry` (``ledger_0005``)."""

    __tablename__ = EVENT_OUTBOX_TABLE
    __table_args__ = {"schema": LEDGER_SCHEMA}

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    seqs: Mapped[list[int]] = mapped_column(postgresql.ARRAY(BigInteger), nullable=False)
    n: Mapped[int] = mapped_column(Integer, nullable=False)
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)
