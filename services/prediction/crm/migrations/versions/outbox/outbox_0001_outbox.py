"""Outbox: decisions recorded locally before they are returned, with their delivery state.

Revision ID: outbox_0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "outbox_0001"
down_revision = None
branch_labels = ("outbox",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "outbox",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("request_id", sa.String(128), nullable=False, unique=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("recorded_at", sa.Float, nullable=False),
        sa.Column("delivered_at", sa.Float, nullable=True),
    )
    op.create_index("ix_outbox_delivered_at", "outbox", ["delivered_at"])


def downgrade() -> None:
    op.drop_index("ix_outbox_delivered_at", table_name="outbox")
    op.drop_table("outbox")
