"""Paths and small helpers shared by tests (fixtures live in conftest.py files)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "config"
CREDIT_SCHEMA = CONFIG_DIR / "credit-risk" / "feature-schema.toml"
CHURN_SCHEMA = CONFIG_DIR / "churn" / "feature-schema.toml"

import os
import socket

# Tests never use PostgreSQL's `test` database directly: each session creates its own
# throw-away database (the `postgres_url` fixture, bench.pair.scratch_postgres), so parallel
# runs and schema changes never collide.
POSTGRES_HOST, POSTGRES_PORT = "127.0.0.1", 5432


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
    from mlpair.prediction.crm.admin import migrate

    await migrate(settings.ledger_url, settings.crm_url)


async def start_prediction(settings, **kwargs):
    """`mlpair migrate` for ``settings``, then :func:`mlpair.prediction.server.start`."""
    from mlpair.prediction.server import start

    await migrate_for(settings)
    return await start(settings, **kwargs)
