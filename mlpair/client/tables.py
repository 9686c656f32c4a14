"""Tables of requests and decisions as Arrow columns: ``PredictColumns`` from Python (pyarrow).

A table of applicants (a ``pyarrow.Table`` or ``RecordBatch``: ``request_id``, ``entity_id`` and one
column per attribute) goes to PredictionService in chunks, each one Arrow IPC stream in a
``PredictColumnsRequest``; each chunk's decisions come back as one table of :data:`DECISION_SCHEMA`
(:class:`ChunkResult`). pandas, Polars, DuckDB and Spark hand over such tables without a copy
(``pyarrow.Table.from_pandas``, ``polars.DataFrame.to_arrow``, ``duckdb … .arrow()``).

Both ends use this module: the service reads request chunks and writes decision chunks with it,
so the columns are defined once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

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
    """One chunk's answer: ``decisions`` (a table of :data:`DECISION_SCHEMA`, one row per request
    row) or the chunk's ``error``; ``warnings``: (code, field, message) about its columns."""

    chunk_id: int
    decisions: pa.Table | None
    error: ChunkError | None
    decided: int = 0
    replayed: int = 0
    failed: int = 0
    warnings: tuple[tuple[str, str, str], ...] = ()


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


def slices(table: pa.Table, rows: int) -> Iterator[pa.Table]:
    """``table`` cut into consecutive tables of at most ``rows`` rows (zero-copy slices)."""
    for start in range(0, table.num_rows, rows):
        yield table.slice(start, rows)
