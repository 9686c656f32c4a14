"""Tables of requests and decisions as Arrow columns: ``PredictColumns`` from Python (pyarrow).

A table of applicants (``request_id``, ``entity_id`` and one column per attribute) goes to
PredictionService in chunks, each one Arrow IPC stream in a ``PredictColumnsRequest``; each chunk's
decisions come back as one table of :data:`DECISION_SCHEMA` (:class:`ChunkResult`). A chunk may be
what a data team holds (:func:`as_table`): a ``pyarrow.Table`` or ``RecordBatch``, a pandas
DataFrame, or anything that exports an Arrow stream (``__arrow_c_stream__``: Polars, pandas 2.2 and
later, DuckDB relations).

Both ends use this module: the service reads request chunks and writes decision chunks with it,
so the columns are defined once.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import pyarrow as pa
from google.rpc import error_details_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb

ID_COLUMNS = ("request_id", "entity_id")
"""The two columns every request chunk carries (utf8, one per row); the rest are attributes."""

DECISION_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("decision_id", pa.string()),
        ("decision", pa.string()),
        ("probability", pa.float64()),
        ("reason_codes", pa.list_(pa.string())),
        ("model_version", pa.string()),
        ("feature_schema_version", pa.string()),
        ("policy_version", pa.string()),
        ("served_from", pa.string()),
        ("decided_at", pa.timestamp("us", tz="UTC")),
        ("replayed", pa.bool_()),
        ("error_code", pa.string()),
        ("error_reason", pa.string()),
        ("error_message", pa.string()),
    ]
)
"""One row per request row, in request order: a decision (``error_code`` null) or that row's own
error (the decision columns null). ``probability`` is null for a decision made without one (the
policy's fallback); ``served_from``: ``inference``, ``cache``, ``stale_cache`` or ``fallback``."""


def to_ipc(table: pa.Table | pa.RecordBatch) -> bytes:
    """``table`` as one Arrow IPC stream (schema, then its record batches)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    """An Arrow IPC stream's table (its record batches, read without copying their buffers).

    Raises:
        pyarrow.ArrowInvalid: the bytes are not an Arrow IPC stream.
    """
    with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
        return reader.read_all()


@dataclass(frozen=True)
class ChunkError:
    """A chunk refused as a whole (nothing of it decided): the status and its ErrorInfo."""

    code: grpc.StatusCode
    message: str
    reason: str
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkResult:
    """One chunk's answer, in the order the chunks were sent.

    Attributes:
        chunk_id: the chunk's number in the stream (from 0).
        decisions: a ``pyarrow.Table`` of :data:`DECISION_SCHEMA`, one row per request row in
            request order (``decisions.to_pandas()`` for a DataFrame): each row a decision, or that
            row's own error in ``error_code``/``error_reason``/``error_message`` with the decision
            columns null; None when the chunk was refused whole.
        error: why the chunk was refused whole (nothing of it decided), or None.
        decided, replayed, failed: the rows decided now, replayed from the ledger (their request id
            was on record), and failed on their own.
        warnings: (code, field, message) about the chunk's columns, e.g. ``UNKNOWN_ATTRIBUTE`` for a
            column the family's schema does not know (its values ignored).
    """

    chunk_id: int
    decisions: pa.Table | None
    error: ChunkError | None
    decided: int = 0
    replayed: int = 0
    failed: int = 0
    warnings: tuple[tuple[str, str, str], ...] = ()


def as_table(chunk: Any, n: int = 0) -> pa.Table | pa.RecordBatch:
    """``chunk`` as Arrow: a ``pyarrow.Table`` or ``RecordBatch`` as it is, a pandas DataFrame by
    ``pyarrow.Table.from_pandas(df, preserve_index=False)`` (its index is not a column), anything
    with ``__arrow_c_stream__`` (Polars, DuckDB) by ``pyarrow.table``.

    Raises:
        TypeError: any other type (named, with the chunk's number ``n``).
    """
    if isinstance(chunk, pa.Table | pa.RecordBatch):
        return chunk
    pandas = sys.modules.get("pandas")  # never imported here: a DataFrame exists only once it is
    if pandas is not None and isinstance(chunk, pandas.DataFrame):
        return pa.Table.from_pandas(chunk, preserve_index=False)
    if hasattr(chunk, "__arrow_c_stream__"):
        return pa.table(chunk)
    kind = f"{type(chunk).__module__}.{type(chunk).__qualname__}".removeprefix("builtins.")
    raise TypeError(
        f"PredictColumns chunk {n} is a {kind}: expected a pyarrow Table or RecordBatch, a pandas DataFrame "
        "or an object with __arrow_c_stream__ (Polars, DuckDB)"
    )


def _is_one_table(chunks: object) -> bool:
    return isinstance(chunks, pa.Table | pa.RecordBatch) or hasattr(chunks, "__arrow_c_stream__")


class ChunkRequests:
    """The ``PredictColumnsRequest`` stream of ``chunks``, each converted by :func:`as_table`.

    The first chunk is converted when this is made, so a chunk of a wrong type fails the call itself
    before any stream starts. A later chunk that cannot be converted ends the stream there (the
    chunks before it are answered) and is kept in :attr:`error` for the caller to raise after their
    results, rather than failing the stream as gRPC's UNKNOWN "Exception iterating requests!".

    Raises:
        TypeError: ``chunks`` is one table rather than an iterable of them, is not iterable, or its
            first chunk is of a type :func:`as_table` does not take.
    """

    def __init__(self, chunks: Iterable[Any], model_name: str = "") -> None:
        if _is_one_table(chunks) or type(chunks).__name__ == "DataFrame":
            raise TypeError(
                f"predict_columns takes an iterable of chunks, got one {type(chunks).__name__}: "
                "cut it with mlpair.client.tables.slices(table, 10_000), or pass [table]"
            )
        self.model_name = model_name
        self.error: Exception | None = None
        self._chunks = iter(chunks)
        self._first = next(self._chunks, None)
        self._first_table = None if self._first is None else as_table(self._first, 0)

    def __iter__(self) -> Iterator[pb.PredictColumnsRequest]:
        if self._first_table is None:
            return
        yield pb.PredictColumnsRequest(model_name=self.model_name, arrow_ipc=to_ipc(self._first_table), chunk_id=0)
        self._first_table = None
        for n, chunk in enumerate(self._chunks, 1):
            try:
                data = to_ipc(as_table(chunk, n))
            except Exception as exc:  # noqa: BLE001  raised to the caller after the answered chunks
                self.error = exc
                return
            yield pb.PredictColumnsRequest(model_name=self.model_name, arrow_ipc=data, chunk_id=n)

    def results(self, replies: Iterable[pb.PredictColumnsResponse]) -> Iterator[ChunkResult]:
        """Each of the stream's replies as a :class:`ChunkResult`, then the chunk that could not be
        converted (:attr:`error`), raised.

        Raises:
            TypeError: a chunk after the first of a type :func:`as_table` does not take.
        """
        yield from map(chunk_result, replies)
        if self.error is not None:
            raise self.error

    async def async_results(
        self, call: Callable[[], AsyncIterable[pb.PredictColumnsResponse]]
    ) -> AsyncIterator[ChunkResult]:
        """:meth:`results` of the ``grpc.aio`` stream ``call()`` starts (on the first iteration)."""
        async for reply in call():
            yield chunk_result(reply)
        if self.error is not None:
            raise self.error


def request_chunks(
    chunks: Iterable[pa.Table | pa.RecordBatch], model_name: str = "", first_chunk_id: int = 0
) -> Iterator[pb.PredictColumnsRequest]:
    """One ``PredictColumnsRequest`` per table of ``chunks``, numbered from ``first_chunk_id``."""
    for n, chunk in enumerate(chunks, first_chunk_id):
        yield pb.PredictColumnsRequest(model_name=model_name, arrow_ipc=to_ipc(chunk), chunk_id=n)


def chunk_result(reply: pb.PredictColumnsResponse) -> ChunkResult:
    """A ``PredictColumnsResponse`` read into a :class:`ChunkResult`."""
    warnings = tuple((w.code, w.field, w.message) for w in reply.warnings)
    if reply.HasField("error"):
        info = error_details_pb2.ErrorInfo()
        found = any(d.Unpack(info) for d in reply.error.details)
        code = next((c for c in grpc.StatusCode if c.value[0] == reply.error.code), grpc.StatusCode.UNKNOWN)
        error = ChunkError(code, reply.error.message, info.reason, dict(info.metadata) if found else {})
        return ChunkResult(reply.chunk_id, None, error, warnings=warnings)
    decisions = from_ipc(reply.arrow_ipc)
    return ChunkResult(reply.chunk_id, decisions, None, reply.decided, reply.replayed, reply.failed, warnings)


def slices(table: Any, rows: int) -> Iterator[pa.Table]:
    """``table`` (anything :func:`as_table` takes: a ``pyarrow.Table``, a pandas DataFrame, a Polars
    one) cut into consecutive tables of at most ``rows`` rows (zero-copy slices of its Arrow form).

    Raises:
        TypeError: a type :func:`as_table` does not take.
    """
    table = as_table(table)
    for start in range(0, table.num_rows, rows):
        yield table.slice(start, rows)
