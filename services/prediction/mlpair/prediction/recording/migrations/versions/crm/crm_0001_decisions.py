"""CRM: the decisions table as first shipped (one row per request id).

Revision ID: crm_0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "crm_0001"
down_revision = None
branch_labels = ("crm",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "decisions",
        sa.Column("decision_id", sa.String(36), primary_key=True),
        sa.Column("request_id", sa.String(128), nullable=False, unique=True),
        sa.Column("entity_id", sa.String(128), nullable=False),
        sa.Column("model_name", sa.String(64), nullable=False),
        sa.Column("model_version", sa.String(32), nullable=False),
        sa.Column("feature_schema_version", sa.String(64), nullable=False),
        sa.Column("policy_version", sa.String(64), nullable=False),
        sa.Column("probability", sa.Float, nullable=False),
        sa.Column("decision", sa.String(32), nullable=False),
        sa.Column("reason_codes", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_index("ix_decisions_entity_id", "decisions", ["entity_id"])


def downgrade() -> None:
    op.drop_index("ix_decisions_entity_id", table_name="decisions")
    op.drop_table("decisions")
