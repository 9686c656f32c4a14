"""Fixtures the prediction wing's tests share: scratch PostgreSQL databases, bare and migrated.

Plain helpers (decisions, ledgers, Predict requests, a hand-set clock) live in :mod:`tests.support`;
the session-wide fixtures (a trained model repository, a running InferenceService, the session's
``postgres_url``) in ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest

from mlpair.prediction.recording.admin import migrate
from tests.support import POSTGRES_HOST, POSTGRES_PORT, require_service
from tests.support.pair import scratch_postgres


@pytest.fixture
def fresh_postgres(request):
    """A PostgreSQL database of the test's own, named after its module, dropped afterwards (a sync
    fixture: creating the database runs its own short event loop). Skips the test when PostgreSQL
    is down (fails it under CI=true)."""
    require_service("PostgreSQL", POSTGRES_HOST, POSTGRES_PORT)
    module = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    with scratch_postgres(prefix=f"mlpair_{module}") as url:
        yield url


@pytest.fixture
async def migrated_postgres(fresh_postgres):
    """:func:`fresh_postgres` with the decision ledger (schema ``prediction``) and the CRM migrated
    into it, as ``mlpair migrate`` leaves them; its URL serves as both the ledger and the CRM URL."""
    await migrate(fresh_postgres, fresh_postgres)
    return fresh_postgres
