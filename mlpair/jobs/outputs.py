"""A batch-scoring job's outputs: one part file per finished chunk, and the decisions assembled from
the parts once every chunk is done, as Parquet, CSV or rows of a PostgreSQL table.

Every row of the output is the key column, then the columns of
:data:`~mlpair.client.tables.DECISION_SCHEMA` (a CSV file joins ``reason_codes`` with ``;``; a
PostgreSQL table adds ``job_id`` first and keeps the key as text).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mlpair.client.tables import DECISION_SCHEMA
from mlpair.jobs.sources import InputError, asyncpg_dsn

_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")

_PG_COLUMNS = {
    "request_id": "text",
    "decision_id": "text",
    "decision": "text",
    "probability": "double precision",
    "reason_codes": "text[]",
    "model_version": "text",
    "feature_schema_version": "text",
    "policy_version": "text",
    "served_from": "text",
    "decided_at": "timestamptz",
    "replayed": "boolean",
    "error_code": "text",
    "error_reason": "text",
    "error_message": "text",
}


def part_path(job_dir: Path, chunk: int) -> Path:
    """Where chunk ``chunk``'s decisions are kept until the output is assembled."""
    return job_dir / "parts" / f"chunk-{chunk:07d}.parquet"


def write_part(job_dir: Path, chunk: int, decisions: pa.Table) -> None:
    """Writes one chunk's decisions atomically (temporary file, fsync, rename): after a crash a
    part is whole or absent."""
    path = part_path(job_dir, chunk)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(decisions, temporary)
    with temporary.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(temporary, path)


def read_parts(job_dir: Path, chunks: int) -> Iterator[pa.Table]:
    """The parts of chunks ``0 .. chunks - 1``, in order.

    Raises:
        FileNotFoundError: a part is missing (its chunk was never finished).
    """
    for n in range(chunks):
        yield pq.read_table(part_path(job_dir, n))


def check_output(output: str | None, output_table: str | None, database_url: str | None) -> str:
    """The job's output as one description (a path, or ``postgresql table NAME``).

    Raises:
        InputError: none or both given, a file suffix other than .parquet/.csv, or a table without
            --database-url or with a name that is not ``[schema.]name``.
    """
    if (output is None) == (output_table is None):
        raise InputError("give either --output FILE (.parquet or .csv) or --output-table NAME (with --database-url)")
    if output_table is not None:
        if not database_url:
            raise InputError("--output-table needs --database-url")
        if not _TABLE_NAME.match(output_table):
            raise InputError(f"--output-table {output_table!r}: expected NAME or SCHEMA.NAME (letters, digits, _)")
        return f"postgresql table {output_table}"
    assert output is not None
    if Path(output).suffix.lower() not in (".parquet", ".pq", ".csv"):
        raise InputError(f"--output {output}: expected a .parquet or .csv file")
    return output


def assemble(
    job_dir: Path,
    chunks: int,
    *,
    job_id: str,
    key_column: str,
    output: str | None,
    output_table: str | None,
    database_url: str | None,
) -> int:
    """Writes the job's decisions from its parts to the output, replacing what an earlier assembly
    of the same job wrote (a file is written to a temporary name and renamed; a table's rows of this
    job are replaced in one transaction).

    Returns:
        Rows written.
    """
    if output_table is not None:
        assert database_url is not None
        return asyncio.run(_to_postgres(job_dir, chunks, job_id, key_column, output_table, database_url))
    assert output is not None
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    rows = 0
    writer: pq.ParquetWriter | None = None
    csv_writer = None
    try:
        for part in read_parts(job_dir, chunks):
            rows += part.num_rows
            if path.suffix.lower() == ".csv":
                from pyarrow import csv

                flat = _flat(part)
                csv_writer = csv_writer or csv.CSVWriter(str(temporary), flat.schema)
                csv_writer.write_table(flat)
            else:
                writer = writer or pq.ParquetWriter(temporary, part.schema)
                writer.write_table(part)
    finally:
        for w in (writer, csv_writer):
            if w is not None:
                w.close()
    if rows == 0 and not temporary.exists():
        pq.write_table(pa.table({key_column: pa.array([], pa.string())}), temporary)
    os.replace(temporary, path)
    return rows


def _flat(part: pa.Table) -> pa.Table:
    """A part as CSV can hold it: ``reason_codes`` joined with ``;``."""
    index = part.schema.get_field_index("reason_codes")
    joined = pc.binary_join(part.column("reason_codes"), ";")
    return part.set_column(index, "reason_codes", joined)


async def _to_postgres(job_dir: Path, chunks: int, job_id: str, key_column: str, table: str, database_url: str) -> int:
    import asyncpg

    quoted = ".".join(f'"{p}"' for p in table.split("."))
    key = '"' + key_column.replace('"', '""') + '"'
    columns = ", ".join(f'"{name}" {kind}' for name, kind in _PG_COLUMNS.items())
    schema, _, name = table.rpartition(".")
    try:
        conn = await asyncpg.connect(asyncpg_dsn(database_url))
    except (OSError, asyncpg.PostgresError) as exc:
        raise InputError(f"--output-table {table}: cannot connect: {exc}") from exc
    rows = 0
    try:
        async with conn.transaction():
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {quoted} (job_id text NOT NULL, {key} text NOT NULL, {columns}, "
                f"PRIMARY KEY (job_id, {key}))"
            )
            await conn.execute(f"DELETE FROM {quoted} WHERE job_id = $1", job_id)
            for part in read_parts(job_dir, chunks):
                keys = part.column(key_column).cast(pa.string()).to_pylist()
                values = [part.column(n).to_pylist() for n in DECISION_SCHEMA.names]
                records = [(job_id, k, *rest) for k, *rest in zip(keys, *values, strict=True)]
                await conn.copy_records_to_table(
                    name, schema_name=schema or None, records=records, columns=["job_id", key_column, *_PG_COLUMNS]
                )
                rows += len(records)
    except asyncpg.PostgresError as exc:
        raise InputError(f"--output-table {table}: {exc}") from exc
    finally:
        await conn.close()
    return rows
