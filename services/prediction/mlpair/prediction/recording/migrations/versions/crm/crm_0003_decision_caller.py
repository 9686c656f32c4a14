"""CRM: who asked for each decision (``caller``); rows written before it keep ``""``.

Expand only: a column with a server default, so the previous release's relay, which names its
columns on insert, keeps delivering into the migrated table.

Revision ID: crm_0003
Revises: crm_0002
"""

import sqlalchemy as sa
from alembic import op

revision = "crm_0003"
down_revision = "crm_0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("decisions", sa.Column("caller", sa.String(128), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("decisions") as batch:
        batch.drop_column("caller")
