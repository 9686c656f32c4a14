"""The one feature assembler for many records (``ColumnAssembler``) is the row-wise path, bit for bit.

Training and PredictionService assemble many records a column at a time; fewer than ``SMALL_BATCH``
go row by row inside the same assembler. These tests compare the two paths on every real holdout
record and on generated records full of what the guards and conversion rules exist for.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlpair.contracts.assembly import ConversionError, FeatureAssembler
from mlpair.contracts.columns import ColumnAssembler
from tests.support.records import messy_values

pytestmark = pytest.mark.timeout(120)


def row_wise(assembler: FeatureAssembler, records: list[dict]) -> list:
    """Each record as the row-wise assembler sees it: (vector bytes, guards, unknown) or the problems."""
    out = []
    for record in records:
        try:
            row = assembler.assemble(record)
        except ConversionError as exc:
            out.append(("refused", exc.problems))
        else:
            out.append((row.vector.tobytes(), row.guards, row.unknown_attributes))
    return out


def columnar(columns: ColumnAssembler, records: list[dict]) -> list:
    assembled = columns.assemble(records)
    guards = columns.guards(assembled.actions)
    return [("refused", assembled.problems[i]) if i in assembled.problems else
            (assembled.matrix[i].tobytes(), guards[i].events, assembled.unknown.get(i, ()))
            for i in range(len(records))]


@pytest.mark.parametrize("family", ["credit", "churn"])
def test_columnar_assembly_is_the_row_wise_one_on_every_holdout_record(family, credit_entry, credit_holdout,
                                                                        churn_entry, request):
    if family == "credit":
        entry, records = credit_entry, credit_holdout.records
    else:
        from mlpair.training.data import load_dataset, stratified_split

        entry = churn_entry
        data = load_dataset(churn_entry.preprocessing.feature_schema)
        seed = int(churn_entry.manifest.data_source["split"]["seed"])
        records = data.subset(stratified_split(data.labels, seed)["holdout"]).records
    assembler = FeatureAssembler(entry.preprocessing)
    expected = row_wise(assembler, records)
    assert len(expected) > 500 and sum(bool(e[1]) for e in expected) > 0  # real guards among them
    assert columnar(ColumnAssembler(assembler), records) == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_columnar_assembly_is_the_row_wise_one_on_generated_records(data, credit_entry, credit_holdout):
    assembler = FeatureAssembler(credit_entry.preprocessing)
    features = credit_entry.preprocessing.feature_schema.features
    base = credit_holdout.records[:40]
    records = []
    for record in base:
        record = dict(record)
        for feat in data.draw(st.lists(st.sampled_from(features), max_size=4, unique_by=lambda f: f.name)):
            record[feat.name] = data.draw(messy_values(feat))
        if data.draw(st.booleans()):
            record.pop(features[data.draw(st.integers(0, len(features) - 1))].name, None)
        if data.draw(st.integers(0, 9)) == 0:
            record["not_in_schema"] = 1.0
        records.append(record)
    columns, expected = ColumnAssembler(assembler), row_wise(assembler, records)
    assert columnar(columns, records) == expected
    assert columnar(columns, records) == expected  # again: the categories now come from its memo


def test_training_assembles_through_the_columnar_path_and_refuses_the_first_bad_row(credit_entry, credit_holdout):
    """``FeatureAssembler.assemble_many`` (training's path) gives each record's own vector, and
    names the first unusable record's attributes as assembling that record alone does."""
    assembler = FeatureAssembler(credit_entry.preprocessing)
    records = credit_holdout.records
    matrix = assembler.assemble_many(records)
    assert matrix.dtype == np.float32 and matrix.shape == (len(records), assembler.n_features)
    assert matrix.tobytes() == np.stack([assembler.assemble(r).vector for r in records]).tobytes()
    broken = [dict(r) for r in records[:20]]
    broken[12]["Age"], broken[15]["Home"] = "abc", ["a list"]
    with pytest.raises(ConversionError) as refused:
        assembler.assemble_many(broken)
    with pytest.raises(ConversionError) as alone:
        assembler.assemble(broken[12])
    assert refused.value.problems == alone.value.problems == {"Age": alone.value.problems["Age"]}


def test_a_few_rows_assembled_row_by_row_get_the_columnar_matrix_and_guard_bits(credit_entry, credit_holdout):
    """Under ``SMALL_BATCH`` records, ``ColumnAssembler.assemble`` goes row by row through the shared
    assembler; the matrix, the guard bits (so the decoded guards) and the problems are the columnar
    path's, on every holdout record."""
    from mlpair.contracts.columns import SMALL_BATCH

    columns = ColumnAssembler(FeatureAssembler(credit_entry.preprocessing))
    records = [dict(r) for r in credit_holdout.records]
    records[1]["Age"] = "abc"  # refused
    assembled = columns.assemble(records, columns.columns(records))
    kept = [i for i in range(len(records)) if i not in assembled.problems]  # a refused row's values mean nothing
    few = [columns.assemble(records[i : i + SMALL_BATCH - 1]) for i in range(0, len(records), SMALL_BATCH - 1)]
    assert {i * (SMALL_BATCH - 1) + k: p for i, f in enumerate(few) for k, p in f.problems.items()} == assembled.problems
    matrix = np.concatenate([f.matrix for f in few])
    actions = np.concatenate([f.actions for f in few])
    assert matrix[kept].tobytes() == assembled.matrix[kept].tobytes()
    assert actions[kept].tobytes() == assembled.actions[kept].tobytes()
    guards = columns.guards(actions)
    assert sum(g.defaulted > 0 for g in guards) > 0 and sum(len(g.reason_codes) > 1 for g in guards) > 0


# ---- a batch's attribute values column by column ----

names_ = st.one_of(st.text(max_size=8), st.sampled_from(['"', "\x00", "é", "😀"]))
values_ = st.one_of(st.none(), st.floats(allow_nan=True), st.text(max_size=5), st.booleans(), st.integers(-5, 5))


@settings(max_examples=200, deadline=None)
@given(records=st.lists(st.dictionaries(names_, values_, max_size=5), max_size=12), names=st.lists(names_, max_size=6))
def test_attribute_columns_are_each_records_values(records, names):
    """Records with names missing, extra or in any order: each column holds each record's value
    (None where it lacks the name), and the records holding a name that is not read are listed."""
    from mlpair.contracts.columns import AttributeColumns, attribute_columns

    names = list(dict.fromkeys([*names, *(records[0] if records else ())]))
    expected = AttributeColumns(
        names,
        [[r.get(name) for r in records] for name in names],
        [i for i, r in enumerate(records) if any(name not in names for name in r)],
    )
    assert attribute_columns(records, names) == expected


def test_attribute_columns_of_records_that_are_not_dicts_are_read_as_mappings():
    from types import MappingProxyType

    from mlpair.contracts.columns import attribute_columns

    records = [{"a": 1.0}, MappingProxyType({"a": 2.0, "b": "x"})]
    assert attribute_columns(records, ["a", "b"]).values == [[1.0, 2.0], [None, "x"]]
    assert attribute_columns(records, ["a"]).others == [1]
