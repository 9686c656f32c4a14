"""Ledger: the decision ledger shared by every PredictionService replica.

One row per request id (the idempotency key), written before the decision is returned, with the
request's fingerprint and its delivery state. On PostgreSQL the table lives in PredictionService's
own ``prediction`` schema (created by ``crm.migrate`` before Alembic writes its version table
there); a SQLite ledger is a file of its own, without schemas, and keeps its timestamps as Unix
seconds.

Revision ID: ledger_0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "ledger_0001"
down_revision = None
branch_labels = ("ledger",)
depends_on = None


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    schema = None if sqlite else "prediction"
    timestamp = sa.Float if sqlite else sa.DateTime(timezone=True)
    op.create_table(
        "decision_ledger",
        sa.Column("seq", sa.Integer if sqlite else sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(128), nullable=False, unique=True),
        sa.Column("fingerprint", sa.String(64), nullable=False, server_default=""),
        sa.Column("decision_id", sa.String(36), nullable=False),
        sa.Column("entity_id", sa.String(128), nullable=False),
        sa.Column("model_name", sa.String(64), nullable=False),
        sa.Column("model_version", sa.String(32), nullable=False),
        sa.Column("feature_schema_version", sa.String(64), nullable=False),
        sa.Column("policy_version", sa.String(64), nullable=False),
        sa.Column("probability", sa.Float, nullable=True),
        sa.Column("decision", sa.String(32), nullable=False),
        sa.Column("reason_codes", sa.Text, nullable=False),
        sa.Column("served_from", sa.String(16), nullable=False),
        sa.Column("cache_age_ms", sa.Integer, nullable=False),
        sa.Column("degraded_reason", sa.String(64), nullable=False),
        sa.Column("decided_at", sa.Text if sqlite else sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "recorded_at",
            timestamp,
            nullable=False,
            server_default=sa.text("((julianday('now') - 2440587.5) * 86400.0)" if sqlite else "now()"),
        ),
        sa.Column("delivered_at", timestamp, nullable=True),
        sa.Column("lease_until", timestamp, nullable=True),
        schema=schema,
    )
    op.create_index(
        "ix_decision_ledger_undelivered",
        "decision_ledger",
        ["seq"],
        schema=schema,
        postgresql_where=sa.text("delivered_at IS NULL"),
        sqlite_where=sa.text("delivered_at IS NULL"),
    )


def downgrade() -> None:
    schema = None if op.get_bind().dialect.name == "sqlite" else "prediction"
    op.drop_index("ix_decision_ledger_undelivered", table_name="decision_ledger", schema=schema)
    op.drop_table("decision_ledger", schema=schema)
