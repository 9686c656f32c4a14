"""The model manifest's published format: the JSON Schema in the repository, its version field, checks on load."""

from __future__ import annotations

import json
import shutil
import tomllib
from importlib import resources

import jsonschema
import pytest

from mlpair.contracts.manifest import Manifest, ManifestError, load_entry, write_manifest
from mlpair.contracts.manifest_format import FORMAT_VERSION, FormatError, check_manifest, manifest_schema
from tests.support import REPO_ROOT

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def entry_copy(credit_entry, tmp_path):
    """A copy of the trained credit-risk version 1, and a function that rewrites its manifest."""
    target = tmp_path / "credit-risk" / "1"
    shutil.copytree(credit_entry.path, target)

    def rewrite(change):
        raw = json.loads((target / "manifest.json").read_text())
        change(raw)
        (target / "manifest.json").write_text(json.dumps(raw))
        return target

    return rewrite


def test_the_schema_is_shipped_in_the_package_and_valid():
    shipped = resources.files("mlpair.contracts").joinpath("manifest.schema.json")
    assert shipped.is_file()
    assert json.loads(shipped.read_text()) == json.loads((REPO_ROOT / "mlpair/contracts/manifest.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(manifest_schema())
    package_data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert package_data["mlpair.contracts"] == ["manifest.schema.json"]


def test_the_schema_names_every_manifest_field_and_requires_those_without_a_default():
    schema = manifest_schema()
    assert set(schema["properties"]) == set(Manifest.model_fields)
    required = {name for name, field in Manifest.model_fields.items() if field.is_required()}
    assert set(schema["required"]) == required


def test_a_trained_manifest_is_format_1_written_without_the_field_and_follows_the_schema(credit_entry, churn_entry):
    """Format 1 is written without ``format_version``: the release before the format refuses a field
    it does not know, and keeps reading versions trained now during a rollout."""
    for entry in (credit_entry, churn_entry):
        raw = json.loads((entry.path / "manifest.json").read_text())
        assert "format_version" not in raw and FORMAT_VERSION == 1 and check_manifest(raw) == 1
        assert entry.manifest.format_version == 1
        jsonschema.validate(raw, manifest_schema())
        assert "files" not in raw and "content_digest" not in raw  # optional pinning, only when set


def test_a_manifest_written_before_the_format_field_loads_as_format_1(entry_copy, credit_entry):
    path = entry_copy(lambda raw: raw.pop("format_version", None))
    assert "format_version" not in json.loads((path / "manifest.json").read_text())
    assert check_manifest(json.loads((path / "manifest.json").read_text())) == 1
    loaded = load_entry(path)
    assert loaded.manifest.format_version == 1
    assert loaded.manifest.versions == credit_entry.manifest.versions


def test_a_newer_format_is_refused_with_one_line(entry_copy):
    path = entry_copy(lambda raw: raw.update(format_version=2))
    with pytest.raises(ManifestError) as refused:
        load_entry(path)
    assert str(refused.value) == (
        f"{path}: manifest format 2 is newer than this release reads (format 1); upgrade mlpair"
    )


@pytest.mark.parametrize(("change", "expected"), [
    (lambda raw: raw.update(model_sha256="abc"), ".model_sha256: 'abc' does not match '^sha256:[0-9a-f]{64}$'"),
    (lambda raw: raw.update(owner="risk team"), "(top level): Additional properties are not allowed ('owner' was unexpected)"),
    (lambda raw: raw.pop("calibration"), "(top level): 'calibration' is a required property"),
    (lambda raw: raw["inputs"][0].update(data_type="INT64"), ".inputs[0].data_type: 'FP32' was expected"),
    (lambda raw: raw["calibration"].update(temperature=0), ".calibration.temperature: 0 is less than or equal to the minimum of 0"),
    (lambda raw: raw.update(format_version="1"), "manifest format_version '1' is not a positive integer"),
    (lambda raw: raw.update(files={"../model.onnx": DIGEST}), ".files: '../model.onnx' does not match"),
    (lambda raw: raw.update(content_digest="md5:00"), ".content_digest: 'md5:00' does not match"),
])
def test_a_manifest_off_the_format_is_refused_naming_the_field(entry_copy, change, expected):
    path = entry_copy(change)
    with pytest.raises(ManifestError) as refused:
        load_entry(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert expected in message


def test_the_optional_pinning_fields_are_read_and_written(entry_copy, tmp_path):
    files = {"model.onnx": DIGEST, "preprocessing.json": DIGEST, "model.pt2": DIGEST}
    path = entry_copy(lambda raw: raw.update(files=files, content_digest=DIGEST))
    manifest = load_entry(path).manifest
    assert manifest.files == files and manifest.content_digest == DIGEST
    out = tmp_path / "written"
    out.mkdir()
    write_manifest(out, manifest)
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["files"] == files and raw["content_digest"] == DIGEST and "format_version" not in raw


def test_a_manifest_off_the_format_is_never_written(credit_entry, tmp_path):
    bad = credit_entry.manifest.model_copy(update={"content_digest": "sha256:short"})
    with pytest.raises(FormatError, match="content_digest"):
        write_manifest(tmp_path, bad)
    assert not (tmp_path / "manifest.json").exists()


def test_the_format_document_lists_every_field_of_the_schema():
    doc = (REPO_ROOT / "docs" / "model-format.md").read_text()
    table = doc.split("## The manifest, format 1", 1)[1].split("### Change policy", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {name.strip(" `") for row in rows for name in row.split(",")}
    assert documented == set(manifest_schema()["properties"])
    assert "absent = 1" in table and "format 1 is written without the field" in table
