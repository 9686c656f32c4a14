"""Runs the Alembic migrations of the CRM database and of the local outbox, at start-up.

A fresh database is brought to the head of its branch (``crm`` or ``outbox``); one that is
already current is left alone. A CRM database created before migrations existed (the first
``decisions`` table, no ``alembic_version``) is stamped at ``crm_0001`` and then upgraded.
On PostgreSQL the upgrade holds a transaction-scoped advisory lock, so replicas starting
together migrate one at a time.

To write a new revision (from the repository root)::

    python -c "from mlpair.prediction.crm.migrate import alembic_config; from alembic import command; \\
    command.revision(alembic_config(), 'what changed', head='crm@head')"
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
CRM_BRANCH = "crm"
OUTBOX_BRANCH = "outbox"
_FIRST_CRM_REVISION = "crm_0001"
_ADVISORY_LOCK_KEY = 0x6D6C70616972  # "mlpair"


def alembic_config() -> Config:
    """An Alembic config for ``migrations/`` with both version folders (no alembic.ini needed)."""
    import os

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    config.set_main_option("version_locations", os.pathsep.join(
        str(MIGRATIONS / "versions" / branch) for branch in (CRM_BRANCH, OUTBOX_BRANCH)))
    return config


async def upgrade(engine: AsyncEngine, branch: str) -> None:
    """Upgrades the database behind ``engine`` to the head of ``branch`` (``crm`` or ``outbox``).

    Raises:
        sqlalchemy.exc.SQLAlchemyError, OSError: the database is unreachable or refuses the change.
    """
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _ADVISORY_LOCK_KEY})
        await conn.run_sync(_upgrade, branch)


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at (None before any migration)."""
    async with engine.connect() as conn:
        if not await conn.run_sync(lambda c: inspect(c).has_table("alembic_version")):
            return None
        return await conn.scalar(text("SELECT version_num FROM alembic_version"))


def _upgrade(connection: Connection, branch: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    tables = set(inspect(connection).get_table_names())
    if branch == CRM_BRANCH and "decisions" in tables and "alembic_version" not in tables:
        command.stamp(config, _FIRST_CRM_REVISION)
    command.upgrade(config, f"{branch}@head")
