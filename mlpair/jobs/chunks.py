"""One chunk of a batch-scoring job: request ids derived from the job id and each row's key, and
the chunk's trip through ``PredictColumns``.

Why derived ids make a rerun safe: PredictionService records each decision in its ledger under the
request id, once, and answers a request id it has on record with the recorded decision
(``replayed``) instead of deciding again. A job that derives each row's request id from its own id
and the row's key sends the same ids when it runs again (after a crash, a kill, a refused chunk),
so rows decided before come back replayed, identical, and only the rest are decided now: nothing
is decided twice, whichever chunks ran before.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import TYPE_CHECKING, Any

import grpc
import pyarrow as pa
import pyarrow.compute as pc

from mlpair.client.tables import DECISION_SCHEMA, ChunkError

if TYPE_CHECKING:
    from mlpair.client import PredictionClient

MAX_REQUEST_ID_CHARS = 128
"""The longest request id sent as ``f"{job_id}:{key}"``; a longer one is shortened (:func:`request_ids`)."""

KEY_DIGEST_HEX = 32
"""Hex characters of the key's SHA-256 in a shortened request id."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


RETRYABLE_ROW_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})
"""A row's own error that says "not now" (InferenceService unavailable, the deadline spent): the
row was not decided or recorded, and the same row sent again is decided."""


class RowsNotDecided(grpc.RpcError):
    """Rows of a chunk the service could not decide now (e.g. ``INFERENCE_UNAVAILABLE``): nothing of
    them was recorded. A ``grpc.RpcError`` with their status code, so a job retries the chunk as it
    retries a failed stream (the rows decided meanwhile come back replayed), and stops after its
    retries with the chunk left to a rerun, never kept as finished with undecided rows."""

    def __init__(self, rows: int, code: str, reason: str) -> None:
        super().__init__(f"{rows} row(s) not decided now: {code} {reason}")
        self.rows, self._code, self.reason = rows, code, reason

    def __reduce__(self) -> tuple[type, tuple[int, str, str]]:
        """Pickled as its own arguments (an engine's worker hands it to the driver)."""
        return RowsNotDecided, (self.rows, self._code, self.reason)

    def code(self) -> grpc.StatusCode:
        """The rows' status code (e.g. ``UNAVAILABLE``), as a ``grpc.StatusCode``, by which a job decides to retry."""
        return grpc.StatusCode[self._code]

    def details(self) -> str:
        """How many rows were not decided and why, and that nothing of them was recorded."""
        return f"{self.rows} row(s) of the chunk not decided now ({self.reason}); nothing of them recorded"


class ChunkRefused(Exception):
    """PredictionService refused a chunk as a whole: nothing of it was decided or recorded.

    Attributes:
        error: the service's :class:`~mlpair.client.tables.ChunkError` (status code, message,
            ErrorInfo reason and metadata, e.g. ``column`` or the row limit).
        first_key: the key of the chunk's first row (where a rerun will start again), or None.
    """

    def __init__(self, error: ChunkError, first_key: object = None) -> None:
        self.error = error
        self.first_key = first_key
        super().__init__(describe_refusal(error, first_key))

    def __reduce__(self) -> tuple[type, tuple[ChunkError, object]]:
        """Pickled as its own arguments, so it crosses from an engine's worker to the driver whole
        (``Exception`` would unpickle it by calling ``__init__`` with its message alone)."""
        return ChunkRefused, (self.error, self.first_key)


def describe_refusal(error: ChunkError, first_key: object = None) -> str:
    """One line naming why a chunk was refused: status, reason, message and the ErrorInfo metadata
    (the column or the limit), and the chunk's first key when known."""
    details = ", ".join(f"{name}={value}" for name, value in sorted(error.metadata.items()))
    where = f" (chunk starting at key {first_key!r})" if first_key is not None else ""
    reason = f" {error.reason}" if error.reason else ""
    extra = f" [{details}]" if details else ""
    return f"chunk refused{where}: {error.code.name}{reason}: {error.message}{extra}"


def check_job_id(job_id: str) -> None:
    """Checks that ``job_id`` can prefix request ids.

    Raises:
        ValueError: it is empty, holds a control character, or is too long to leave room for a key
            digest (more than ``MAX_REQUEST_ID_CHARS - KEY_DIGEST_HEX - 1`` characters).
    """
    limit = MAX_REQUEST_ID_CHARS - KEY_DIGEST_HEX - 1
    if not job_id or len(job_id) > limit or _CONTROL.search(job_id):
        raise ValueError(f"job id {job_id!r}: expected 1 to {limit} printable characters")


def request_id_for(job_id: str, key: str) -> str:
    """The request id of the row keyed ``key`` in job ``job_id``.

    ``f"{job_id}:{key}"``, unless that is longer than :data:`MAX_REQUEST_ID_CHARS` characters or
    holds a control character: then ``f"{job_id}:"`` followed by the first :data:`KEY_DIGEST_HEX`
    hex digits of the SHA-256 of the key's UTF-8 bytes. Deterministic: the same job and key give the
    same id in every run, process and engine.

    Raises:
        ValueError: ``job_id`` cannot prefix request ids (:func:`check_job_id`).
    """
    check_job_id(job_id)
    plain = f"{job_id}:{key}"
    if len(plain) <= MAX_REQUEST_ID_CHARS and not _CONTROL.search(plain):
        return plain
    return f"{job_id}:" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:KEY_DIGEST_HEX]


def request_ids(job_id: str, keys: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Each row's request id (utf8, one per key, in order), by :func:`request_id_for` (computed
    on the whole array; only the keys that need a digest are hashed one by one).

    Args:
        job_id: the job's id (the same on every rerun of the job).
        keys: the rows' keys, of any type pyarrow casts to utf8 (a number key's text is its
            decimal form).

    Raises:
        ValueError: ``job_id`` cannot prefix request ids (:func:`check_job_id`), a key is null, or
            the keys repeat (two rows would share one request id, and the second would be refused
            as a duplicate).
    """
    check_job_id(job_id)
    text = keys.cast(pa.string())
    if isinstance(text, pa.ChunkedArray):
        text = text.combine_chunks()
    if text.null_count:
        raise ValueError(f"the key column has {text.null_count} null value(s): every row needs a key")
    prefix = f"{job_id}:"
    plain = pc.binary_join_element_wise(pa.scalar(prefix), text, "")
    too_long = pc.greater(pc.utf8_length(plain), MAX_REQUEST_ID_CHARS)
    control = pc.match_substring_regex(text, r"[\x00-\x1f\x7f-\x9f]")
    digest = pc.or_(too_long, control)
    if pc.any(digest).as_py():
        hashed = [
            request_id_for(job_id, key) if flag else None
            for key, flag in zip(text.to_pylist(), digest.to_pylist(), strict=True)
        ]
        plain = pc.if_else(digest, pa.array(hashed, pa.string()), plain)
    if len(plain) and pc.count_distinct(plain).as_py() != len(plain):
        raise ValueError("the key column repeats a key within one chunk: each row needs its own key")
    return plain


def request_chunk(table: pa.Table, *, job_id: str, key_column: str, entity_column: str | None = None) -> pa.Table:
    """``table`` as a ``PredictColumns`` chunk: ``request_id`` (from the job id and the key),
    ``entity_id`` (the entity column as utf8, default the key column), then the attribute columns:
    every other column (the key and entity columns are not sent as attributes; a column the family
    does not know comes back as a warning, its values ignored).

    Raises:
        KeyError: ``key_column`` or ``entity_column`` is not a column of ``table``.
        ValueError: a null or repeated key (:func:`request_ids`), a null entity, or a key column
            named as a decision column (``request_id``, ``decision``, …).
    """
    if key_column in DECISION_SCHEMA.names:
        raise ValueError(f"the key column may not be named {key_column!r} (a decision column's name): rename it")
    for column in (key_column, entity_column):
        if column is not None and column not in table.column_names:
            raise KeyError(f"no column {column!r} (columns: {', '.join(table.column_names)})")
    entity = table.column(entity_column or key_column).cast(pa.string())
    if entity.null_count:
        raise ValueError(f"the entity column {entity_column or key_column!r} has null values: every row needs one")
    ids = request_ids(job_id, table.column(key_column))
    skip = {key_column, entity_column, "request_id", "entity_id"}
    attributes = [name for name in table.column_names if name not in skip]
    columns: list[Any] = [ids, entity] + [table.column(name) for name in attributes]
    return pa.Table.from_arrays(columns, names=["request_id", "entity_id", *attributes])


def decide_chunk(
    client: PredictionClient,
    table: pa.Table,
    *,
    job_id: str,
    key_column: str,
    entity_column: str | None,
    model_name: str,
    timeout_s: float | None = None,
    warnings: set[str] | None = None,
) -> pa.Table:
    """Decides one chunk of a job through ``PredictColumns`` (one stream, one chunk).

    Args:
        client: a :class:`~mlpair.client.PredictionClient`.
        table: the chunk's rows: ``key_column``, optionally ``entity_column``, and one column per
            attribute, named as the family's feature schema names it (``mlpair attributes``).
        job_id: the job's id; with each key it gives the row's request id (:func:`request_ids`).
        key_column: the column that identifies a row within the job (unique, never null).
        entity_column: the entity decided about; None = the key column.
        model_name: the model family (e.g. ``credit-risk``).
        timeout_s: the chunk's deadline in seconds; None = the client's.
        warnings: where to add the service's warnings about the chunk's columns, one line each
            (``UNKNOWN_ATTRIBUTE Incme: …``: a column the family's schema does not know, ignored);
            None = drop them.

    Returns:
        The key column followed by the columns of :data:`~mlpair.client.tables.DECISION_SCHEMA`,
        one row per input row, in order; a row's own error is in ``error_code``/``error_reason``/
        ``error_message`` (its decision columns null).

    Raises:
        ChunkRefused: the service refused the chunk as a whole (nothing decided; the message names
            the column or the limit).
        KeyError, ValueError: the chunk cannot be built (:func:`request_chunk`); nothing was sent.
        grpc.RpcError: the stream itself failed (UNAVAILABLE, DEADLINE_EXCEEDED, …), or rows were not
            decided now (:class:`RowsNotDecided`); retry.
    """
    chunk = request_chunk(table, job_id=job_id, key_column=key_column, entity_column=entity_column)
    results = list(client.predict_columns([chunk], model_name, timeout_s=timeout_s))
    if len(results) != 1:
        raise RuntimeError(f"PredictColumns answered {len(results)} chunks to one")
    decisions = decisions_with_key(results[0], table.column(key_column), key_column)
    if warnings is not None:
        warnings.update(f"{code} {name}: {message}".replace("  ", " ") for code, name, message in results[0].warnings)
    codes = decisions.column("error_code")
    if codes.null_count < len(codes):
        later = pc.is_in(codes, pa.array(sorted(RETRYABLE_ROW_CODES)))
        if (n := pc.sum(later).as_py() or 0) > 0:
            first = decisions.filter(later).slice(0, 1).to_pylist()[0]
            raise RowsNotDecided(n, first["error_code"], first["error_reason"] or "")
    return decisions


RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Stream failures (and rows not decided now, :class:`RowsNotDecided`) a chunk is sent again after:
the same request ids, so nothing is decided twice."""

RETRIES = 3
"""Tries after the first, waiting 0.5 s doubled each time (at most 5 s)."""


def decide_chunk_retrying(client: PredictionClient, table: pa.Table, **chunk: Any) -> pa.Table:
    """:func:`decide_chunk` (``chunk``: its keyword arguments), sent again with the same request ids
    after a :data:`RETRYABLE` status, up to :data:`RETRIES` times.

    Raises:
        grpc.RpcError: a status that is not retryable, or one still failing after the retries;
            otherwise as :func:`decide_chunk`.
    """
    for attempt in range(RETRIES + 1):
        try:
            return decide_chunk(client, table, **chunk)
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE or attempt == RETRIES:
                raise
            time.sleep(min(0.5 * 2**attempt, 5.0))
    raise AssertionError("unreachable")


def decisions_with_key(result: Any, keys: pa.Array | pa.ChunkedArray, key_column: str) -> pa.Table:
    """A :class:`~mlpair.client.tables.ChunkResult`'s decisions with the chunk's key column first.

    Raises:
        ChunkRefused: the result is a refusal of the whole chunk.
        RuntimeError: the service answered another number of rows than it was sent.
    """
    first_key = keys[0].as_py() if len(keys) else None
    if result.error is not None:
        raise ChunkRefused(result.error, first_key)
    decisions: pa.Table = result.decisions.select(DECISION_SCHEMA.names).cast(DECISION_SCHEMA)
    if decisions.num_rows != len(keys):
        raise RuntimeError(f"PredictColumns answered {decisions.num_rows} rows to a chunk of {len(keys)}")
    return decisions.add_column(0, key_column, keys)
