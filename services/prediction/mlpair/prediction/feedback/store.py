"""The ``decision_outcomes`` table beside the decision ledger: storing outcomes and joining them.

One outcome per decision, whichever path brought it (``RecordOutcomes`` or ``mlpair
outcomes-import``: both call :meth:`OutcomeStore.record`):

* **Idempotent.** The same label again for a decision is accepted and stored once (``duplicate``).
* **A conflict is refused per item.** Another label for a decision that has one is
  :class:`~.items.OutcomeConflict` (ALREADY_EXISTS, reason ``OUTCOME_CONFLICT``): an outcome is a
  fact, and which of two disagreeing facts is true is for a person to settle, not the last writer.
  The check runs after the insert, inside its transaction, so concurrent callers agree too.
* **Kept for a late join.** An outcome whose decision is not on record is stored (under its
  request id, or its entity id and time) and counted (``prediction_outcomes_total{result="unmatched"}``);
  the join finds its decision once it is recorded.

The store keeps its own small SQLAlchemy pool on the ledger database (the ledger's engines keep
theirs for decisions). Timestamps use the ledger's encodings (ISO text and Unix seconds on SQLite).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from sqlalchemy import ColumnElement, Table, and_, or_, select, tuple_, union_all
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from mlpair.prediction.errors import PredictionError, UnknownModel
from mlpair.prediction.feedback import metrics
from mlpair.prediction.feedback.items import FamilyLabels, OutcomeConflict, OutcomeItem, OutcomesUnavailable, invalid
from mlpair.prediction.recording.models import LEDGER_SCHEMA, LedgerEntry, OutcomeEntry
from mlpair.prediction.recording.store import make_engine

logger = logging.getLogger(__name__)

CHUNK = 1000  # outcomes per transaction
_O: Table = OutcomeEntry.__table__  # type: ignore[assignment]
_L: Table = LedgerEntry.__table__  # type: ignore[assignment]


@dataclass(frozen=True)
class Stored:
    """An accepted outcome: the request id of its decision ('' when named by entity and time and
    not on record yet), whether it was on record already, and whether its decision is."""

    request_id: str
    duplicate: bool
    decision_found: bool


@dataclass(frozen=True)
class Joined:
    """Decisions with their outcomes, as columns ``[n]``: family, model version, calibrated
    probability, recorded decision, and 1 where the outcome is the family's positive class."""

    model_name: np.ndarray
    model_version: np.ndarray
    probability: np.ndarray
    decision: np.ndarray
    positive: np.ndarray

    def groups(self) -> list[tuple[str, str, np.ndarray]]:
        """``(family, model version, row indices)`` per group, sorted."""
        keys = sorted(set(zip(self.model_name.tolist(), self.model_version.tolist())))
        return [(f, v, np.flatnonzero((self.model_name == f) & (self.model_version == v))) for f, v in keys]


class OutcomeStore:
    """Outcomes in the ledger database at ``url`` (migrated to ``ledger_0003`` by ``mlpair migrate``).

    Args:
        url: the ledger's SQLAlchemy URL (``sqlite+aiosqlite:///…`` or ``postgresql+asyncpg://…``).
        labels: each served family's class names (the label an outcome may carry).
        default_family: the family of an outcome that names none and whose decision is not on record.
        timeout_s: connect and statement timeout, in seconds.
    """

    def __init__(
        self, url: str, labels: Mapping[str, FamilyLabels], default_family: str, *, timeout_s: float = 10.0
    ) -> None:
        engine = make_engine(url, timeout_s=timeout_s)
        self.sqlite = engine.dialect.name == "sqlite"
        self.engine: AsyncEngine = (
            engine.execution_options(schema_translate_map={LEDGER_SCHEMA: None}) if self.sqlite else engine
        )
        self._owner = engine
        self.labels = dict(labels)
        self.default_family = default_family

    async def close(self) -> None:
        """Releases the connections."""
        await self._owner.dispose()

    def _at(self, value: datetime | None) -> Any:
        """A ``decided_at`` as the ledger stores it (ISO text on SQLite); None stays None."""
        return value.isoformat() if self.sqlite and value is not None else value

    def _seconds(self, value: datetime) -> Any:
        return value.timestamp() if self.sqlite else value

    async def record(self, items: Sequence[OutcomeItem | PredictionError]) -> list[Stored | PredictionError]:
        """Stores the well-formed items, :data:`CHUNK` per transaction; an error passed in stays that
        item's result.

        Returns:
            Per item, in order: :class:`Stored`, or its error (:class:`~.items.InvalidOutcome` for a
            label the family does not have or a family other than the decision's,
            :class:`~mlpair.prediction.errors.UnknownModel`, :class:`~.items.OutcomeConflict`).

        Raises:
            OutcomesUnavailable: the ledger database failed; the transaction of the chunk in progress
                stored nothing (earlier chunks are stored; sending all again is safe).
        """
        results: list[Stored | PredictionError] = list(items)  # type: ignore[arg-type]
        for start in range(0, len(items), CHUNK):
            try:
                async with self.engine.begin() as conn:
                    await self._record_chunk(conn, results, range(start, min(start + CHUNK, len(items))))
            except (SQLAlchemyError, OSError) as exc:
                logger.warning("outcomes not stored: the ledger database failed (%s)", type(exc).__name__)
                raise OutcomesUnavailable("the outcomes could not be stored; send them again") from exc
        for result in results:
            if isinstance(result, Stored):
                metrics.OUTCOMES.labels(
                    "duplicate" if result.duplicate else "stored" if result.decision_found else "unmatched"
                ).inc()
            else:
                metrics.OUTCOMES.labels("conflict" if isinstance(result, OutcomeConflict) else "refused").inc()
        return results

    async def _record_chunk(self, conn: AsyncConnection, results: list, span: range) -> None:
        todo = [i for i in span if isinstance(results[i], OutcomeItem)]
        items: dict[int, OutcomeItem] = {i: results[i] for i in todo}
        by_id = await self._decisions(conn, _L.c.request_id.in_({o.request_id for o in items.values() if o.request_id}))
        pairs = {(o.entity_id, self._at(o.decided_at)) for o in items.values() if not o.request_id and o.decided_at}
        by_entity = (
            {
                (row.entity_id, row.decided_at): row
                for row in (await self._decisions(conn, tuple_(_L.c.entity_id, _L.c.decided_at).in_(pairs))).values()
            }
            if pairs
            else {}
        )
        keys: dict[int, tuple] = {}
        rows: dict[tuple, dict] = {}  # key → the row to insert (first occurrence in this call)
        for i, item in items.items():
            decision = (
                by_id.get(item.request_id)
                if item.request_id
                else by_entity.get((item.entity_id, self._at(item.decided_at)))
            )
            family = item.model_name or (decision.model_name if decision else self.default_family)
            if family not in self.labels:
                results[i] = UnknownModel(
                    f"{item.where}: model family {family!r} is not served", metadata={"model_name": family}
                )
                continue
            if decision is not None and item.model_name and item.model_name != decision.model_name:
                results[i] = invalid(
                    item.where, "model_name", f"is not the family of its decision ({decision.model_name})"
                )
                continue
            known = self.labels[family]
            if item.label not in known.labels:
                results[i] = invalid(item.where, "label", f"must be one of {', '.join(known.labels)}")
                continue
            request_id = item.request_id or (decision.request_id if decision else "")
            key = ("r", request_id) if request_id else ("e", item.entity_id, self._at(item.decided_at))
            keys[i] = key
            rows.setdefault(
                key,
                {
                    "request_id": request_id or None,
                    "entity_id": None if request_id else item.entity_id,
                    "decided_at": None if request_id else self._at(item.decided_at),
                    "model_name": family,
                    "label": item.label,
                    "positive": int(item.label == known.positive),
                    "observed_at": self._seconds(item.observed_at),
                    "_found": decision is not None,
                },
            )
        if not rows:
            return
        before = await self._labels(conn, rows)
        new = [{k: v for k, v in row.items() if k != "_found"} for key, row in rows.items() if key not in before]
        if new:
            insert = (sqlite.insert if self.sqlite else postgresql.insert)(_O).on_conflict_do_nothing()
            await conn.execute(insert, new)
        after = await self._labels(conn, rows)  # what won, also against a concurrent writer
        inserted: set[tuple] = set()
        for i, key in keys.items():
            row, label = rows[key], after.get(key)
            if label != results[i].label:
                results[i] = OutcomeConflict(
                    f"{results[i].where}: another outcome ({label}) is on record for this decision",
                    metadata={"recorded_label": str(label)},
                )
                continue
            duplicate = key in before or key in inserted
            inserted.add(key)
            results[i] = Stored(row["request_id"] or "", duplicate, row["_found"])

    async def _decisions(self, conn: AsyncConnection, where) -> dict[str, Any]:
        rows = await conn.execute(
            select(_L.c.request_id, _L.c.entity_id, _L.c.decided_at, _L.c.model_name).where(where)
        )
        return {row.request_id: row for row in rows}

    async def _labels(self, conn: AsyncConnection, rows: Mapping[tuple, dict]) -> dict[tuple, str]:
        ids = [k[1] for k in rows if k[0] == "r"]
        pairs = [(k[1], k[2]) for k in rows if k[0] == "e"]
        conditions: list[ColumnElement[bool]] = [_O.c.request_id.in_(ids)] if ids else []
        if pairs:
            conditions.append(and_(_O.c.request_id.is_(None), tuple_(_O.c.entity_id, _O.c.decided_at).in_(pairs)))
        found = await conn.execute(
            select(_O.c.request_id, _O.c.entity_id, _O.c.decided_at, _O.c.label).where(or_(*conditions))
        )
        return {(("r", r.request_id) if r.request_id else ("e", r.entity_id, r.decided_at)): r.label for r in found}

    async def count(self) -> tuple[int, int]:
        """Outcomes on record, and how many of them no decision on record joins yet."""
        from sqlalchemy import func

        joined = (await self.joined(probabilities_only=False)).positive.size
        async with self.engine.connect() as conn:
            total = int(await conn.scalar(select(func.count()).select_from(_O)) or 0)
        return total, total - joined

    async def joined(self, since: datetime | None = None, *, probabilities_only: bool = True) -> Joined:
        """Every outcome joined with its decision (by request id, or by entity id and exact time),
        for decisions made at or after ``since`` (None: all); with ``probabilities_only`` only
        decisions with a model probability (a fallback decision has none)."""
        columns = (_L.c.model_name, _L.c.model_version, _L.c.probability, _L.c.decision, _O.c.positive)
        by_id = _O.join(_L, _L.c.request_id == _O.c.request_id)
        by_entity = _O.join(
            _L, and_(_O.c.request_id.is_(None), _L.c.entity_id == _O.c.entity_id, _L.c.decided_at == _O.c.decided_at)
        )
        conditions = []
        if since is not None:
            conditions.append(_L.c.decided_at >= self._at(since))
        if probabilities_only:
            conditions += [_L.c.probability.is_not(None), _L.c.model_version != ""]
        query = union_all(*(select(*columns).select_from(j).where(*conditions) for j in (by_id, by_entity)))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return Joined(
            np.array([r[0] for r in rows], dtype=object),
            np.array([r[1] for r in rows], dtype=object),
            np.array([np.nan if r[2] is None else r[2] for r in rows], dtype=np.float64),
            np.array([r[3] for r in rows], dtype=object),
            np.array([r[4] for r in rows], dtype=np.int8),
        )
