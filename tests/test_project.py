"""Project-level checks: generated code is current, every CLI command documents itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlpair import protogen


def test_generated_code_matches_the_protos():
    assert protogen.check() == [], "run `make protos` and commit the result"


@pytest.mark.parametrize("command", [["train"], ["serve", "inference"], ["serve", "prediction"], ["demo"], ["health"],
                                     ["predict"], ["attributes"], ["drift-report"], ["score"]])
def test_cli_commands_have_help(command):
    out = subprocess.run([sys.executable, "-m", "mlpair.cli", *command, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: mlpair" in out.stdout


def test_settings_come_from_the_environment(monkeypatch):
    from mlpair.inference.settings import InferenceSettings
    from mlpair.prediction.settings import PredictionSettings

    monkeypatch.setenv("INFERENCE_MAX_BATCH_SIZE", "77")
    monkeypatch.setenv("PREDICTION_INFERENCE_TARGET", "inference:8001")
    assert InferenceSettings().max_batch_size == 77
    assert PredictionSettings().inference_target == "inference:8001"
