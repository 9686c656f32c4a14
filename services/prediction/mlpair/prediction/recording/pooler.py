"""Finds, at start, a connection pooler that breaks the prepared statements asyncpg caches.

PgBouncer in transaction mode (before 1.21, or with ``max_prepared_statements = 0``) hands each
transaction of a client whichever server connection is free: a statement asyncpg prepared in
one transaction and runs again in a later one is then missing on the server connection it
reaches (``prepared statement "__asyncpg_stmt_…__" does not exist``), or two clients collide on
one name, and nearly every ledger commit fails (DECISION_NOT_RECORDED) with nothing at start
saying why. The fix is ``statement_cache_size = 0`` for that database
(:func:`mlpair.prediction.recording.store.make_engine`, :class:`~mlpair.prediction.recording.ledger_postgres.PostgresLedger`).

:func:`check_prepared_statements` tries exactly that failure once: a statement prepared in one
transaction, its server connection then taken by a second client's open transaction, and the
statement run again. A direct PostgreSQL connection keeps its own backend, so the statement
runs; a pooler that re-prepares statements for its clients (PgBouncer ≥ 1.21 with
``max_prepared_statements``) runs it too; a pooler that does not fails it, and start-up is refused
naming the setting. The check is one-sided: when the pooler gives the second client another
server connection (round-robin, other clients), nothing is concluded and start-up goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy import make_url

from mlpair.startup import StartupError

logger = logging.getLogger(__name__)

_UNREACHABLE = (OSError, TimeoutError, asyncio.TimeoutError)


async def check_prepared_statements(url: str, *, setting: str, what: str, timeout_s: float) -> None:
    """Refuses a database whose pooler loses prepared statements between transactions.

    Args:
        url: the database's SQLAlchemy URL (PostgreSQL; the driver part is ignored).
        setting: the environment variable that turns the statement cache off, e.g.
            ``PREDICTION_LEDGER_STATEMENT_CACHE_SIZE``; named in the refusal.
        what: the database in words, e.g. ``the decision ledger``.
        timeout_s: connect and statement timeout, in seconds.

    Raises:
        StartupError: the statement prepared in one transaction is missing in the next, where a
            second client holds its server connection (one line naming ``setting``). A database
            that cannot be reached, or a check that cannot conclude, raises nothing (the ledger's
            health reports an unreachable database).
    """
    import asyncpg

    parsed = make_url(url)
    dsn = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
    where = f"{parsed.host or 'localhost'}:{parsed.port or 5432}/{parsed.database or ''}"
    connections: list[asyncpg.Connection] = []
    try:
        owner = await asyncpg.connect(dsn, timeout=timeout_s, statement_cache_size=0)
        connections.append(owner)
        async with owner.transaction():
            server = await owner.fetchval("SELECT pg_backend_pid()", timeout=timeout_s)
            # named, as asyncpg names every statement its cache keeps (``__asyncpg_stmt_N__``)
            statement = await owner.prepare("SELECT pg_backend_pid()", name=True, timeout=timeout_s)
        holder = await asyncpg.connect(dsn, timeout=timeout_s, statement_cache_size=0)
        connections.append(holder)
        held = holder.transaction()
        await held.start()
        if await holder.fetchval("SELECT pg_backend_pid()", timeout=timeout_s) != server:
            return  # the statement's server connection is still the owner's (direct) or free: no conclusion
        try:
            await statement.fetchval(timeout=timeout_s)
        except (asyncpg.InvalidSQLStatementNameError, asyncpg.DuplicatePreparedStatementError) as exc:
            raise StartupError(
                f"{what} at {where} is behind a pooler in transaction mode that does not keep prepared "
                f"statements ({type(exc).__name__}: a statement prepared in one transaction is gone in the "
                f"next); set {setting}=0, or let the pooler keep them (PgBouncer 1.21+ max_prepared_statements)"
            ) from exc
    except StartupError:
        raise
    except (*_UNREACHABLE, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        logger.debug("prepared-statement check of %s at %s not concluded: %r", what, where, exc)
    finally:
        for connection in reversed(connections):
            try:
                await asyncio.wait_for(connection.close(), timeout_s)
            except Exception:  # noqa: BLE001 - a connection that does not close cleanly is dropped
                with contextlib.suppress(Exception):
                    connection.terminate()


async def check_poolers(settings) -> None:
    """:func:`check_prepared_statements` for the ledger and the CRM database of ``settings``
    (:class:`~mlpair.prediction.settings.PredictionSettings`), each when it is PostgreSQL with its
    statement cache on.

    Raises:
        StartupError: as :func:`check_prepared_statements`.
    """
    if settings.ledger_url.startswith("postgresql") and settings.ledger_statement_cache_size > 0:
        await check_prepared_statements(
            settings.ledger_url,
            setting="PREDICTION_LEDGER_STATEMENT_CACHE_SIZE",
            what="the decision ledger",
            timeout_s=settings.ledger_timeout_ms / 1000,
        )
    if settings.crm_url.startswith("postgresql+asyncpg") and settings.crm_statement_cache_size > 0:
        await check_prepared_statements(
            settings.crm_url,
            setting="PREDICTION_CRM_STATEMENT_CACHE_SIZE",
            what="the CRM database",
            timeout_s=settings.crm_timeout_ms / 1000,
        )
