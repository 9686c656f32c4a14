"""PredictColumns' chunks ⇄ the pipeline: Arrow columns in, decision columns out.

A request chunk (:func:`read_chunk`) is read column by column, never row by row: the id columns
become two lists of strings, each attribute column of the family's schema one list of Python
values — numbers as float64 (integer and decimal columns are widened, as every number on the
wire is a double), strings, flags, None for a null — which the columnar assembler
(:mod:`~mlpair.contracts.columns`) and the fingerprints (:mod:`~mlpair.prediction.preparing.idempotency`)
read as they read a BatchPredict's. A row is therefore decided, fingerprinted and recorded exactly
as the same values sent as a Predict would be: a table's request id replays a BatchPredict's
decision and the other way round.

Refused as a whole (:class:`~mlpair.prediction.errors.InvalidRequest`, nothing decided): bytes that
are not an Arrow IPC stream, no ``request_id`` or ``entity_id`` column or one that is not text,
more rows than the limit. A column of a type no conversion reads (a timestamp, a list…) fails
the rows holding a value in it, naming the attribute, like any value the schema refuses; its
nulls are missing values. A column the schema does not know is an unknown attribute of the rows
holding a value in it (warned about once per chunk, or refused per row under
``PREDICTION_UNKNOWN_ATTRIBUTES=refuse``).

The answer (:func:`write_decisions`) is one table of
:data:`~mlpair.client.tables.DECISION_SCHEMA`, built a column at a time from the decisions'
columns (:class:`~mlpair.prediction.deciding.decisions.Decided`), the replays' records and the errors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client.tables import DECISION_SCHEMA, ID_COLUMNS, from_ipc, to_ipc
from mlpair.contracts.columns import AttributeColumns
from mlpair.errors import ServiceError
from mlpair.prediction import metrics
from mlpair.prediction.errors import InvalidRequest
from mlpair.prediction.intake import converters
from mlpair.prediction.intake.checks import MAX_ECHO
from mlpair.prediction.outcomes import PredictionResult
from mlpair.rpc.status import MalformedRequest
from mlpair.wire import Refused

if TYPE_CHECKING:  # the pipeline imports this module
    from mlpair.prediction.pipeline import Predictor


@dataclass(frozen=True)
class Chunk:
    """A request chunk read: ``n`` rows of ids and attribute values, column by column.

    Attributes:
        request_ids, entity_ids: ``[n]`` strings ("" for a null: refused by the id checks).
        names: each attribute column's name, in the chunk's order (schema-known or not), but for
            columns of a type no conversion reads.
        values: one list of ``n`` values per name (float, str, bool or None).
        unreadable: each column of a type no conversion reads (a timestamp, a list…) → its Arrow
            type and the rows holding a value in it.
    """

    request_ids: list[str]
    entity_ids: list[str]
    names: list[str]
    values: list[list]
    unreadable: dict[str, tuple[str, list[int]]]

    def __len__(self) -> int:
        return len(self.request_ids)

    def column(self, name: str) -> list:
        """The values of attribute ``name``: all None where the chunk has no such column."""
        try:
            return self.values[self.names.index(name)]
        except ValueError:
            return [None] * len(self)

    def attribute_columns(self, schema_names: list[str]) -> AttributeColumns:
        """The values of ``schema_names`` (a family's attributes, sorted), and which rows hold a
        value in another column (each handled on its own, as a request with unknown attributes)."""
        known = set(schema_names)
        extra = [values for name, values in zip(self.names, self.values) if name not in known]
        others = sorted({k for values in extra for k, value in enumerate(values) if value is not None})
        return AttributeColumns(schema_names, [self.column(name) for name in schema_names], others)

    def unknown_columns(self, schema_names: list[str]) -> list[str]:
        """The columns naming no attribute of the schema that hold a value in some row."""
        known = set(schema_names)
        found = [name for name, values in zip(self.names, self.values) if values.count(None) < len(values)]
        found += [name for name, (_, rows) in self.unreadable.items() if rows]
        return [name for name in found if name not in known]

    def refusals(self, schema_names: list[str]) -> dict[int, InvalidRequest]:
        """Each row holding a value in a schema attribute's column of a type no conversion reads →
        its error, naming those attributes (the attribute's nulls are missing values)."""
        problems: dict[int, list[str]] = {}
        for name in sorted(set(self.unreadable) & set(schema_names)):
            kind, rows = self.unreadable[name]
            for k in rows:
                problems.setdefault(k, []).append(f"{name[:MAX_ECHO]}: a column of Arrow type {kind} is not read")
        return {
            k: InvalidRequest(
                f"attribute values cannot be converted: {'; '.join(found)}",
                metadata={"attributes": ",".join(sorted(p.split(":", 1)[0] for p in found))},
            )
            for k, found in problems.items()
        }

    def row(self, k: int) -> RowAttributes:
        """Row ``k``'s attributes as a mapping (only its non-null values)."""
        return RowAttributes(self, k)


class RowAttributes(Mapping[str, Any]):
    """One row of a :class:`Chunk` as the attribute mapping a Predict request carries: the
    attributes holding a value in that row. Read only where a row is handled on its own (a row
    with an attribute the schema does not know, a replay's fingerprint)."""

    __slots__ = ("_chunk", "_k")

    def __init__(self, chunk: Chunk, k: int) -> None:
        self._chunk, self._k = chunk, k

    def __getitem__(self, name: str) -> Any:
        c = self._chunk
        try:
            value = c.values[c.names.index(name)][self._k]
        except ValueError:
            raise KeyError(name) from None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        k = self._k
        return (name for name, values in zip(self._chunk.names, self._chunk.values) if values[k] is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def read_chunk(data: bytes, max_rows: int) -> Chunk:
    """A request chunk's Arrow IPC bytes → :class:`Chunk`.

    Raises:
        InvalidRequest: not an Arrow IPC stream; an id column missing or not text; more than
            ``max_rows`` rows (metadata ``column`` or ``max_chunk_rows``).
    """
    try:
        table = from_ipc(data)
    except (pa.ArrowException, ValueError, OSError):
        raise InvalidRequest("arrow_ipc is not an Arrow IPC stream", metadata={"field": "arrow_ipc"}) from None
    if table.num_rows > max_rows:
        raise InvalidRequest(
            f"a chunk may carry at most {max_rows} rows, got {table.num_rows}",
            metadata={"max_chunk_rows": str(max_rows)},
        )
    names = table.column_names
    if len(set(names)) < len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise InvalidRequest(
            f"the chunk names a column more than once: {_shown(repeated)}", metadata={"column": _shown(repeated)}
        )
    ids = []
    for name in ID_COLUMNS:
        if name not in names:
            raise InvalidRequest(f"the chunk has no {name!r} column", metadata={"column": name})
        column = table.column(name)
        if not _is_text(column.type):
            raise InvalidRequest(f"column {name!r} must be text (utf8), got {column.type}", metadata={"column": name})
        ids.append(pc.fill_null(column.cast(pa.string()), "").to_pylist())
    readable, values, unreadable = [], [], {}
    for name in names:
        if name in ID_COLUMNS:
            continue
        column = table.column(name)
        read = _values(column)
        if read is None:
            rows = pc.indices_nonzero(pc.is_valid(column)).to_pylist() if len(column) else []
            unreadable[name] = (str(column.type), rows)
        else:
            readable.append(name)
            values.append(read)
    return Chunk(ids[0], ids[1], readable, values, unreadable)


def _values(column: pa.ChunkedArray) -> list | None:
    """One attribute column as Python values, the wire's kinds (float64 numbers, str, bool, None
    for a null); None for a column of a type no conversion reads."""
    kind = column.type
    if pa.types.is_dictionary(kind):
        column, kind = column.cast(kind.value_type), kind.value_type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return column.cast(pa.float64()).to_pylist()
    if _is_text(kind):
        return column.cast(pa.string()).to_pylist()
    if pa.types.is_boolean(kind) or pa.types.is_null(kind):
        return column.to_pylist()
    return None


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _shown(names: Sequence[str]) -> str:
    return ",".join(n[:MAX_ECHO] for n in names[:10])


@dataclass(frozen=True)
class Written:
    """A chunk's answer: the decision table's IPC bytes and how its rows ended."""

    data: bytes
    decided: int
    replayed: int
    failed: int


_DECISION_FIELDS = [f.name for f in DECISION_SCHEMA]


def write_decisions(request_ids: list[str], slots: Sequence) -> Written:
    """Each row's request id and outcome (an :class:`~mlpair.prediction.outcomes.Outcomes`' slots: ``(decided, j)``
    for a fresh decision, a :class:`PredictionResult` for a replay, a
    :class:`~mlpair.errors.ServiceError`) → one table of ``DECISION_SCHEMA``, in request order."""
    n = len(slots)
    columns: dict[str, list] = {name: [None] * n for name in _DECISION_FIELDS}
    columns["request_id"] = list(request_ids)
    fresh: dict[int, tuple[Any, list[int], list[int]]] = {}  # id(decided) → (decided, positions, rows)
    replayed = failed = 0
    for i, slot in enumerate(slots):
        if type(slot) is tuple:
            decided, j = slot
            found = fresh.get(id(decided))
            if found is None:
                found = fresh[id(decided)] = (decided, [], [])
            found[1].append(i)
            found[2].append(j)
        elif isinstance(slot, PredictionResult):
            replayed += 1
            _put_stored(columns, i, slot)
        else:
            failed += 1
            _put_error(columns, i, slot)
    for decided, positions, rows in fresh.values():
        _put_fresh(columns, decided, positions, rows, n)
    arrays = [pa.array(columns[f.name], type=f.type) for f in DECISION_SCHEMA]
    table = pa.Table.from_arrays(arrays, schema=DECISION_SCHEMA)
    return Written(to_ipc(table), n - replayed - failed, replayed, failed)


_FRESH_COLUMNS = (  # request_id: the request's, set for every row
    "decision_id",
    "decision",
    "probability",
    "reason_codes",
    "model_version",
    "feature_schema_version",
    "policy_version",
    "served_from",
    "decided_at",
)


def _put_fresh(columns: dict[str, list], decided, positions: list[int], rows: list[int], n: int) -> None:
    """A group's fresh decisions (``decisions.Decided``) at ``positions``, from its row ``rows``."""
    c = decided.columns
    whole = len(positions) == n and rows == list(range(n)) and positions == rows
    for name in _FRESH_COLUMNS:
        values = getattr(c, name)
        if whole:
            columns[name] = list(values)
            continue
        out = columns[name]
        for i, j in zip(positions, rows):
            out[i] = values[j]
    replayed = columns["replayed"]
    for i in positions:
        replayed[i] = False


def _put_stored(columns: dict[str, list], i: int, result: PredictionResult) -> None:
    s = result.stored
    for name in _FRESH_COLUMNS:
        columns[name][i] = getattr(s, name)
    columns["replayed"][i] = result.replayed


def _put_error(columns: dict[str, list], i: int, error: ServiceError | None) -> None:
    if error is None:  # the pipeline gives every row an outcome
        raise ValueError("a chunk row was left without an outcome")
    columns["error_code"][i] = error.code
    columns["error_reason"][i] = error.reason
    columns["error_message"][i] = error.message


async def decide_chunk(
    predictor: Predictor,
    request: object,
    max_rows: int,
    deadline: float | None,
    admit: Callable[[int], Awaitable[str]] | None = None,
) -> pb.PredictColumnsResponse:
    """One PredictColumns chunk decided: its decisions, or the error that refused it as a whole
    (a message that did not parse or holds unknown fields, a chunk :func:`read_chunk` refuses, an
    unknown model family, the caller's rate limit), counted in ``prediction_chunks_total``.
    ``admit``: given the chunk's rows, takes them from the caller's limit and returns the caller
    (:meth:`mlpair.prediction.intake.limits.CallerGate.admit`); None: anonymous, unlimited."""
    chunk_id, name = 0, ""
    try:
        if isinstance(request, Refused):
            raise request.error
        if not isinstance(request, pb.PredictColumnsRequest):
            raise MalformedRequest("a chunk is not a valid PredictColumnsRequest message")
        chunk_id, name = request.chunk_id, request.model_name
        chunk = read_chunk(request.arrow_ipc, max_rows)
        caller = "" if admit is None else await admit(len(chunk))
        outcomes = await predictor.decide_table(name, chunk, deadline, caller)
    except ServiceError as exc:
        family = name or predictor.default_model
        metrics.labelled(metrics.CHUNKS, family if family in predictor.families else "unknown", exc.code).inc()
        return pb.PredictColumnsResponse(chunk_id=chunk_id, error=converters.error_status(exc))
    family = name or predictor.default_model
    metrics.labelled(metrics.CHUNKS, family, "OK").inc()
    written = write_decisions(chunk.request_ids, outcomes.slots)
    schema_names = list(predictor.families[family].schema.attribute_names)
    return pb.PredictColumnsResponse(
        chunk_id=chunk_id,
        arrow_ipc=written.data,
        decided=written.decided,
        replayed=written.replayed,
        failed=written.failed,
        warnings=[
            pb.RequestWarning(
                code="UNKNOWN_ATTRIBUTE",
                field=column[:MAX_ECHO],
                message=f"column {column[:MAX_ECHO]!r} names no attribute of {family!r}'s feature schema: ignored",
            )
            for column in chunk.unknown_columns(schema_names)
        ],
    )
