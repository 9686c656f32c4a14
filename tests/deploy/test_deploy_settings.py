"""The manifests speak the services' language: every INFERENCE_*/PREDICTION_* variable they set
is a field of the service's settings class with a valid value (the classes ignore unknown
variables, so a misspelled one would silently fall back to a default), and the container
commands, the schema migration Job's included, parse with the real `mlpair` CLI.

Needs the mlpair package importable (as in `make test`); skipped otherwise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import deploy_checks as dc
import pytest

SETTINGS = {
    "inference": ("mlpair.inference.settings", "InferenceSettings", "INFERENCE_"),
    "prediction": ("mlpair.prediction.settings", "PredictionSettings", "PREDICTION_"),
}
# The settings class each pod's process reads, by app.kubernetes.io/name: `mlpair migrate` takes
# its ledger and CRM URLs from PredictionSettings, as the service does.
SERVICE_OF = {
    "inference": "inference",
    "prediction": "prediction",
    "prediction-migrate": "prediction",
    "prediction-relay": "prediction",
}


def settings_class(service: str) -> type:
    module_name, class_name, _ = SETTINGS[service]
    module = pytest.importorskip(
        module_name, reason="mlpair is not installed (pip install -e '.[dev]')"
    )
    return getattr(module, class_name)


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_every_variable_is_a_valid_settings_field(
    rendered: dict, overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = rendered[overlay]
    for workload in dc.pod_owners(objects):
        service = SERVICE_OF[dc.app_of(workload)]
        cls = settings_class(service)
        prefix = SETTINGS[service][2]
        container = dc.pod_spec(workload)["containers"][0]
        # The model source's connection: the S3 SDK's own variables, from its Secret
        # (deploy_checks.model_source_problems checks where they come from).
        names = set(dc.settings_of(workload, objects)) | {
            v["name"] for v in container.get("env", ())
        }
        names -= set(dc.MODEL_SOURCE_ENV)
        fields = {name.removeprefix(prefix).lower() for name in names}
        assert all(name.startswith(prefix) for name in names), dc.name_of(workload)
        assert fields <= set(cls.model_fields), (
            f"{dc.name_of(workload)}: unknown {sorted(fields - set(cls.model_fields))}"
        )
        # Literal values through the class's own parsing, from the environment as in the pod
        # (JSON for lists and maps, Literal choices, numbers); Secret values are not in the render.
        for name in [n for n in os.environ if n.startswith(prefix)]:
            monkeypatch.delenv(name)
        values = dc.settings_of(workload, objects)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        settings = cls()
        for name, value in values.items():
            parsed = getattr(settings, name.removeprefix(prefix).lower())
            if isinstance(parsed, (list, dict)):
                assert parsed == json.loads(value), name
            elif isinstance(parsed, Path):
                assert str(parsed) == value, name
            elif isinstance(parsed, bool):
                assert parsed is (value == "true"), name
            elif isinstance(parsed, (int, float)):
                assert parsed == float(value), name
            else:
                assert str(parsed) == value, name


def test_container_commands_parse_with_the_cli(rendered: dict) -> None:
    cli = pytest.importorskip(
        "mlpair.cli", reason="mlpair is not installed (pip install -e '.[dev]')"
    )
    parser = cli.build_parser()
    for workload in dc.workloads(rendered["prod"]):
        service = dc.app_of(workload)
        args = parser.parse_args(dc.pod_spec(workload)["containers"][0]["args"])
        if service == dc.RELAY:
            assert args.command == "relay"
            continue
        assert (args.command, args.role) == ("serve", service)
    (job,) = dc.jobs(rendered["prod"])
    args = parser.parse_args(dc.pod_spec(job)["containers"][0]["args"])
    assert (args.command, args.serving_role) == ("migrate", "mlpair_prediction")
    # The URLs come from the environment (the owner Secrets), never from the arguments; the
    # one-time moves from per-pod outboxes are not part of every release.
    assert (args.ledger_url, args.crm_url, args.import_outbox, args.backfill_from_crm) == (
        None,
        None,
        None,
        False,
    )
    for port in (8001, 9001):
        args = parser.parse_args(["health", "--target", f"127.0.0.1:{port}"])
        assert args.target == f"127.0.0.1:{port}"
