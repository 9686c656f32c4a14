"""A job's keys, checked whole before anything is sent: every row needs a key of its own.

Each row's request id is derived from the job id and its key (:mod:`mlpair.jobs.chunks`), so two rows
sharing a key would share a request id: the second would be refused (``IDEMPOTENCY_KEY_REUSED``) or
replayed as a copy of the first, in whichever chunk it sits. A null key has no request id at all.
So before the first chunk goes out the job reads the key column alone and refuses the input (exit 2,
nothing sent) when a key is null or repeated anywhere in it, naming the first few and their rows:

- Parquet: the key (and entity) column alone, batch by batch.
- CSV: only the key (and entity) column, read as text with the job's own null strings.
- A PostgreSQL query: a query first, in PostgreSQL (``GROUP BY`` the key over the job's query); the
  rows are then read ordered by the key, and a repeat across two chunks is refused as they stream
  (:func:`mlpair.jobs.sources.Source.chunks`) should the data change in between.

Row numbers count from 0 in input order (a query's: ordered by the key), as the job's chunk
messages do.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from mlpair.jobs.sources import InputError, Source, asyncpg_dsn, csv_options, without_password

NAMED = 5
"""How many repeated keys (and rows of each, and null rows) a refusal names."""


@dataclass(frozen=True)
class Keys:
    """An input's keys, checked: none null, none repeated.

    Attributes:
        rows: the input's rows (exact, also for a CSV file).
        keys: every key as text, in input order (a file's), or None (a query's: checked in
            PostgreSQL, never held here).
    """

    rows: int
    keys: pa.Array | None

    def chunk_bounds(self, n: int, chunk_rows: int) -> tuple[int, str, str] | None:
        """Chunk ``n``'s rows, first key and last key, as :class:`~mlpair.jobs.state.ChunkRecord`
        keeps them; None when the keys are not held here (or the chunk is past the input's end)."""
        start = n * chunk_rows
        if self.keys is None or start >= self.rows:
            return None
        stop = min(start + chunk_rows, self.rows)
        return stop - start, self.keys[start].as_py(), self.keys[stop - 1].as_py()


def check_keys(source: Source, key_column: str, entity_column: str | None) -> Keys:
    """Reads the input's key column (and entity column) alone and checks that every row has a key,
    none repeated, and an entity.

    Raises:
        InputError: a null or repeated key (the first keys and their rows named), a null entity, or
            the input cannot be read.
    """
    if source.kind == "query":
        return Keys(_check_query(source, key_column, entity_column), None)
    try:
        keys, entities = _file_columns(source, key_column, entity_column)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
        raise InputError(f"{source.name}: {str(exc).strip().splitlines()[0]}") from exc
    _refuse_nulls(source.name, "--key", key_column, keys)
    if entities is not None:
        _refuse_nulls(source.name, "--entity-column", entity_column or "", entities)
    counts = pc.value_counts(keys)
    repeated = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    if len(repeated):
        rows = pc.indices_nonzero(pc.is_in(keys, repeated))
        first: list[str] = []
        for key in keys.take(rows.slice(0, 1_000)).to_pylist():
            if key not in first:
                first.append(key)
            if len(first) == NAMED:
                break
        named = []
        for key in first:
            rows_of_key = pc.indices_nonzero(pc.equal(keys, key))
            named.append((key, rows_of_key.slice(0, NAMED).to_pylist(), len(rows_of_key)))
        raise InputError(_repeats(source.name, key_column, len(repeated), named))
    return Keys(len(keys), keys)


def _file_columns(source: Source, key_column: str, entity_column: str | None) -> tuple[pa.Array, pa.Array | None]:
    """The key column (and the entity column when it is another) as text, whole."""
    names = [key_column] + ([entity_column] if entity_column and entity_column != key_column else [])
    assert source.path is not None
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(source.path).read(columns=names)
    else:
        from pyarrow import csv

        read, parse = csv_options(source.path)
        convert = csv.ConvertOptions(
            column_types={name: pa.string() for name in names}, strings_can_be_null=True, include_columns=names
        )
        table = csv.read_csv(source.path, read_options=read, parse_options=parse, convert_options=convert)
    keys = table.column(key_column).cast(pa.large_string()).combine_chunks()
    entities = table.column(names[1]).combine_chunks() if len(names) > 1 else None
    return keys, entities


def _refuse_nulls(name: str, flag: str, column: str, values: pa.Array) -> None:
    if not values.null_count:
        return
    rows = pc.indices_nonzero(pc.is_null(values)).slice(0, NAMED).to_pylist()
    more = ", …" if values.null_count > NAMED else ""
    raise InputError(
        f"{name}: {flag} {column} is null in {values.null_count:,} row(s) "
        f"({'row' if len(rows) == 1 else 'rows'} {', '.join(map(str, rows))}{more}): "
        "every row needs one; nothing was sent: fix the input and rerun"
    )


def _repeats(name: str, column: str, keys: int, named: list[tuple[Any, list[int], int]]) -> str:
    """The one line that refuses repeated keys: how many, and the first few with their rows (each
    key: its key, its first rows, how many rows hold it)."""
    shown = []
    for key, rows, count in named:
        more = f", … ({count} rows)" if count > len(rows) else ""
        shown.append(f"{key!r} in rows {', '.join(map(str, rows))}{more}")
    first = f" (the first {len(named)})" if keys > len(named) else ""
    return (
        f"{name}: --key {column} repeats {keys:,} key(s){first}: {'; '.join(shown)}: each row needs a key of its "
        "own (two rows would share a request id); nothing was sent: fix the input and rerun"
    )


def _check_query(source: Source, key_column: str, entity_column: str | None) -> int:
    """The query's rows, checked in PostgreSQL: nulls counted, repeated keys grouped (the first few
    named with their rows in key order)."""
    import asyncpg

    body = source.query.strip().rstrip(";")
    key = '"' + key_column.replace('"', '""') + '"'
    entity = '"' + (entity_column or key_column).replace('"', '""') + '"'
    nulls = (
        f"SELECT count(*), count(*) FILTER (WHERE {key} IS NULL), count(*) FILTER (WHERE {entity} IS NULL) "
        f"FROM ({body}) AS job_input"
    )
    repeats = (
        f"WITH numbered AS (SELECT {key} AS k, row_number() OVER (ORDER BY {key}) - 1 AS row "
        f"FROM ({body}) AS job_input) "
        "SELECT k::text AS key, (array_agg(row ORDER BY row))[1:$1] AS rows, count(*) AS n, count(*) OVER () AS keys "
        "FROM numbered WHERE k IS NOT NULL GROUP BY k HAVING count(*) > 1 ORDER BY min(row) LIMIT $1"
    )

    async def ask() -> tuple[Any, list[Any]]:
        conn = await asyncpg.connect(asyncpg_dsn(source.database_url))
        try:
            async with conn.transaction(readonly=True, isolation="repeatable_read"):
                return await conn.fetchrow(nulls), await conn.fetch(repeats, NAMED)
        finally:
            await conn.close()

    try:
        (total, null_keys, null_entities), found = asyncio.run(ask())
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise InputError(f"--query on {without_password(source.database_url)}: {exc}") from exc
    for flag, column, count in (("--key", key_column, null_keys), ("--entity-column", entity_column, null_entities)):
        if count:
            raise InputError(
                f"query: {flag} {column} is null in {count:,} row(s): every row needs one; nothing was sent: "
                "fix the query and rerun"
            )
    if found:
        named = [(r["key"], list(r["rows"]), r["n"]) for r in found]
        raise InputError(_repeats("query", key_column, found[0]["keys"], named))
    return int(total)
