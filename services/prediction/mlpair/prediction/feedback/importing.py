"""A file of realised outcomes (CSV or Parquet) into the outcome store, in chunks
(``mlpair outcomes-import``), through the same checks and storage as ``RecordOutcomes``.

Columns, by name: ``request_id`` (or ``entity_id`` with ``decided_at``), ``label``,
``observed_at``, optionally ``model_name``; any other column refuses the file before anything is
stored. Times are ISO 8601 strings (without an offset: UTC) or, in Parquet, timestamps. A CSV's
columns are read as text, so an id such as ``00123`` keeps its zeros. A bad row is reported by its
1-based row number (the header is not a row) and the valid rows are stored; importing a file again
stores nothing new (each decision's outcome is stored once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from mlpair.prediction.errors import PredictionError
from mlpair.prediction.feedback.items import OutcomeItem, check
from mlpair.prediction.feedback.store import OutcomeStore, Stored

COLUMNS = ("request_id", "entity_id", "decided_at", "model_name", "label", "observed_at")


class UnreadableFile(ValueError):
    """The file is not a CSV or Parquet file of outcomes (its kind, or a column, named)."""


@dataclass
class ImportReport:
    """What an import did: rows read, stored anew, duplicates (stored before), kept for a later
    join (no decision on record yet: counted in ``stored`` too), and each refused row's error."""

    rows: int = 0
    stored: int = 0
    duplicates: int = 0
    unmatched: int = 0
    refused: list[PredictionError] = field(default_factory=list)


def _batches(path: Path, chunk_rows: int) -> Iterator[list[dict]]:
    """Rows of the file as dicts, ``chunk_rows`` at a time.

    Raises:
        UnreadableFile: neither ``.csv`` nor ``.parquet``, unreadable, or a column not in :data:`COLUMNS`.
    """
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            with path.open(newline="") as f:
                header = f.readline().strip().split(",")
            names = [h.strip().strip('"') for h in header]
            _check_columns(names)
            options = pacsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()), strings_can_be_null=True)
            reader = pacsv.open_csv(path, convert_options=options, read_options=pacsv.ReadOptions(block_size=1 << 20))
            pending: list[dict] = []
            for batch in reader:
                pending += batch.to_pylist()
                while len(pending) >= chunk_rows:
                    yield pending[:chunk_rows]
                    pending = pending[chunk_rows:]
            if pending:
                yield pending
        elif suffix == ".parquet":
            parquet = pq.ParquetFile(path)
            _check_columns(parquet.schema_arrow.names)
            for batch in parquet.iter_batches(batch_size=chunk_rows):
                yield batch.to_pylist()
        else:
            raise UnreadableFile(f"{path.name}: an outcomes file is .csv or .parquet")
    except (OSError, pa.ArrowException) as exc:
        raise UnreadableFile(f"{path.name} cannot be read as {suffix.lstrip('.') or 'a table'}: {exc}") from exc


def _check_columns(names: list[str]) -> None:
    if unknown := [n for n in names if n not in COLUMNS]:
        raise UnreadableFile(f"unknown column(s) {', '.join(unknown)}; the columns are {', '.join(COLUMNS)}")
    if "label" not in names or "observed_at" not in names:
        raise UnreadableFile("an outcomes file needs the columns label and observed_at")


async def import_file(
    path: Path,
    store: OutcomeStore,
    *,
    chunk_rows: int = 5000,
    on_chunk: Callable[[ImportReport], None] | None = None,
) -> ImportReport:
    """Imports every row of ``path`` (``.csv`` or ``.parquet``) through :meth:`OutcomeStore.record`.

    Raises:
        UnreadableFile: see :func:`_batches` (nothing of the file is stored when the header is wrong).
        OutcomesUnavailable: the ledger database failed (the chunks before are stored; import again).
    """
    report = ImportReport()
    now = datetime.now(UTC)
    for rows in _batches(path, chunk_rows):
        items: list[OutcomeItem | PredictionError] = []
        for row in rows:
            report.rows += 1
            try:
                items.append(check(f"row {report.rows}", row, now))
            except PredictionError as exc:
                items.append(exc)
        for result in await store.record(items):
            if isinstance(result, Stored):
                report.duplicates += result.duplicate
                report.stored += not result.duplicate
                report.unmatched += not result.duplicate and not result.decision_found
            else:
                report.refused.append(result)
        if on_chunk is not None:
            on_chunk(report)
    return report
