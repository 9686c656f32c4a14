"""Ledger: what each decision was based on (``decision_audit``), and the decision events' work list.

``decision_audit`` holds one audit record per decision, keyed by the decision's ``seq`` in the
ledger (a bigint: a cheaper index to insert into than the request id's text), written by the same
statement (or SQLite transaction) that records the decision: the attributes as received with
personal-data fields as keyed hashes or left out, the feature vector the model saw, the guards that
fired, the model's logits and the explanation when one was asked for, as one JSON text
(``recording/audit.py``). ``recorded_at`` (a timestamp on PostgreSQL, Unix seconds on SQLite) is
what retention deletes by, indexed on PostgreSQL by a BRIN index (the table is append-only in time
order, so block ranges summarise it and an insert costs next to nothing); the decision itself
stays in ``decision_ledger``.

``decision_event_outbox`` (PostgreSQL only) is the event relay's work list, shaped like
``decision_outbox``: a group commit adds one row naming the ``seq`` of every decision it inserted
when the decision events are on, and the event relay deletes it in the transaction that saw the
broker acknowledge every event (``recording/event_relay.py``).

Expand only: two new tables; the previous release neither reads nor writes them, and no existing
row is rewritten. A downgrade drops them.

Revision ID: ledger_0005
Revises: ledger_0004
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "ledger_0005"
down_revision = "ledger_0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    schema = None if sqlite else "prediction"
    op.create_table(
        "decision_audit",
        sa.Column("seq", sa.Integer if sqlite else sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("record", sa.Text, nullable=False),
        sa.Column(
            "recorded_at",
            sa.Float if sqlite else sa.DateTime(timezone=True),
            nullable=False,
            server_default=sa.text("((julianday('now') - 2440587.5) * 86400.0)" if sqlite else "now()"),
        ),
        schema=schema,
    )
    op.create_index(
        "ix_decision_audit_recorded_at", "decision_audit", ["recorded_at"], schema=schema, postgresql_using="brin"
    )
    if sqlite:
        return
    op.create_table(
        "decision_event_outbox",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("seqs", postgresql.ARRAY(sa.BigInteger), nullable=False),
        sa.Column("n", sa.Integer, nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")),
        schema=schema,
    )


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    schema = None if sqlite else "prediction"
    if not sqlite:
        op.drop_table("decision_event_outbox", schema=schema)
    op.drop_index("ix_decision_audit_recorded_at", table_name="decision_audit", schema=schema)
    op.drop_table("decision_audit", schema=schema)
