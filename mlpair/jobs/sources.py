"""Where a batch-scoring job reads its rows: a Parquet or CSV file, or a PostgreSQL query, in chunks
of a fixed number of rows.

Chunk ``n`` always holds rows ``n * chunk_rows`` to ``(n + 1) * chunk_rows - 1`` of the input, in
the same order on every read (a query is read ordered by the key column), so a rerun can skip the
chunks a previous run finished.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from mlpair.startup import StartupError

CSV_BLOCK_BYTES = 16 << 20
"""Bytes of CSV pyarrow reads (and infers column types from) at a time."""

# PostgreSQL types read as numbers, flags and timestamps; any other type travels as text
_PG_TYPES = {
    "int2": pa.int64(),
    "int4": pa.int64(),
    "int8": pa.int64(),
    "float4": pa.float64(),
    "float8": pa.float64(),
    "numeric": pa.float64(),
    "bool": pa.bool_(),
}


class InputError(StartupError):
    """The job's input cannot be read as asked (no such file, not Parquet or CSV, no key column, a
    failing query): one line naming the file or column."""


@dataclass(frozen=True)
class Source:
    """One job input.

    Attributes:
        kind: ``parquet``, ``csv`` or ``query``.
        name: what it is, for messages and the default job id (a path, or ``query``).
        identity: the text the default job id is derived from (a file's absolute path, not its
            size or modification time; the query and its database, never a password).
        columns: the input's column names.
        total_rows: the number of rows (for a CSV file an estimate from its line count).
        total_exact: whether ``total_rows`` is exact.
    """

    kind: str
    name: str
    identity: str
    columns: tuple[str, ...]
    total_rows: int
    total_exact: bool
    path: Path | None = None
    query: str = ""
    database_url: str = ""

    def chunks(self, chunk_rows: int, key_column: str) -> Iterator[pa.Table]:
        """The input as consecutive tables of ``chunk_rows`` rows (the last may hold fewer).

        Raises:
            InputError: the input cannot be read on (a CSV value of another type than its column's,
                a query that fails).
        """
        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq

                assert self.path is not None
                yield from rechunk(pq.ParquetFile(self.path).iter_batches(batch_size=chunk_rows), chunk_rows)
            elif self.kind == "csv":
                assert self.path is not None
                yield from rechunk(_csv_reader(self.path, self.columns, key_column), chunk_rows)
            else:
                yield from _query_chunks(self.database_url, self.query, key_column, chunk_rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
            raise InputError(f"{self.name}: {_one_line(exc)}") from exc


def rechunk(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.Table]:
    """``batches`` regrouped into tables of exactly ``rows`` rows (the last may hold fewer)."""
    pending: list[pa.RecordBatch] = []
    held = 0
    for batch in batches:
        while batch.num_rows:
            take = min(rows - held, batch.num_rows)
            pending.append(batch.slice(0, take))
            held += take
            batch = batch.slice(take)
            if held == rows:
                yield pa.Table.from_batches(pending)
                pending, held = [], 0
    if held:
        yield pa.Table.from_batches(pending)


def open_source(
    input_path: str | None, query: str | None, database_url: str | None, key_column: str, entity_column: str | None
) -> Source:
    """The job's input, checked: readable, with the key (and entity) column.

    Args:
        input_path: a ``.parquet`` or ``.csv`` file (by its suffix; ``.pq`` and ``.tsv`` too).
        query: a PostgreSQL query (with ``database_url``), instead of a file.

    Raises:
        InputError: no such file, an unknown suffix, a file that is not what its suffix says, a
            query that fails, or no key or entity column (the message lists the columns there are).
    """
    if (input_path is None) == (query is None):
        raise InputError("give either --input FILE or --query SQL (with --database-url)")
    if query is not None:
        if not database_url:
            raise InputError("--query needs --database-url (postgresql://user@host:port/database)")
        source = _query_source(query, database_url)
    else:
        assert input_path is not None
        source = _file_source(Path(input_path))
    for flag, column in (("--key", key_column), ("--entity-column", entity_column)):
        if column is not None and column not in source.columns:
            raise InputError(
                f"{source.name} has no column {column!r} ({flag}); its columns: {', '.join(source.columns)}"
            )
    return source


def _file_source(path: Path) -> Source:
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    suffix = path.suffix.lower()
    identity = str(path.resolve())
    try:
        if suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path)
            names = tuple(meta.schema_arrow.names)
            return Source("parquet", str(path), identity, names, meta.metadata.num_rows, True, path)
        if suffix in (".csv", ".tsv"):
            with _csv_reader(path, None, None) as reader:
                names = tuple(reader.schema.names)
            return Source("csv", str(path), identity, names, _line_count(path), False, path)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
        raise InputError(f"{path}: cannot be read as {suffix.lstrip('.')}: {_one_line(exc)}") from exc
    raise InputError(f"{path}: expected a .parquet or .csv file")


def _csv_reader(path: Path, columns: tuple[str, ...] | None, key_column: str | None) -> Any:
    """pyarrow's streaming CSV reader; integer columns read as float64 (a later block with a
    fraction would otherwise fail), the key column as text."""
    from pyarrow import csv

    read, parse = csv_options(path)
    if columns is None:
        return csv.open_csv(path, read_options=read, parse_options=parse)
    with csv.open_csv(path, read_options=read, parse_options=parse) as probe:
        inferred = probe.schema
    types = {f.name: pa.float64() for f in inferred if pa.types.is_integer(f.type)}
    if key_column is not None:
        types[key_column] = pa.string()
    convert = csv.ConvertOptions(column_types=types, strings_can_be_null=True)
    return csv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert)


def csv_options(path: Path) -> tuple[Any, Any]:
    """pyarrow's CSV read and parse options for ``path`` (tab-separated for ``.tsv``)."""
    from pyarrow import csv

    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    return csv.ReadOptions(block_size=CSV_BLOCK_BYTES), csv.ParseOptions(delimiter=delimiter)


def _line_count(path: Path) -> int:
    lines = 0
    last = b"\n"
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            lines += block.count(b"\n")
            last = block[-1:]
    return max(0, lines + (last != b"\n") - 1)  # less the header


def asyncpg_dsn(url: str) -> str:
    """``postgresql+asyncpg://…`` (a SQLAlchemy URL) or ``postgres://…`` as the ``postgresql://``
    DSN asyncpg takes."""
    return re.sub(r"^postgres(?:ql)?(?:\+\w+)?://", "postgresql://", url)


def without_password(url: str) -> str:
    """``url`` with its password left out, for messages and the job id."""
    return re.sub(r"://([^:/@]*):[^@]*@", r"://\1@", asyncpg_dsn(url))


def _ordered(query: str, key_column: str) -> str:
    key = '"' + key_column.replace('"', '""') + '"'
    return f"SELECT * FROM ({query.strip().rstrip(';')}) AS job_input ORDER BY {key}"


def _query_source(query: str, database_url: str) -> Source:
    import asyncpg

    async def describe() -> tuple[tuple[str, ...], int]:
        conn = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            statement = await conn.prepare(query.strip().rstrip(";"))
            names = tuple(a.name for a in statement.get_attributes())
            count = await conn.fetchval(f"SELECT count(*) FROM ({query.strip().rstrip(';')}) AS job_input")
            return names, int(count)
        finally:
            await conn.close()

    try:
        names, total = asyncio.run(describe())
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, ValueError) as exc:
        raise InputError(f"--query on {without_password(database_url)}: {_one_line(exc)}") from exc
    identity = f"{without_password(database_url)}|{query.strip()}"
    return Source("query", "query", identity, names, total, True, query=query, database_url=database_url)


def _query_chunks(database_url: str, query: str, key_column: str, chunk_rows: int) -> Iterator[pa.Table]:
    """The query's rows ordered by the key column, ``chunk_rows`` at a time through a server-side
    cursor (one transaction, one connection, held while the chunks are consumed)."""
    import asyncpg

    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(asyncpg.connect(asyncpg_dsn(database_url)))
    try:
        transaction = conn.transaction(readonly=True, isolation="repeatable_read")
        loop.run_until_complete(transaction.start())
        statement = loop.run_until_complete(conn.prepare(_ordered(query, key_column)))
        attributes = statement.get_attributes()
        names = [a.name for a in attributes]
        types = [pa.string() if a.name == key_column else _PG_TYPES.get(a.type.name, pa.string()) for a in attributes]
        cursor = loop.run_until_complete(statement.cursor())
        key_index, last = names.index(key_column), None
        while records := loop.run_until_complete(cursor.fetch(chunk_rows)):
            # the rows come ordered by the key: a key repeated across two chunks meets at the seam
            # (the keys were checked before the job started; this catches rows that changed since)
            if last is not None and str(records[0][key_index]) == last:
                raise InputError(f"query: --key {key_column} repeats the key {last!r}: each row needs its own key")
            last = str(records[-1][key_index])
            columns = [_column([r[i] for r in records], t) for i, t in enumerate(types)]
            yield pa.Table.from_arrays(columns, names=names)
        loop.run_until_complete(transaction.rollback())
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise InputError(f"--query: {_one_line(exc)}") from exc
    finally:
        loop.run_until_complete(conn.close())
        loop.close()


def _column(values: list[Any], kind: pa.DataType) -> pa.Array:
    if kind == pa.float64():
        return pa.array([None if v is None else float(v) for v in values], kind)
    if kind == pa.string():
        return pa.array([None if v is None else str(v) for v in values], kind)
    return pa.array(values, kind)


def default_job_id(source: Source, model: str, key_column: str, entity_column: str | None) -> str:
    """A job id derived from the input, the model and the key: the same command gives the same id,
    so a plain rerun resumes. ``<input name>-<12 hex>``.

    A file's identity is its absolute path alone, not its size or modification time: a file fixed
    and run again (a repeated key, a bad value) is the same job, so nothing it decided is decided
    again. The job checks that every chunk it finished still holds the same keys, and refuses a file
    replaced by other rows, telling to give it a ``--job-id`` of its own. A query's identity is its
    text and database: name each run of a query whose rows change (``--job-id nightly-2024-05-01``).
    """
    digest = hashlib.sha256("\x1f".join([source.identity, model, key_column, entity_column or ""]).encode())
    stem = Path(source.name).stem if source.path is not None else "query"
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-")[:40] or "job"
    return f"{slug}-{digest.hexdigest()[:12]}"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
