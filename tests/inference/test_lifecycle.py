"""Start-up refusals: no models, or an inconsistent version triple."""

from __future__ import annotations

import json
import shutil

import pytest

from mlpair.contracts.manifest import ManifestError
from mlpair.inference.errors import ModelNotFound
from mlpair.inference.server import start
from mlpair.inference.settings import InferenceSettings


def settings(root) -> InferenceSettings:
    return InferenceSettings(host="127.0.0.1", port=0, metrics_port=0, model_repository=root)


async def test_refuses_to_start_without_models(tmp_path):
    with pytest.raises(ModelNotFound):
        await start(settings(tmp_path))


async def test_refuses_to_start_on_an_inconsistent_triple(credit_entry, tmp_path):
    target = tmp_path / "credit-risk" / "1"
    shutil.copytree(credit_entry.path, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["versions"]["feature_schema_version"] = "credit-risk/v9"
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="credit-risk/v9"):
        await start(settings(tmp_path))
