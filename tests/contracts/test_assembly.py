"""Feature schema, assembly and guards, including handed cases C28, C31 and C32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlpair.contracts.assembly import ConversionError, FeatureAssembler
from mlpair.contracts.schema import FeatureSchema, Preprocessing

GOLDEN = Path(__file__).parent / "golden" / "credit-risk-v1.json"


@pytest.fixture(scope="module")
def assembler(credit_entry) -> FeatureAssembler:
    return FeatureAssembler(credit_entry.preprocessing)


def applicant(**overrides):
    base = {"Seniority": 9, "Home": "rent", "Time": 60, "Age": 30, "Marital": "married", "Records": "no",
            "Job": "freelance", "Expenses": 73, "Income": 129, "Assets": 0, "Debt": 0, "Amount": 800, "Price": 846}
    return {**base, **overrides}


def column(assembler: FeatureAssembler, name: str) -> int:
    return assembler.preprocessing.feature_names.index(name)


def test_vector_layout_matches_manifest(assembler, credit_entry):
    row = assembler.assemble(applicant())
    assert row.vector.dtype == np.float32
    assert row.vector.shape == (credit_entry.manifest.n_features,)
    assert row.guards == ()
    # one-hot blocks: exactly one slot set per categorical feature
    names = assembler.preprocessing.feature_names
    for feat in ("Home", "Marital", "Records", "Job"):
        block = [i for i, n in enumerate(names) if n.startswith(feat + "=")]
        assert row.vector[block].sum() == 1.0


def test_c28_sentinels_become_default_not_clamped(assembler, credit_entry):
    row = assembler.assemble(applicant(Income=99999999, Assets=-1))
    codes = {g.reason_code for g in row.guards}
    assert codes == {"INCOME_SENTINEL_DEFAULTED", "ASSETS_SENTINEL_DEFAULTED"}
    missing = assembler.assemble(applicant(Income=None, Assets=None))
    clamped = assembler.assemble(applicant(Income=5000, Assets=0))
    inc, ass = column(assembler, "Income"), column(assembler, "Assets")
    # the sentinel takes exactly the default a missing value takes, never the clamped maximum
    assert row.vector[inc] == missing.vector[inc]
    assert row.vector[ass] == missing.vector[ass]
    assert row.vector[inc] != clamped.vector[inc]


@pytest.mark.parametrize("value,action", [(1e12, "CLAMPED_MAX"), (-5e9, "CLAMPED_MIN"), (float("inf"), "CLAMPED_MAX"),
                                          (float("-inf"), "CLAMPED_MIN"), (float("nan"), "MISSING_DEFAULTED")])
def test_extreme_numeric_values_are_guarded_before_the_float32_cast(assembler, value, action):
    row = assembler.assemble(applicant(Amount=value))
    assert [g.reason_code for g in row.guards] == [f"AMOUNT_{action}"]
    assert np.isfinite(row.vector).all()


def test_c31_attribute_order_does_not_change_the_vector(assembler):
    forward = applicant()
    backward = dict(reversed(list(forward.items())))
    assert list(forward) != list(backward)
    a, b = assembler.assemble(forward), assembler.assemble(backward)
    assert a.vector.tobytes() == b.vector.tobytes()


def test_c31_unknown_attribute_is_ignored_and_reported(assembler):
    row = assembler.assemble(applicant(FavouriteColour="blue"))
    assert row.unknown_attributes == ("FavouriteColour",)
    assert row.vector.tobytes() == assembler.assemble(applicant()).vector.tobytes()


def test_c31_golden_vectors_for_real_applicants(assembler, credit_data):
    """Checked-in vectors for real applicants: any silent change to assembly or fitting fails here."""
    golden = json.loads(GOLDEN.read_text())
    assert golden["preprocessing_hash"] == assembler.preprocessing.hash, "fitted preprocessing changed"
    by_id = dict(zip(credit_data.entity_ids, credit_data.records))
    for case in golden["applicants"]:
        got = assembler.assemble(by_id[case["entity_id"]]).vector
        np.testing.assert_array_equal(got, np.array(case["vector"], dtype=np.float32))


def test_c32_unseen_category_goes_to_the_unknown_slot(assembler):
    row = assembler.assemble(applicant(Home="houseboat"))
    assert [g.reason_code for g in row.guards] == ["HOME_UNKNOWN_CATEGORY"]
    unknown = column(assembler, "Home=<unknown>")
    assert row.vector[unknown] == 1.0
    home = [i for i, n in enumerate(assembler.preprocessing.feature_names) if n.startswith("Home=")]
    assert row.vector[home].sum() == 1.0  # never also a real category


@pytest.mark.parametrize("value", [None, "", "   "])
def test_c32_empty_or_null_category_is_missing_not_unknown(assembler, credit_entry, value):
    row = assembler.assemble(applicant(Home=value))
    assert [g.reason_code for g in row.guards] == ["HOME_MISSING_DEFAULTED"]
    default = credit_entry.preprocessing.categorical["Home"].default
    assert row.vector[column(assembler, f"Home={default}")] == 1.0


def test_c32_categories_are_normalised_by_the_schema_rule(assembler):
    assert assembler.assemble(applicant(Home="  RENT ")).vector.tobytes() == assembler.assemble(applicant()).vector.tobytes()


def test_numeric_strings_are_converted_by_rule(assembler):
    assert assembler.assemble(applicant(Age="30")).vector.tobytes() == assembler.assemble(applicant(Age=30)).vector.tobytes()


def test_unconvertible_values_are_all_reported_together(assembler):
    with pytest.raises(ConversionError) as excinfo:
        assembler.assemble(applicant(Age="thirty", Home=3.0, Records=True, Income=True))
    assert set(excinfo.value.problems) == {"Age", "Home", "Records", "Income"}


def test_preprocessing_hash_is_stable_across_save_and_load(credit_entry, tmp_path):
    path = tmp_path / "p.json"
    credit_entry.preprocessing.save(path)
    assert Preprocessing.load(path).hash == credit_entry.preprocessing.hash


def test_schema_rejects_unknown_keys(tmp_path, credit_schema):
    bad = credit_schema.model_dump(mode="json")
    bad["numeric"][0]["maxx"] = 3
    with pytest.raises(ValueError):
        FeatureSchema.model_validate(bad)
