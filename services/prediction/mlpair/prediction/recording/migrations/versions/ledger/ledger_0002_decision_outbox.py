"""Ledger: the relays' work list becomes one outbox row per group commit (PostgreSQL).

Until now each delivered decision was marked by ``UPDATE … SET delivered_at``, inside a claim that
had locked it with ``FOR UPDATE``: a second version of a wide row, never HOT (the undelivered
index names the column), plus a row lock written per decision: claiming and marking cost
PostgreSQL more than inserting the decision (docs/decisions/0008-one-outbox-row-per-commit.md).

From this revision a group commit inserts its decisions and, in the same statement, one row of
``decision_outbox`` naming their sequence numbers; a relay claims outbox rows (``FOR UPDATE SKIP
LOCKED``), reads the decisions by primary key, delivers them and deletes the outbox rows, in one
transaction, writing nothing per decision.

Expand/contract: this release inserts its decisions with ``delivered_at = 'infinity'`` ("tracked
by the outbox"), so a relay of the previous release, still running during the rollout, leaves
them alone, and this release's relays still deliver rows with ``delivered_at IS NULL`` (recorded
by the previous release, or imported) the old way, before the outbox's. The release after next
drops ``delivered_at``, ``lease_until`` and the undelivered index once no row is NULL. The
downgrade turns what still waits in the outbox back into per-row state, so the previous release's
relays deliver it; to the previous release an ``'infinity'`` row reads as delivered, as it was.
No pod of this release may run during a downgrade (its inserts would fail: the table is gone).

SQLite ledgers (one machine, one writer) keep the per-row marks: nothing is created there.

Revision ID: ledger_0002
Revises: ledger_0001
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "ledger_0002"
down_revision = "ledger_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_table(
        "decision_outbox",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("seqs", postgresql.ARRAY(sa.BigInteger), nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        schema="prediction",
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    # Claims in flight finish first (the lock waits for them, and holds off new claims and commits
    # until the table is gone); then what waits in the outbox goes back to the per-row work list.
    op.execute("LOCK TABLE prediction.decision_outbox IN ACCESS EXCLUSIVE MODE")
    op.execute(
        "UPDATE prediction.decision_ledger SET delivered_at = NULL "
        "WHERE seq IN (SELECT unnest(seqs) FROM prediction.decision_outbox)"
    )
    op.drop_table("decision_outbox", schema="prediction")
