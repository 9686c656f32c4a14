"""Tables (SQLAlchemy 2.x declarative). Their schema is owned by the Alembic migrations in
``migrations/``; these classes only map it — change both together.

Two databases, two metadata objects:

* the **CRM database** (``CrmBase``): ``decisions``, one row per request id, what the business reads;
* the **local outbox** (``OutboxBase``): ``outbox``, where PredictionService durably records each
  decision before returning it; the relay delivers its rows to the CRM.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, Float, Integer, String, Text, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class CrmBase(DeclarativeBase):
    """Tables of the CRM database."""


class OutboxBase(DeclarativeBase):
    """Tables of PredictionService's local outbox database."""


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
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


class OutboxEntry(OutboxBase):
    """A decision recorded locally, with its CRM delivery state; ``request_id`` is unique here too."""

    __tablename__ = "outbox"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)
    payload: Mapped[str] = mapped_column(Text, nullable=False)  # the decision as JSON
    recorded_at: Mapped[float] = mapped_column(Float, nullable=False)  # Unix seconds
    delivered_at: Mapped[float | None] = mapped_column(Float, nullable=True, index=True)  # Unix seconds
