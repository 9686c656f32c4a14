"""Paths and small helpers shared by tests (fixtures live in conftest.py files).

The package holds every helper more than one test module uses; a test module imports from here
(or from its folder's conftest.py for fixtures), never from another test module, and never from
``bench/`` (``tests/test_structure.py`` checks both):

* :mod:`tests.support.pair` — both services as real processes, scratch PostgreSQL databases,
  a cuttable TCP proxy, the credit-risk workload (the benchmarks use it too).
* :mod:`tests.support.source` — the product's modules and import graph, read with ``ast``.
* :mod:`tests.support.inference` — InferenceService requests and replies, slow and broken models.
* :mod:`tests.support.ledger` — decisions, opened ledgers, CRM rows and the relay as a process.
* :mod:`tests.support.records` — what a client may send for an attribute (hypothesis strategies).
* :mod:`tests.support.e2e` — Predict requests, expected probabilities, trace headers, worker listeners.
* :mod:`tests.support.events` — a NATS server with JetStream of the test's own, stopped and restarted by PID.

This module itself holds the paths, a hand-set :class:`Clock` and the service checks.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "config"
CREDIT_SCHEMA = CONFIG_DIR / "credit-risk" / "feature-schema.toml"
CHURN_SCHEMA = CONFIG_DIR / "churn" / "feature-schema.toml"

# Tests never use PostgreSQL's `test` database directly: each session creates its own
# throw-away database (the `postgres_url` fixture, tests.support.pair.scratch_postgres), so parallel
# runs and schema changes never collide.
POSTGRES_HOST, POSTGRES_PORT = "127.0.0.1", 5432


class Clock:
    """A clock a test sets by hand (``clock.now += 2.0``), for the product's ``clock=`` parameters."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def defaulted(entry, record: dict) -> frozenset[str]:
    """The features of ``record`` that take their default under ``entry``'s preprocessing (missing,
    or a sentinel): what a policy's missing-data rule reads (``DecisionPolicy.decide(..., missing=)``)."""
    from mlpair.contracts.assembly import MISSING_DEFAULTED, SENTINEL_DEFAULTED, FeatureAssembler

    guards = FeatureAssembler(entry.preprocessing).assemble(record).guards
    return frozenset(e.feature for e in guards if e.action in (MISSING_DEFAULTED, SENTINEL_DEFAULTED))


def require_service(name: str, host: str, port: int) -> None:
    """Skips the calling test when a local service is down; under CI=true that is a failure."""
    import pytest

    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        message = f"{name} is not reachable at {host}:{port}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must run against the real service")
        pytest.skip(f"{message}; start it to run this test")


async def migrate_for(settings) -> None:
    """What the pre-deploy job does (`mlpair migrate`) for the settings' ledger and CRM."""
    from mlpair.prediction.recording.admin import migrate

    await migrate(settings.ledger_url, settings.crm_url)


async def start_prediction(settings, **kwargs):
    """`mlpair migrate` for ``settings``, then :func:`mlpair.prediction.server.start`."""
    from mlpair.prediction.server import start

    await migrate_for(settings)
    return await start(settings, **kwargs)


def _normal(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(name: str, extras: set[str]) -> set[str]:
    """Normalised names of ``name[extras]`` and every installed distribution it requires, recursively."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(_normal(name), frozenset(extras))]
    while todo:
        item = todo.pop()
        if item in seen:
            continue
        seen.add(item)
        try:
            requires = metadata.requires(item[0]) or []
        except metadata.PackageNotFoundError:  # required only on another platform
            continue
        for req in map(Requirement, requires):
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in item[1] | {""}):
                todo.append((_normal(req.name), frozenset(req.extras)))
    return {dist for dist, _ in seen}


# Imported first by every Python process that has its folder on PYTHONPATH: hides the modules
# listed in MLPAIR_HIDDEN_MODULES, as if their distributions were not installed.
_HIDE = '''
import os, sys

class _Hidden:
    names = frozenset(os.environ.get("MLPAIR_HIDDEN_MODULES", "").split())

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the slim install)", name=name)
        return None

sys.meta_path.insert(0, _Hidden())
'''


def slim_environment(folder: Path, extra: str = "demo") -> dict[str, str]:
    """Environment variables for subprocesses that see only what ``mlpair[extra]`` installs: every
    module of any other installed distribution fails to import (optional imports fall back, as
    they would in a slim virtualenv). ``folder`` receives the ``sitecustomize.py`` that hides them."""
    import importlib.metadata as metadata

    keep = requirement_closure("mlpair", {extra}) | {"pip", "setuptools"}
    hidden = sorted(module for module, dists in metadata.packages_distributions().items()
                    if not {_normal(d) for d in dists} & keep)
    (folder / "sitecustomize.py").write_text(_HIDE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "MLPAIR_HIDDEN_MODULES": " ".join(hidden)}
