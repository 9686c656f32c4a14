"""Alembic migrations of the CRM database and of the decision ledger, run by ``mlpair migrate``.

The serving process never migrates: a pre-deploy job (``mlpair migrate``, a Kubernetes Job with a
schema-owner role) upgrades both databases, and PredictionService, connected as a serving role
without DDL privileges, checks at start-up that the tables hold every column it uses
(:func:`check_columns`). Revisions are **expand/contract**: a release only adds what the previous
release's code tolerates (new tables, nullable or defaulted columns), and removes what no running
release reads one release later, so old and new pods run side by side during a rollout.

A fresh database is brought to the head of its branch (``crm`` or ``ledger``); one that is already
current is left alone. A CRM database created before migrations existed (the first ``decisions``
table, no ``alembic_version``) is stamped at ``crm_0001`` and then upgraded. On PostgreSQL the
ledger lives in its own ``prediction`` schema, with its own ``alembic_version`` table there, so the
ledger and the CRM may share one database; each upgrade holds a transaction-scoped advisory lock,
so two jobs started together migrate one at a time.

To write a new revision (from the repository root)::

    python -c "from mlpair.prediction.recording.migrate import alembic_config; from alembic import command; \\
    command.revision(alembic_config(), 'what changed', head='crm@head')"
"""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from mlpair.prediction.recording.models import (
    LEDGER_SCHEMA,
    LEDGER_TABLE,
    AuditEntry,
    DecisionRecord,
    EventOutboxEntry,
    LedgerEntry,
    OutboxEntry,
    OutcomeEntry,
)

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
CRM_BRANCH = "crm"
LEDGER_BRANCH = "ledger"
_FIRST_CRM_REVISION = "crm_0001"
_ADVISORY_LOCK_KEY = 0x6D6C70616972  # "mlpair"


class SchemaNotReady(Exception):
    """A database lacks a table or column this release uses: ``mlpair migrate`` has not run."""


def alembic_config(version_table_schema: str | None = None) -> Config:
    """An Alembic config for ``migrations/`` with both version folders (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("path_separator", "os")
    config.set_main_option(
        "version_locations",
        os.pathsep.join(str(MIGRATIONS / "versions" / branch) for branch in (CRM_BRANCH, LEDGER_BRANCH)),
    )
    config.attributes["version_table_schema"] = version_table_schema
    return config


def ledger_schema(engine: AsyncEngine) -> str | None:
    """The schema of the ledger table: ``prediction`` on PostgreSQL, none on SQLite."""
    return None if engine.dialect.name == "sqlite" else LEDGER_SCHEMA


async def upgrade(engine: AsyncEngine, branch: str) -> None:
    """Upgrades the database behind ``engine`` to the head of ``branch`` (``crm`` or ``ledger``).

    Raises:
        sqlalchemy.exc.SQLAlchemyError, OSError: the database is unreachable or refuses the change.
    """
    schema = ledger_schema(engine) if branch == LEDGER_BRANCH else None
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _ADVISORY_LOCK_KEY})
        if schema is not None:  # Alembic writes its version table there before the first revision runs
            await conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        await conn.run_sync(_upgrade, branch, schema)


async def current_revision(engine: AsyncEngine, branch: str = CRM_BRANCH) -> str | None:
    """The revision the database is at on ``branch`` (None before any migration)."""
    schema = ledger_schema(engine) if branch == LEDGER_BRANCH else None
    async with engine.connect() as conn:
        if not await conn.run_sync(lambda c: inspect(c).has_table("alembic_version", schema=schema)):
            return None
        table = f'"{schema}".alembic_version' if schema else "alembic_version"
        return await conn.scalar(text(f"SELECT version_num FROM {table}"))


async def check_columns(engine: AsyncEngine, branch: str) -> None:
    """Checks that the branch's table has every column this release reads or writes, with a
    query that returns no row (so a serving role without DDL privileges can run it).

    Raises:
        SchemaNotReady: a table or column is missing (``mlpair migrate`` has not run).
        sqlalchemy.exc.SQLAlchemyError, OSError: the database is unreachable.
    """
    from sqlalchemy.exc import OperationalError, ProgrammingError

    if branch == LEDGER_BRANCH:
        schema = ledger_schema(engine)
        tables = [
            (f'"{schema}".{name}' if schema else name, entry.__table__.columns.keys())
            for name, entry in ((LEDGER_TABLE, LedgerEntry), (OutcomeEntry.__tablename__, OutcomeEntry))
        ]
        if schema:  # the relays' outbox is PostgreSQL's
            tables.append((f'"{schema}".{OutboxEntry.__tablename__}', OutboxEntry.__table__.columns.keys()))
    else:
        tables = [(DecisionRecord.__tablename__, DecisionRecord.__table__.columns.keys())]
    table = tables[0][0]
    try:
        async with engine.connect() as conn:
            for table, columns in tables:
                await conn.execute(text(f"SELECT {', '.join(columns)} FROM {table} WHERE 1 = 0"))
    except (ProgrammingError, OperationalError) as exc:
        # a missing relation or column is a ProgrammingError on PostgreSQL, an OperationalError on SQLite;
        # an unreachable server is an OperationalError without a SQL statement's "no such" wording
        message = str(exc.orig).lower()
        if any(
            hint in message
            for hint in ("does not exist", "no such table", "no such column", "undefined", "permission denied")
        ):
            raise SchemaNotReady(
                f"the {branch} database at {engine.url.render_as_string()} lacks the "
                f"{table} table or columns this release uses: run `mlpair migrate` with the same "
                f"{branch} URL (--{branch}-url / PREDICTION_{branch.upper()}_URL)"
            ) from exc
        raise


async def grant_serving_role(engine: AsyncEngine, branch: str, role: str) -> None:
    """Grants ``role`` exactly what PredictionService uses, and nothing that changes the schema:
    on the ledger SELECT, INSERT and UPDATE (never DELETE), on its outcomes SELECT and INSERT, on its outbox SELECT, INSERT, UPDATE and
    DELETE (a claim locks rows, takes part of one, and deletes what it delivered), on the audit records SELECT, INSERT and DELETE
    (retention), on the event outbox SELECT, INSERT and DELETE, on the CRM SELECT and INSERT, and SELECT on the version
    table (PostgreSQL only; SQLite has no roles).

    Raises:
        ValueError: ``role`` is not a plain identifier.
        sqlalchemy.exc.SQLAlchemyError: the role does not exist, or the database refused.
    """
    if engine.dialect.name != "postgresql":
        return
    if not role.replace("_", "").isalnum():
        raise ValueError(f"serving role {role!r} is not a plain SQL identifier")
    if branch == LEDGER_BRANCH:
        statements = [
            f'GRANT USAGE ON SCHEMA "{LEDGER_SCHEMA}" TO "{role}"',
            f'GRANT SELECT, INSERT, UPDATE ON "{LEDGER_SCHEMA}".{LEDGER_TABLE} TO "{role}"',
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{LEDGER_SCHEMA}".{OutboxEntry.__tablename__} TO "{role}"',
            f'GRANT SELECT, INSERT ON "{LEDGER_SCHEMA}".{OutcomeEntry.__tablename__} TO "{role}"',
            f'GRANT SELECT, INSERT, DELETE ON "{LEDGER_SCHEMA}".{AuditEntry.__tablename__} TO "{role}"',
            f'GRANT SELECT, INSERT, DELETE ON "{LEDGER_SCHEMA}".{EventOutboxEntry.__tablename__} TO "{role}"',
            f'GRANT USAGE ON ALL SEQUENCES IN SCHEMA "{LEDGER_SCHEMA}" TO "{role}"',
            f'GRANT SELECT ON "{LEDGER_SCHEMA}".alembic_version TO "{role}"',
        ]
    else:
        statements = [
            f'GRANT SELECT, INSERT ON {DecisionRecord.__tablename__} TO "{role}"',
            f'GRANT SELECT ON alembic_version TO "{role}"',
        ]
    async with engine.begin() as conn:
        for statement in statements:
            await conn.execute(text(statement))


def _upgrade(connection: Connection, branch: str, schema: str | None) -> None:
    config = alembic_config(schema)
    config.attributes["connection"] = connection
    tables = set(inspect(connection).get_table_names())
    if branch == CRM_BRANCH and "decisions" in tables and "alembic_version" not in tables:
        command.stamp(config, _FIRST_CRM_REVISION)
    command.upgrade(config, f"{branch}@head")
