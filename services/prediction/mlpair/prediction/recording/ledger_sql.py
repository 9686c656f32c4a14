"""The PostgreSQL ledger's statements (``recording/ledger_postgres.py`` runs them; Alembic owns the
tables: ``prediction.decision_ledger`` and ``prediction.decision_outbox``, the relays' work list).

Each is one statement, atomic on its own. A group commit inserts its decisions and their outbox
rows together; a claim takes outbox rows (and first any row a release before ``ledger_0002``
left with ``delivered_at IS NULL``) and commits with the delivery.
"""

from __future__ import annotations

from mlpair.prediction.recording import ledger, packed
from mlpair.prediction.recording.models import (
    AUDIT_TABLE,
    EVENT_OUTBOX_TABLE,
    LEDGER_SCHEMA,
    LEDGER_TABLE,
    OUTBOX_TABLE,
)

TABLE = f'"{LEDGER_SCHEMA}".{LEDGER_TABLE}'
OUTBOX = f'"{LEDGER_SCHEMA}".{OUTBOX_TABLE}'
AUDIT = f'"{LEDGER_SCHEMA}".{AUDIT_TABLE}'
EVENT_OUTBOX = f'"{LEDGER_SCHEMA}".{EVENT_OUTBOX_TABLE}'
# delivered_at of the decisions this release records: "delivered through the outbox", so a relay of
# the previous release (WHERE delivered_at IS NULL) leaves them alone during a rollout
IN_OUTBOX = "'infinity'::timestamptz"
COLUMNS = ", ".join(ledger.DECISION_COLUMNS)
# each column's base type: an array cast to varchar(n) would truncate, while the assignment into
# the column refuses a value that is too long, as a row-by-row insert does
ARRAY_TYPES = (
    "text",
    "text",
    "text",
    "text",
    "text",
    "text",
    "text",
    "text",
    "float8",
    "text",
    "text",
    "text",
    "int4",
    "text",
    "timestamptz",
    "text",
)
_UNNEST = ", ".join(f"${k}::{t}[]" for k, t in enumerate(ARRAY_TYPES, start=1))
# The commit's outbox rows, in the insert's statement (atomic with it): one per OUTBOX_CHUNK
# decisions inserted, so several relays can claim parts of one large commit at once (a claim locks
# whole rows); none when nothing was new.
OUTBOX_CHUNK = 64
MIN_DECISIONS_PER_OUTBOX_ROW = 16  # what a claim's sizing assumes at the least (_outbox_rows)


def _queued(name: str, outbox: str) -> str:
    """The CTE ``name`` adding the commit's rows to ``outbox`` (one per ``OUTBOX_CHUNK`` inserted decisions)."""
    return (
        f"{name} AS (INSERT INTO {outbox} (seqs, n) SELECT array_agg(seq ORDER BY seq), count(*) FROM "
        f"(SELECT seq, (row_number() OVER (ORDER BY seq) - 1) / {OUTBOX_CHUNK} AS chunk FROM inserted) AS c "
        "GROUP BY chunk)"
    )


_QUEUED = _queued("queued", OUTBOX)
_AUDIT_PARAM = len(ARRAY_TYPES) + 1  # the audit records' parameter, after the decision columns


def _extras(ids: str, records: str | None, events: bool) -> str:
    """The commit's optional CTEs: the audit records of the decisions it inserted (``records``: SQL
    of a text array paired with ``ids``, the request ids), and their rows in the event outbox."""
    extra = ""
    if records is not None:
        extra += (
            f", audited AS (INSERT INTO {AUDIT} (seq, record) SELECT i.seq, a.record FROM "
            f"unnest({ids}, {records}) AS a(r, record) JOIN inserted i ON i.request_id = a.r WHERE a.record <> '')"
        )
    if events:
        extra += ", " + _queued("events_queued", EVENT_OUTBOX)
    return extra


def insert(*, audit: bool = False, events: bool = False) -> str:
    """The commit with each column an array parameter (:data:`ARRAY_TYPES`), and with ``audit`` the
    records as one more (``$17``); answers with the request ids it inserted."""
    records = f"${_AUDIT_PARAM}::text[]" if audit else None
    return (
        f"WITH inserted AS (INSERT INTO {TABLE} ({COLUMNS}, delivered_at) SELECT *, {IN_OUTBOX} FROM unnest({_UNNEST}) "
        f"ON CONFLICT (request_id) DO NOTHING RETURNING seq, request_id), {_QUEUED}"
        f"{_extras('$1::text[]', records, events)} SELECT request_id FROM inserted"
    )


INSERT = insert()
SELECT_RECORDED = f"SELECT {COLUMNS} FROM {TABLE} WHERE request_id = ANY($1::text[])"
# A relay's claim of $1 decisions: up to $2 of the oldest outbox rows no other relay holds, locked;
# in order, each that fits whole within $1 deleted, and of the first that does not, its first seqs
# taken and the rest left in it (an update of one narrow row); their decisions read by primary key.
# Commits with the delivery.
_TAKEN = (
    f"WITH locked AS (SELECT id, n, seqs FROM {OUTBOX} ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED), "
    "w AS (SELECT id, n, seqs, sum(n) OVER (ORDER BY id) - n AS before FROM locked), "
    "cut AS (SELECT id, $1 - before AS k FROM w WHERE before < $1 AND before + n > $1), "
    f"taken AS (DELETE FROM {OUTBOX} AS o USING w WHERE o.id = w.id AND w.before + w.n <= $1 RETURNING o.seqs), "
    f"kept AS (UPDATE {OUTBOX} AS o SET seqs = o.seqs[cut.k + 1:], n = o.n - cut.k FROM cut WHERE o.id = cut.id "
    "RETURNING o.id), "
    f"claimed AS (SELECT seq, {ledger.CLAIMED_COLUMNS} FROM {TABLE} WHERE seq = ANY(ARRAY("
    "SELECT unnest(seqs) FROM taken UNION ALL SELECT unnest(w.seqs[1:cut.k]) FROM w JOIN cut ON w.id = cut.id)) "
    "ORDER BY seq)"
)
# more: the locked rows held more than the claim took, or as many were locked as asked (more behind)
# and the outbox rows locked and their decisions, which size the next claim's $2
_MORE = (
    "((SELECT sum(n) FROM locked) > $1 OR (SELECT count(*) FROM locked) = $2), "
    "(SELECT count(*) FROM locked), (SELECT COALESCE(sum(n), 0) FROM locked)"
)
# A claim's statements are planned for each execution, with the tables' sizes of the moment: a
# prepared statement's generic plan, made while the ledger was small (a fresh database, the first
# claims), read the decisions by a sequential scan of the whole ledger once it had grown (3–5 s per
# claim at 200,000 rows, measured). SET LOCAL ends with the claim's transaction.
CUSTOM_PLANS = "SET LOCAL plan_cache_mode = force_custom_plan"
CLAIM_OUTBOX = f"{_TAKEN} SELECT *, {_MORE} FROM claimed ORDER BY seq"
# The previous release's rows (delivered_at IS NULL), claimed and marked one by one.
CLAIM = (
    f"SELECT seq, {ledger.CLAIMED_COLUMNS} FROM {TABLE} WHERE delivered_at IS NULL ORDER BY seq LIMIT $1 "
    "FOR UPDATE SKIP LOCKED"
)
MARK_DELIVERED = f"UPDATE {TABLE} SET delivered_at = now() WHERE seq = ANY($1::bigint[])"
# Decisions the CRM refused, back in the queue as an outbox row of their own, behind the others:
# inside the claim's transaction, so they stay undelivered exactly when the claim commits.
REQUEUE = (
    f"INSERT INTO {OUTBOX} (seqs, n) SELECT array_agg(seq ORDER BY seq), count(*) FROM {TABLE} "
    "WHERE request_id = ANY($1::text[]) HAVING count(*) > 0"
)
# The bulk path's insert: each column one packed text parameter (recording/packed.py), split and cast by
# PostgreSQL. It answers with the request ids it did not insert (on record already): none, one empty
# result, in the usual case, instead of a row per decision inserted, which cost client CPU per row.
_NAMES = ", ".join(f"c{k}" for k in range(len(ledger.DECISION_COLUMNS)))


def insert_packed(*, audit: bool = False, events: bool = False) -> str:
    """The commit with each column packed (``recording/packed.py``), and with ``audit`` the records
    packed as one more (``$17``); answers with the request ids already on record."""
    records = packed.unpacked(_AUDIT_PARAM) if audit else None
    return (
        f"WITH inserted AS (INSERT INTO {TABLE} ({COLUMNS}, delivered_at) SELECT "
        + ", ".join(packed.cast(f"c{k}", t) for k, t in enumerate(ARRAY_TYPES))
        + f", {IN_OUTBOX} FROM unnest("
        + ", ".join(packed.unpacked(k) for k in range(1, len(ARRAY_TYPES) + 1))
        + f") AS t({_NAMES}) ON CONFLICT (request_id) DO NOTHING RETURNING seq, request_id), {_QUEUED}"
        + _extras(packed.unpacked(1), records, events)
        + f" SELECT r FROM unnest({packed.unpacked(1)}) AS r WHERE r NOT IN (SELECT request_id FROM inserted)"
    )


INSERT_PACKED = insert_packed()
# A relay's claim, packed: one row of (count, one packed text per CRM column), no object per decision.
# The outbox rows are deleted (or the previous release's rows marked delivered) by the same statement,
# inside the claim's transaction: it commits only once the CRM has them, and a failed delivery rolls
# the claim back with it. `claimed` comes sorted by seq and the aggregates take its rows as they come
# (packed.packed_agg): one sort per claim, not one per column.
_CLAIMED_TYPES = dict(zip(ledger.DECISION_COLUMNS, ARRAY_TYPES))
_PACKED_COLUMNS = ", ".join(
    packed.packed_agg(packed.as_text(c, _CLAIMED_TYPES[c])) for c in ledger.CLAIMED_COLUMNS.split(", ")
)


def _packed_claimed(more: str) -> str:
    """The claimed decisions as one row: count, the ``more`` columns, one packed text per CRM column."""
    return f"SELECT count(*), {more}, {_PACKED_COLUMNS} FROM claimed"


CLAIM_OUTBOX_PACKED = f"{_TAKEN} {_packed_claimed(_MORE)}"
CLAIM_PACKED = (
    f"WITH claimed AS (SELECT seq, {ledger.CLAIMED_COLUMNS} FROM {TABLE} WHERE delivered_at IS NULL "
    "ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED), "
    f"marked AS (UPDATE {TABLE} AS l SET delivered_at = now() FROM claimed WHERE l.seq = claimed.seq) "
    + _packed_claimed("count(*) = $1")
)
# undelivered decisions (the outbox's, and the previous release's rows) and the age of the oldest
# of the two that the relays claim next
BACKLOG = (
    f"SELECT (SELECT count(*) FROM {TABLE} WHERE delivered_at IS NULL) + COALESCE((SELECT sum(n) FROM {OUTBOX}), 0), "
    f"GREATEST(COALESCE((SELECT extract(epoch FROM now() - recorded_at) FROM {TABLE} WHERE delivered_at IS NULL "
    f"ORDER BY seq LIMIT 1), 0), COALESCE((SELECT extract(epoch FROM now() - recorded_at) FROM {OUTBOX} "
    "ORDER BY id LIMIT 1), 0))"
)
# A rollback's last step (mlpair migrate --hand-back-outbox): the outbox's decisions back to the
# per-row work list of a release before ledger_0002: the rows up to $1 (the last when it started, so
# a pod still recording cannot keep it going), 100 a statement. FOR UPDATE waits for a claim in
# flight and then skips what it delivered, so nothing delivered is handed back.
HAND_BACK = (
    f"WITH handed AS (DELETE FROM {OUTBOX} WHERE id IN (SELECT id FROM {OUTBOX} WHERE id <= $1 ORDER BY id "
    "LIMIT 100 FOR UPDATE) "
    f"RETURNING seqs) UPDATE {TABLE} SET delivered_at = NULL WHERE seq IN (SELECT unnest(seqs) FROM handed)"
)
IMPORT = (
    f"INSERT INTO {TABLE} ({COLUMNS}, delivered_at) SELECT *, CASE WHEN ${len(ARRAY_TYPES) + 1} THEN now() END "
    f"FROM unnest({_UNNEST}) ON CONFLICT (request_id) DO NOTHING"
)
# One decision's audit record (``mlpair decision``), and retention: records older than $1 seconds,
# 10,000 a statement (a statement per batch keeps each transaction and its locks short).
SELECT_AUDIT = f"SELECT a.record FROM {AUDIT} a JOIN {TABLE} l ON l.seq = a.seq WHERE l.request_id = $1"
PRUNE_AUDIT = (
    f"DELETE FROM {AUDIT} WHERE seq IN (SELECT seq FROM {AUDIT} "
    "WHERE recorded_at < now() - make_interval(secs => $1) LIMIT 10000)"
)
# The event relay (recording/event_relay.py): up to $1 of the oldest event outbox rows no other relay
# holds, locked until the claim's transaction ends; their decisions with their audit records, by
# primary key; the rows deleted once the broker acknowledged every event.
CLAIM_EVENTS = f"SELECT id, seqs FROM {EVENT_OUTBOX} ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
EVENT_COLUMNS = (
    "decision_id, request_id, entity_id, caller, model_name, model_version, feature_schema_version, "
    "policy_version, probability, decision, reason_codes, served_from, cache_age_ms, degraded_reason"
)
EVENT_DECISIONS = (
    f"SELECT {', '.join('l.' + c for c in EVENT_COLUMNS.split(', '))}, "
    f"{packed.as_text('l.decided_at', 'timestamptz')}, a.record FROM {TABLE} l "
    f"LEFT JOIN {AUDIT} a ON a.seq = l.seq WHERE l.seq = ANY($1::bigint[]) ORDER BY l.seq"
)
DELETE_EVENTS = f"DELETE FROM {EVENT_OUTBOX} WHERE id = ANY($1::bigint[])"
EVENT_BACKLOG = (
    f"SELECT COALESCE(sum(n), 0), COALESCE((SELECT extract(epoch FROM now() - recorded_at) FROM {EVENT_OUTBOX} "
    f"ORDER BY id LIMIT 1), 0) FROM {EVENT_OUTBOX}"
)
