"""The demo and its report are clients of the pair like any other: they reach both services through
``mlpair.client`` and read only the shared contracts, training and the generated ``mlpair.api``,
never PredictionService's or InferenceService's code (read with ``ast``; every import counts, also
one inside a function or under ``if TYPE_CHECKING:``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO_MODULES = ("mlpair/demo.py", "mlpair/demo_summary.py", "mlpair/local_pair.py", "mlpair/report.py")
# what they may import of the project: the public client, the shared contracts, training, the
# generated wire code, and one another
ALLOWED = ("mlpair.client", "mlpair.contracts", "mlpair.training", "mlpair.api",
           "mlpair.demo", "mlpair.demo_summary", "mlpair.local_pair", "mlpair.report")


def imported_modules(source: str) -> list[str]:
    """Every module an import statement anywhere in ``source`` names (``from mlpair import x`` names
    ``mlpair.x``; relative imports resolved against the ``mlpair`` package)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("mlpair" + ("." + node.module if node.module else "")) if node.level else (node.module or "")
            names += [f"{base}.{alias.name}" if base == "mlpair" else base for alias in node.names]
    return names


def internals(source: str) -> list[str]:
    """The project modules ``source`` imports that are not in :data:`ALLOWED`."""
    return [name for name in imported_modules(source)
            if (name == "mlpair" or name.startswith("mlpair."))
            and not any(name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED)]


def test_the_check_finds_internal_imports_wherever_they_are():
    source = (
        "from typing import TYPE_CHECKING\nimport numpy as np\nfrom mlpair.client import PredictionClient\n"
        "from mlpair import contracts\n"
        "if TYPE_CHECKING:\n    from mlpair.inference.settings import InferenceSettings\n"
        "def f():\n    from mlpair.prediction.intake.converters import to_attributes\n    import mlpair.rpc\n"
        "    from . import workers\n"
    )
    assert internals(source) == ["mlpair.inference.settings", "mlpair.prediction.intake.converters", "mlpair.rpc",
                                 "mlpair.workers"]


@pytest.mark.parametrize("module", DEMO_MODULES)
def test_the_demo_and_report_use_only_the_public_client_and_the_contracts(module):
    found = internals((ROOT / module).read_text())
    assert not found, f"{module} imports {found}: use mlpair.client (or mlpair.contracts) instead"


def test_the_demo_uses_the_public_client():
    names = imported_modules((ROOT / "mlpair/demo.py").read_text())
    assert "mlpair.client" in names


def test_the_crm_table_the_demo_counts_is_the_one_prediction_service_writes():
    from mlpair.demo import CRM_TABLE
    from mlpair.prediction.recording.models import DecisionRecord

    assert DecisionRecord.__tablename__ == CRM_TABLE
    assert DecisionRecord.__table__.c.request_id.unique
