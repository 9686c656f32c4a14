"""Feature schema, conversion rules, assembly and guards for both families, including C28, C31, C32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mlpair.contracts.assembly import ConversionError, FeatureAssembler
from mlpair.contracts.preprocessing import Preprocessing
from mlpair.contracts.schema import FeatureSchema

GOLDEN = Path(__file__).parent / "golden"
FAMILIES = ["credit-risk", "churn"]


@pytest.fixture(scope="module")
def assemblers(credit_entry, churn_entry) -> dict[str, FeatureAssembler]:
    return {"credit-risk": FeatureAssembler(credit_entry.preprocessing),
            "churn": FeatureAssembler(churn_entry.preprocessing)}


@pytest.fixture(scope="module")
def assembler(assemblers) -> FeatureAssembler:
    return assemblers["credit-risk"]


@pytest.fixture(scope="module")
def churn(assemblers) -> FeatureAssembler:
    return assemblers["churn"]


@pytest.fixture(scope="module")
def datasets(credit_data, churn_data):
    return {"credit-risk": credit_data, "churn": churn_data}


def applicant(**overrides):
    base = {"Seniority": 9, "Home": "rent", "Time": 60, "Age": 30, "Marital": "married", "Records": "no",
            "Job": "freelance", "Expenses": 73, "Income": 129, "Assets": 0, "Debt": 0, "Amount": 800, "Price": 846}
    return {**base, **overrides}


def customer(**overrides):
    base = {"senior_citizen": 0, "partner": 1, "dependents": 0, "tenure": 12, "phone_service": 1,
            "multiple_lines": "No", "internet_service": "Fiber optic", "online_security": "No", "online_backup": "Yes",
            "device_protection": "No", "tech_support": "No", "streaming_tv": "Yes", "streaming_movies": "No",
            "contract": "Month-to-month", "paperless_billing": 1, "payment_method": "Electronic check",
            "monthly_charges": 85.5, "total_charges": 1020.0}
    return {**base, **overrides}


def column(assembler: FeatureAssembler, name: str) -> int:
    return assembler.preprocessing.feature_names.index(name)


def codes(row) -> list[str]:
    return [g.reason_code for g in row.guards]


@pytest.mark.parametrize("family", FAMILIES)
def test_vector_layout_matches_manifest(assemblers, datasets, family, request):
    assembler = assemblers[family]
    entry = request.getfixturevalue("credit_entry" if family == "credit-risk" else "churn_entry")
    row = assembler.assemble(applicant() if family == "credit-risk" else customer())
    assert row.vector.dtype == np.float32
    assert row.vector.shape == (entry.manifest.n_features,)
    assert row.guards == ()
    names = assembler.preprocessing.feature_names
    for feat in entry.preprocessing.feature_schema.categorical:  # exactly one slot per one-hot block
        block = [i for i, n in enumerate(names) if n.startswith(feat.name + "=")]
        assert row.vector[block].sum() == 1.0


# -- C28: sentinels mean missing, never a clamped extreme ----------------------------------------

def test_c28_sentinels_become_default_not_clamped(assembler):
    row = assembler.assemble(applicant(Income=99999999, Assets=-1))
    assert set(codes(row)) == {"INCOME_SENTINEL_DEFAULTED", "ASSETS_SENTINEL_DEFAULTED"}
    missing = assembler.assemble(applicant(Income=None, Assets=None))
    clamped = assembler.assemble(applicant(Income=5000, Assets=0))
    inc, ass = column(assembler, "Income"), column(assembler, "Assets")
    # the sentinel takes exactly the default a missing value takes, never the clamped maximum
    assert row.vector[inc] == missing.vector[inc]
    assert row.vector[ass] == missing.vector[ass]
    assert row.vector[inc] != clamped.vector[inc]


def test_c28_sentinel_as_a_numeric_string_is_still_a_sentinel(assembler):
    as_text = assembler.assemble(applicant(Income="99999999", Assets=" -1 "))
    assert as_text.vector.tobytes() == assembler.assemble(applicant(Income=99999999, Assets=-1)).vector.tobytes()
    assert set(codes(as_text)) == {"INCOME_SENTINEL_DEFAULTED", "ASSETS_SENTINEL_DEFAULTED"}


def test_c28_churn_sentinel_becomes_the_default(churn):
    row = churn.assemble(customer(monthly_charges=-1, total_charges=-1))
    assert codes(row) == ["MONTHLY_CHARGES_SENTINEL_DEFAULTED", "TOTAL_CHARGES_SENTINEL_DEFAULTED"]
    missing = churn.assemble(customer(monthly_charges=None, total_charges=None))
    assert row.vector.tobytes() == missing.vector.tobytes()


@pytest.mark.parametrize("value,action", [(1e12, "CLAMPED_MAX"), (-5e9, "CLAMPED_MIN"), (float("inf"), "CLAMPED_MAX"),
                                          (float("-inf"), "CLAMPED_MIN"), (float("nan"), "MISSING_DEFAULTED"),
                                          (1e308, "CLAMPED_MAX"), ("", "MISSING_DEFAULTED"), ("  ", "MISSING_DEFAULTED")])
def test_extreme_numeric_values_are_guarded_before_the_float32_cast(assembler, churn, value, action):
    row = assembler.assemble(applicant(Amount=value))
    assert codes(row) == [f"AMOUNT_{action}"]
    assert np.isfinite(row.vector).all()
    if isinstance(value, float) and value == value and abs(value) != float("inf"):
        churn_row = churn.assemble(customer(tenure=value))  # whole numbers, also for an integer feature
        assert codes(churn_row) == [f"TENURE_{action}"] and np.isfinite(churn_row.vector).all()


def test_every_guard_of_a_request_is_reported_together(assembler):
    row = assembler.assemble(applicant(Income=99999999, Amount=1e9, Age=3, Home="houseboat", Job=None))
    assert set(codes(row)) == {"INCOME_SENTINEL_DEFAULTED", "AMOUNT_CLAMPED_MAX", "AGE_CLAMPED_MIN",
                               "HOME_UNKNOWN_CATEGORY", "JOB_MISSING_DEFAULTED"}


# -- C31: order, unknown attributes, golden vectors -------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_c31_attribute_order_does_not_change_the_vector(assemblers, datasets, family):
    for record in datasets[family].records[:20]:
        backward = dict(reversed(list(record.items())))
        assert list(record) != list(backward)
        a, b = assemblers[family].assemble(record), assemblers[family].assemble(backward)
        assert a.vector.tobytes() == b.vector.tobytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_c31_unknown_attribute_is_ignored_and_reported(assemblers, family):
    base = applicant() if family == "credit-risk" else customer()
    row = assemblers[family].assemble({**base, "FavouriteColour": "blue"})
    assert row.unknown_attributes == ("FavouriteColour",)
    assert row.vector.tobytes() == assemblers[family].assemble(base).vector.tobytes()


def test_c31_churn_ignores_the_attribute_its_schema_leaves_out(churn):
    """`female` is in the source table but deliberately not a feature: ignored and reported."""
    row = churn.assemble(customer(female=1))
    assert row.unknown_attributes == ("female",)
    assert row.vector.tobytes() == churn.assemble(customer(female=0)).vector.tobytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_c31_golden_vectors_for_real_entities(assemblers, datasets, family):
    """Checked-in vectors for real entities: any silent change to assembly or fitting fails here."""
    assembler = assemblers[family]
    golden = json.loads((GOLDEN / f"{family}-v1.json").read_text())
    assert golden["feature_names"] == list(assembler.preprocessing.feature_names)
    assert golden["preprocessing_hash"] == assembler.preprocessing.hash, "fitted preprocessing changed"
    by_id = dict(zip(datasets[family].entity_ids, datasets[family].records))
    for case in golden["entities"]:
        record = by_id[case["entity_id"]]
        expected = np.array(case["vector"], dtype=np.float32)
        np.testing.assert_array_equal(assembler.assemble(record).vector, expected)
        shuffled = dict(sorted(record.items()))  # alphabetical, not schema order
        np.testing.assert_array_equal(assembler.assemble(shuffled).vector, expected)


# -- C32: categories never seen in training -----------------------------------------------------

@pytest.mark.parametrize("family,feature,value", [("credit-risk", "Home", "houseboat"),
                                                  ("churn", "contract", "Three year"),
                                                  ("churn", "payment_method", "Bitcoin")])
def test_c32_unseen_category_goes_to_the_unknown_slot(assemblers, family, feature, value):
    assembler = assemblers[family]
    base = applicant() if family == "credit-risk" else customer()
    row = assembler.assemble({**base, feature: value})
    assert codes(row) == [f"{feature.upper()}_UNKNOWN_CATEGORY"]
    assert row.vector[column(assembler, f"{feature}=<unknown>")] == 1.0
    block = [i for i, n in enumerate(assembler.preprocessing.feature_names) if n.startswith(feature + "=")]
    assert row.vector[block].sum() == 1.0  # never also a real category


@pytest.mark.parametrize("value", [None, "", "   ", float("nan")])
def test_c32_empty_or_null_category_is_missing_not_unknown(assembler, credit_entry, value):
    row = assembler.assemble(applicant(Home=value))
    assert codes(row) == ["HOME_MISSING_DEFAULTED"]
    default = credit_entry.preprocessing.categorical["Home"].default
    assert row.vector[column(assembler, f"Home={default}")] == 1.0


def test_c32_categories_are_normalised_by_the_schema_rule(assembler, churn):
    assert assembler.assemble(applicant(Home="  RENT ")).vector.tobytes() == assembler.assemble(applicant()).vector.tobytes()
    assert churn.assemble(customer(contract=" MONTH-TO-MONTH")).vector.tobytes() == churn.assemble(customer()).vector.tobytes()


# -- explicit conversion rules ------------------------------------------------------------------

def test_numeric_strings_are_converted_by_rule(assembler):
    for text in ("30", " 30 ", "30.0", "3e1", "+30"):
        assert assembler.assemble(applicant(Age=text)).vector.tobytes() == assembler.assemble(applicant(Age=30)).vector.tobytes()


@pytest.mark.parametrize("text", ["thirty", "nan", "inf", "-Infinity", "1,000", "1_000", "0x1e", "30 years",
                                  "\u0663\u0660", "\uff13\uff10", "\u0969\u0966"])  # 30 in Arabic-Indic, full-width, Devanagari digits
def test_strings_that_are_not_plain_decimals_are_refused_never_null(assembler, text):
    with pytest.raises(ConversionError) as excinfo:
        assembler.assemble(applicant(Age=text))
    assert set(excinfo.value.problems) == {"Age"}


def test_integer_feature_refuses_fractions(churn):
    assert churn.assemble(customer(tenure="12")).vector.tobytes() == churn.assemble(customer(tenure=12.0)).vector.tobytes()
    with pytest.raises(ConversionError) as excinfo:
        churn.assemble(customer(tenure=12.5))
    assert "whole number" in excinfo.value.problems["tenure"]


@pytest.mark.parametrize("yes", [True, 1, 1.0, "yes", " Y ", "TRUE", "1"])
def test_boolean_feature_conversion_table(churn, yes):
    assert churn.assemble(customer(partner=yes)).vector.tobytes() == churn.assemble(customer(partner=1)).vector.tobytes()


@pytest.mark.parametrize("bad", [2, -1, 0.5, "maybe", "2"])
def test_boolean_feature_refuses_anything_else(churn, bad):
    with pytest.raises(ConversionError) as excinfo:
        churn.assemble(customer(partner=bad))
    assert set(excinfo.value.problems) == {"partner"}


def test_category_booleans_follow_the_yes_no_rule_or_are_refused(churn, assembler):
    assert churn.assemble(customer(online_security=True)).vector.tobytes() == \
        churn.assemble(customer(online_security="Yes")).vector.tobytes()
    with pytest.raises(ConversionError):
        assembler.assemble(applicant(Records=True))  # credit's Records refuses booleans


def test_unconvertible_values_are_all_reported_together(assembler, churn):
    with pytest.raises(ConversionError) as excinfo:
        assembler.assemble(applicant(Age="thirty", Home=3.0, Records=True, Income=True))
    assert set(excinfo.value.problems) == {"Age", "Home", "Records", "Income"}
    with pytest.raises(ConversionError) as excinfo:
        churn.assemble(customer(tenure=1.5, partner="maybe", contract=2, monthly_charges=[1]))
    assert set(excinfo.value.problems) == {"tenure", "partner", "contract", "monthly_charges"}


def test_rules_declared_in_a_schema(tmp_path):
    """Rules other families may choose: strings refused, category codes from numbers, missing markers."""
    schema = FeatureSchema.model_validate({
        "name": "toy", "version": "toy/v1", "target": {"column": "y", "positive": "1"},
        "numeric": [{"name": "amount", "min": 0, "max": 100, "strings": "refuse"}],
        "categorical": [{"name": "region", "numbers": "integer_string", "missing_values": ["N/A", "?"]}],
    })
    rows = [{"amount": a, "region": r} for a, r in [(1, "1"), (5, "2"), (9, "2"), (3, "north")]]
    assembler = FeatureAssembler(Preprocessing.fit(schema, rows))
    with pytest.raises(ConversionError):
        assembler.assemble({"amount": "5", "region": "1"})
    assert assembler.assemble({"amount": 5, "region": 2.0}).vector.tobytes() == \
        assembler.assemble({"amount": 5, "region": "2"}).vector.tobytes()
    with pytest.raises(ConversionError):
        assembler.assemble({"amount": 5, "region": 2.5})
    for marker in ("n/a", " ? "):
        assert codes(assembler.assemble({"amount": 5, "region": marker})) == ["REGION_MISSING_DEFAULTED"]


# -- the schema file itself ---------------------------------------------------------------------

def test_preprocessing_hash_is_stable_across_save_and_load(credit_entry, tmp_path):
    path = tmp_path / "p.json"
    credit_entry.preprocessing.save(path)
    assert Preprocessing.load(path).hash == credit_entry.preprocessing.hash


def test_schema_rejects_unknown_keys(credit_schema):
    bad = credit_schema.model_dump(mode="json")
    bad["numeric"][0]["maxx"] = 3
    with pytest.raises(ValueError):
        FeatureSchema.model_validate(bad)


@pytest.mark.parametrize("feature", [
    {"name": "x", "min": 0, "max": 1e39},  # beyond float32
    {"name": "x", "min": 5, "max": 1},
    {"name": "x", "min": 0, "max": 10, "default": 11},
    {"name": "x", "type": "boolean", "min": 0, "max": 2},
    {"name": "x", "min": -1, "max": 10, "transform": "log1p"},
])
def test_schema_refuses_ranges_the_guards_could_not_honour(feature):
    with pytest.raises(ValueError):
        FeatureSchema.model_validate({"name": "t", "version": "t/v1", "target": {"column": "y", "positive": "1"},
                                      "numeric": [feature]})


def test_personal_data_flags(credit_schema, churn_schema):
    assert {"Income", "Assets", "Debt", "Marital"} <= credit_schema.personal_data
    assert {"senior_citizen", "partner", "dependents"} <= churn_schema.personal_data


# -- occlusion baseline used by explanations ----------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_occlusion_rows_equal_assembling_without_that_attribute(assemblers, datasets, family):
    assembler = assemblers[family]
    record = datasets[family].records[1]
    vector = assembler.assemble(record).vector
    occluded = assembler.occlusions(vector)
    names = assembler.preprocessing.feature_schema.attribute_names
    assert occluded.shape == (len(names), assembler.n_features) and occluded.dtype == np.float32
    for k, name in enumerate(names):
        without = assembler.assemble({a: v for a, v in record.items() if a != name}).vector
        np.testing.assert_array_equal(occluded[k], without)


# -- values as the wire delivers them --------------------------------------------------------------

def _wire_like(record: dict) -> dict:
    """The record as the wire delivers it: every number a Python float."""
    return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in record.items()}


def test_wire_numbers_convert_exactly_as_other_numbers(assemblers, datasets):
    """The float fast path of ``to_number`` gives the vectors the general path gives."""
    for family, assembler in assemblers.items():
        for record in datasets[family].records[:200]:
            wire, plain = assembler.assemble(_wire_like(record)), assembler.assemble(record)
            assert wire.vector.tobytes() == plain.vector.tobytes() and wire.guards == plain.guards


@pytest.mark.parametrize(("given", "suggested"), [("income", "Income"), ("Incme", "Income"), ("HOME", "Home"),
                                                  ("Shoe size", None)])
def test_an_unknown_attribute_names_the_closest_known_one(credit_schema, given, suggested):
    from mlpair.prediction.preparing.batch import _did_you_mean

    hint = _did_you_mean(given, credit_schema.attribute_names)
    assert hint == (f" (did you mean {suggested!r}?)" if suggested else "")
