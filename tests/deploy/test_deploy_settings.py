"""The manifests speak the services' language: every INFERENCE_*/PREDICTION_* variable they set
is a field of the service's settings class with a valid value (the classes ignore unknown
variables, so a misspelled one would silently fall back to a default), and the container
commands parse with the real `mlpair` CLI.

Needs the mlpair package importable (as in `make test`); skipped otherwise."""

from __future__ import annotations

import deploy_checks as dc
import pytest

SETTINGS = {
    "inference": ("mlpair.inference.settings", "InferenceSettings", "INFERENCE_"),
    "prediction": ("mlpair.prediction.settings", "PredictionSettings", "PREDICTION_"),
}


def settings_class(service: str) -> type:
    module_name, class_name, _ = SETTINGS[service]
    module = pytest.importorskip(
        module_name, reason="mlpair is not installed (pip install -e '.[dev]')"
    )
    return getattr(module, class_name)


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_every_variable_is_a_valid_settings_field(rendered: dict, overlay: str) -> None:
    objects = rendered[overlay]
    for workload in dc.of_kind(objects, "Deployment"):
        service = dc.pod_labels(workload)["app.kubernetes.io/name"]
        cls = settings_class(service)
        prefix = SETTINGS[service][2]
        container = dc.pod_spec(workload)["containers"][0]
        names = set(dc.settings_of(workload, objects)) | {
            v["name"] for v in container.get("env", ())
        }
        fields = {name.removeprefix(prefix).lower() for name in names}
        assert fields <= set(cls.model_fields), (
            f"{dc.name_of(workload)}: unknown {sorted(fields - set(cls.model_fields))}"
        )
        # Literal values through the class's own validation (types, Literal choices).
        values = {
            k.removeprefix(prefix).lower(): v for k, v in dc.settings_of(workload, objects).items()
        }
        settings = cls(**values)
        assert str(settings.port) == values["port"]


def test_container_commands_parse_with_the_cli(rendered: dict) -> None:
    cli = pytest.importorskip(
        "mlpair.cli", reason="mlpair is not installed (pip install -e '.[dev]')"
    )
    parser = cli.build_parser()
    for workload in dc.of_kind(rendered["prod"], "Deployment"):
        service = dc.pod_labels(workload)["app.kubernetes.io/name"]
        args = parser.parse_args(dc.pod_spec(workload)["containers"][0]["args"])
        assert (args.command, args.role) == ("serve", service)
    for port in (8001, 9001):
        args = parser.parse_args(["health", "--target", f"127.0.0.1:{port}"])
        assert args.target == f"127.0.0.1:{port}"
