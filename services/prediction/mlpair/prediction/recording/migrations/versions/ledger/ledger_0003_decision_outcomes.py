"""Ledger: realised outcomes beside the decisions (``RecordOutcomes``, ``mlpair outcomes-import``).

``decision_outcomes`` holds one outcome per decision: keyed by ``request_id`` when the caller named
the decision by its request id (or by entity id and time and it was on record), else by
``entity_id`` with ``decided_at`` (kept for a later join, ``request_id`` NULL); both keys are unique
(NULLs never collide). ``positive`` is 1 when the label is the family's positive class, so the join
with ``decision_ledger`` needs no label table. ``decided_at`` uses the ledger's own encoding (ISO text
on SQLite, a timestamp on PostgreSQL) so the two compare exactly; ``observed_at`` and
``recorded_at`` are timestamps on PostgreSQL and Unix seconds on SQLite, like ``recorded_at`` of the
ledger.

``ix_decision_ledger_entity`` (entity id, decided at) on the ledger lets an outcome named by entity
and time find its decision, at record time and in the later join.

Expand only: the previous release neither reads nor writes the new table; a downgrade drops it.

Revision ID: ledger_0003
Revises: ledger_0002
"""

import sqlalchemy as sa
from alembic import op

revision = "ledger_0003"
down_revision = "ledger_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    schema = None if sqlite else "prediction"
    timestamp = sa.Float if sqlite else sa.DateTime(timezone=True)
    op.create_table(
        "decision_outcomes",
        sa.Column("seq", sa.Integer if sqlite else sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(128), nullable=True, unique=True),
        sa.Column("entity_id", sa.String(128), nullable=True),
        sa.Column("decided_at", sa.Text if sqlite else sa.DateTime(timezone=True), nullable=True),
        sa.Column("model_name", sa.String(64), nullable=False),
        sa.Column("label", sa.String(64), nullable=False),
        sa.Column("positive", sa.SmallInteger, nullable=False),
        sa.Column("observed_at", timestamp, nullable=False),
        sa.Column(
            "recorded_at",
            timestamp,
            nullable=False,
            server_default=sa.text("((julianday('now') - 2440587.5) * 86400.0)" if sqlite else "now()"),
        ),
        sa.UniqueConstraint("entity_id", "decided_at", name="uq_decision_outcomes_entity_time"),
        schema=schema,
    )
    op.create_index("ix_decision_ledger_entity", "decision_ledger", ["entity_id", "decided_at"], schema=schema)


def downgrade() -> None:
    schema = None if op.get_bind().dialect.name == "sqlite" else "prediction"
    op.drop_index("ix_decision_ledger_entity", table_name="decision_ledger", schema=schema)
    op.drop_table("decision_outcomes", schema=schema)
