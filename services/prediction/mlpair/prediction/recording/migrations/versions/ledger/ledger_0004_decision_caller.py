"""Ledger: who asked for each decision (``caller``, established by intake: ``intake/callers.py``).

Expand only: one column with a server default, so rows of earlier releases keep ``""`` and the
previous release, which names its columns on insert and never reads this one, keeps working
against the migrated table. PostgreSQL (11 and later) adds a column with a constant default
without rewriting the table; SQLite's ``ADD COLUMN`` does not rewrite either.

Revision ID: ledger_0004
Revises: ledger_0003
"""

import sqlalchemy as sa
from alembic import op

revision = "ledger_0004"
down_revision = "ledger_0003"
branch_labels = None
depends_on = None


def _schema() -> str | None:
    return None if op.get_bind().dialect.name == "sqlite" else "prediction"


def upgrade() -> None:
    op.add_column(
        "decision_ledger",
        sa.Column("caller", sa.String(128), nullable=False, server_default=""),
        schema=_schema(),
    )


def downgrade() -> None:
    with op.batch_alter_table("decision_ledger", schema=_schema()) as batch:
        batch.drop_column("caller")
