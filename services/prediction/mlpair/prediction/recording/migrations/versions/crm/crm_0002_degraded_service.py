"""CRM: how each decision was served (inference, cache, stale cache, fallback) and when.

A fallback decision has no model output, so ``probability`` becomes nullable.

Revision ID: crm_0002
Revises: crm_0001
"""

import sqlalchemy as sa
from alembic import op

revision = "crm_0002"
down_revision = "crm_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("decisions") as batch:  # SQLite cannot ALTER a column: batch recreates the table
        batch.alter_column("probability", existing_type=sa.Float, nullable=True)
        batch.add_column(sa.Column("served_from", sa.String(16), nullable=False, server_default="inference"))
        batch.add_column(sa.Column("cache_age_ms", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("degraded_reason", sa.String(64), nullable=False, server_default=""))
        batch.add_column(sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.drop_column("decided_at")
        batch.drop_column("degraded_reason")
        batch.drop_column("cache_age_ms")
        batch.drop_column("served_from")
        batch.alter_column("probability", existing_type=sa.Float, nullable=False)
