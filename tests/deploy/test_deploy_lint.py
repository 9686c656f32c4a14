"""Project lint: every workload has resources, native gRPC probes and a locked-down
securityContext; every YAML file under deploy/ passes yamllint. Each rule is also shown to fire
on a deliberately broken fixture."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import deploy_checks as dc
import pytest


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_every_workload_passes_the_lint(rendered: dict, overlay: str) -> None:
    workloads = [obj for obj in rendered[overlay] if obj["kind"] in dc.WORKLOAD_KINDS]
    assert len(workloads) >= 2
    problems = [problem for workload in workloads for problem in dc.lint_workload(workload)]
    assert problems == []


def test_lint_rejects_the_unhardened_fixture(fixtures_dir: Path) -> None:
    (deployment,) = dc.load_file(fixtures_dir / "broken" / "deployment-unhardened.yaml")
    problems = "\n".join(dc.lint_workload(deployment))
    for expected in (
        "no dedicated serviceAccountName",
        "automountServiceAccountToken is not false",
        "runAsNonRoot is not true",
        "seccompProfile is not RuntimeDefault",
        "terminationGracePeriodSeconds is not set",
        "has no fixed tag or digest",
        "resources.requests.memory: not a Kubernetes quantity: '8GB'",
        "resources.limits.cpu missing",
        "startupProbe missing",
        "livenessProbe missing",
        "readinessProbe is not a native gRPC probe",
        "lifecycle.preStop missing",
        "allowPrivilegeEscalation is not false",
        "readOnlyRootFilesystem is not true",
        "capabilities.drop does not include ALL",
    ):
        assert expected in problems, f"lint missed: {expected}"


def test_lint_catches_a_request_above_its_limit(rendered: dict) -> None:
    # A single-field change to a good workload must be caught on its own.
    broken = copy.deepcopy(dc.by_name(rendered["prod"], "Deployment", "prediction-stable"))
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] = "2Gi"
    assert dc.lint_workload(broken) == [
        "Deployment/prediction-stable container prediction: request memory=2Gi exceeds limit 1Gi"
    ]


@pytest.mark.parametrize("overlay", dc.OVERLAYS)
def test_every_job_passes_the_pod_lint(rendered: dict, overlay: str) -> None:
    # A Job serves nothing (no probes, no preStop), but runs as hardened as the services.
    (job,) = dc.jobs(rendered[overlay])
    assert dc.lint_pod(job) == []
    unhardened = copy.deepcopy(job)
    del unhardened["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"]
    assert dc.lint_pod(unhardened) == [
        "Job/prediction-migrate: securityContext.runAsNonRoot is not true"
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("500m", "0.5"),
        ("2", "2"),
        (4, "4"),
        ("8Gi", str(8 * 2**30)),
        ("1e3", "1000"),
        ("128Mi", str(128 * 2**20)),
    ],
)
def test_quantities_parse_like_kubernetes(value: object, expected: str) -> None:
    assert dc.parse_quantity(value) == dc.Decimal(expected)


@pytest.mark.parametrize("value", ["8GB", "1.5 Gi", "", "Gi", "-"])
def test_malformed_quantities_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        dc.parse_quantity(value)


def _yamllint(*paths: Path) -> subprocess.CompletedProcess:
    pytest.importorskip("yamllint", reason="yamllint is not installed (pip install -e '.[deploy]')")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "yamllint",
            "--strict",
            "-f",
            "parsable",
            "-c",
            str(dc.DEPLOY_DIR / "yamllint.yaml"),
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_yamllint_passes_on_deploy() -> None:
    result = _yamllint(dc.DEPLOY_DIR)
    assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint_rejects_duplicate_keys_and_yaml11_booleans(fixtures_dir: Path) -> None:
    result = _yamllint(fixtures_dir / "broken" / "duplicate-key.yaml")
    assert result.returncode != 0
    assert "key-duplicates" in result.stdout
    assert "truthy" in result.stdout
