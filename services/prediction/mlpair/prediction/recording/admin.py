"""What ``mlpair migrate`` does: the pre-deploy step that owns PredictionService's schemas.

It runs with a schema-owner role (in Kubernetes, a Job before each rollout; docs/deployment.md):
upgrades the decision ledger and the CRM database to this release's heads, grants the serving
role exactly the privileges the services use (no DDL), and, once, when moving from per-pod
outboxes to the shared ledger, brings in the decisions recorded before the ledger existed — from
old outbox files and from the CRM — so that no retried request id is decided twice.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from sqlalchemy import select

from mlpair.prediction.recording.codecs import as_utc, from_json, from_record
from mlpair.prediction.recording.ledger import DecisionLedger, open_ledger
from mlpair.prediction.recording.migrate import CRM_BRANCH, LEDGER_BRANCH, grant_serving_role, upgrade
from mlpair.prediction.recording.models import DecisionRecord
from mlpair.prediction.recording.store import make_engine

IMPORT_BATCH = 5000  # decisions per import transaction
# statement timeout of the ledger's own steps here: the hand-back waits for claims in flight
ADMIN_TIMEOUT_S = 60.0


@dataclass
class MigrationReport:
    """What one run did: each database's revision, and decisions brought into the ledger."""

    revisions: dict[str, str] = field(default_factory=dict)
    granted_to: str | None = None
    imported_from_outboxes: int = 0
    backfilled_from_crm: int = 0
    handed_back: int = 0


async def migrate(
    ledger_url: str,
    crm_url: str,
    *,
    serving_role: str | None = None,
    import_outboxes: Sequence[Path] = (),
    backfill_from_crm: bool = False,
    hand_back_outbox: bool = False,
) -> MigrationReport:
    """Upgrades both databases (idempotent), grants ``serving_role``, and imports old decisions.

    Args:
        ledger_url, crm_url: SQLAlchemy URLs, connecting as the schema owner.
        serving_role: PostgreSQL role the services connect as; it gets SELECT, INSERT and UPDATE
            on the ledger, SELECT and INSERT on the CRM's decisions, and nothing else.
        import_outboxes: outbox files of the previous release (per-pod SQLite); every decision in
            them is added to the ledger (undelivered ones stay undelivered, for the relay).
        backfill_from_crm: add every CRM decision the ledger lacks, as delivered, so a retry of a
            request id decided before the ledger existed returns that decision.
        hand_back_outbox: give the decisions waiting in the PostgreSQL ledger's outbox back to the
            per-row work list (``delivered_at IS NULL``) that a release before ``ledger_0002``
            claims: a rollback's last step, once no pod of this release runs
            (docs/deployment.md, "Expand and contract").

    Raises:
        sqlalchemy.exc.SQLAlchemyError, OSError: a database is unreachable or refused a change.
        ValueError: ``serving_role`` is not a plain identifier.
    """
    from mlpair.prediction.recording.migrate import current_revision

    report = MigrationReport(granted_to=serving_role)
    for branch, url in ((LEDGER_BRANCH, ledger_url), (CRM_BRANCH, crm_url)):
        engine = make_engine(url)
        try:
            await upgrade(engine, branch)
            if serving_role:
                await grant_serving_role(engine, branch, serving_role)
            report.revisions[branch] = await current_revision(engine, branch) or ""
        finally:
            await engine.dispose()
    if import_outboxes or backfill_from_crm or hand_back_outbox:
        ledger = open_ledger(ledger_url, timeout_s=ADMIN_TIMEOUT_S)
        await ledger.open()
        try:
            for path in import_outboxes:
                report.imported_from_outboxes += await _import_outbox(ledger, path)
            if backfill_from_crm:
                report.backfilled_from_crm = await _backfill(ledger, crm_url)
            if hand_back_outbox:
                report.handed_back = await ledger.hand_back_outbox()
        finally:
            await ledger.close()
    return report


async def _import_outbox(ledger: DecisionLedger, path: Path) -> int:
    """Adds the decisions of one old outbox file (table ``outbox``: payload JSON, delivered_at)."""
    if not path.is_file():
        raise FileNotFoundError(f"no outbox file at {path}")
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT payload, delivered_at IS NOT NULL FROM outbox ORDER BY seq").fetchall()
    added = 0
    for delivered in (True, False):
        decisions = [from_json(payload) for payload, done in rows if bool(done) is delivered]
        for start in range(0, len(decisions), IMPORT_BATCH):
            added += await ledger.import_decisions(decisions[start : start + IMPORT_BATCH], delivered=delivered)
    return added


async def _backfill(ledger: DecisionLedger, crm_url: str) -> int:
    """Adds every CRM decision the ledger lacks, in request id order, a batch at a time."""
    engine = make_engine(crm_url)
    added, after = 0, ""
    try:
        while True:
            async with engine.connect() as conn:
                records = (
                    await conn.execute(
                        select(DecisionRecord)
                        .where(DecisionRecord.request_id > after)
                        .order_by(DecisionRecord.request_id)
                        .limit(IMPORT_BATCH)
                    )
                ).all()
            if not records:
                return added
            decisions = [from_record(r) for r in records]
            # rows from before decided_at existed (crm_0001) count from when they were written
            decisions = [
                d if d.decided_at else replace(d, decided_at=as_utc(r.created_at)) for d, r in zip(decisions, records)
            ]
            added += await ledger.import_decisions(decisions, delivered=True)
            after = records[-1].request_id
    finally:
        await engine.dispose()
