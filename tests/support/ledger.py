"""Decisions, opened ledgers, CRM rows, the relay and the CLI as processes: what the ledger tests share."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from mlpair.prediction.recording.store import CrmStore
from mlpair.prediction.records import StoredDecision
from tests.fault_support import eventually, free_port, health_of
from tests.support import REPO_ROOT

SERVING = health_pb2.HealthCheckResponse.SERVING
SLOW_MACHINE_S = 15.0  # statement timeout outside the fault tests: a loaded 2-core CI machine must not time out


def decision(request_id: str, probability: float = 0.2, decision: str = "APPROVE") -> StoredDecision:
    return StoredDecision("", request_id, "e", "credit-risk", "1", "credit-risk/v1", "policy/v1", probability,
                          decision, ("LOW_DEFAULT_RISK",))


def crm_decision(request_id: str, probability: float | None = 0.3, **fields) -> StoredDecision:
    """A REVIEW decision as the CRM stores it: its own decision id, entity ``entity-1``."""
    from mlpair.prediction.records import decision_id_for

    return StoredDecision(decision_id_for(request_id), request_id, "entity-1", "credit-risk", "1", "credit-risk/v1",
                          "policy/v1", probability, "REVIEW", ("ELEVATED_DEFAULT_RISK",), **fields)


@contextlib.asynccontextmanager
async def opened_ledger(url: str, **options):
    """The decision ledger at ``url``, opened with a statement timeout a loaded machine meets
    (``options`` are :func:`~mlpair.prediction.recording.ledger.open_ledger`'s), closed on the way out."""
    from mlpair.prediction.recording.ledger import open_ledger

    ledger = open_ledger(url, timeout_s=SLOW_MACHINE_S, **options)
    await ledger.open()
    try:
        yield ledger
    finally:
        await ledger.close()


async def record_all(ledger, request_ids: list[str], fingerprint: str = "fp") -> None:
    """Commits a :func:`decision` per request id, as a serving process would; fails the test if any is refused."""
    outcomes = await ledger.record_many([decision(i) for i in request_ids], [fingerprint] * len(request_ids))
    assert not any(isinstance(o, BaseException) for o in outcomes)


async def crm_rows(crm: CrmStore, request_ids: list[str]) -> tuple[int, int]:
    from sqlalchemy import func, select

    from mlpair.prediction.recording.models import DecisionRecord

    async with crm.engine.connect() as conn:
        total, distinct = (await conn.execute(
            select(func.count(), func.count(func.distinct(DecisionRecord.request_id)))
            .where(DecisionRecord.request_id.in_(request_ids)))).one()
    return total, distinct


async def in_crm(crm_url: str, request_ids: list[str]) -> tuple[int, int]:
    """:func:`crm_rows` through a CRM store of its own, closed afterwards: (CRM rows of
    ``request_ids``, distinct request ids among them)."""
    crm = CrmStore(crm_url, timeout_s=5)
    try:
        return await crm_rows(crm, request_ids)
    finally:
        await crm.close()


def mlpair_cli(*args: str, env: dict | None = None, cwd: Path | None = None,
               pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, **(env or {})}
    if pythonpath is not None:
        environment["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-m", "mlpair.cli", *args], capture_output=True, text=True, timeout=120,
                          env=environment, cwd=cwd)


@contextlib.asynccontextmanager
async def relay_process(ledger_url: str, crm_url: str, *, pythonpath: Path | None = None, **settings: str):
    """A ``mlpair relay`` subprocess until its health port reports ready; yields (process, health
    address, metrics URL). Killed by its PID on the way out if it is still running. With
    ``pythonpath``, the ``mlpair`` package there runs (another release's code)."""
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PREDICTION_LEDGER_URL": ledger_url, "PREDICTION_CRM_URL": crm_url,
           "PREDICTION_HOST": "127.0.0.1", "PREDICTION_RELAY_PORT": str(port),
           "PREDICTION_RELAY_METRICS_PORT": str(metrics_port), "PREDICTION_RELAY_POLL_MS": "50",
           "PREDICTION_LOG_LEVEL": "WARNING", **{f"PREDICTION_{k.upper()}": v for k, v in settings.items()}}
    flags = []
    if pythonpath is not None:  # -P: the repository's own mlpair (the working directory) not first
        env["PYTHONPATH"], flags = str(pythonpath), ["-P"]
    process = subprocess.Popen([sys.executable, *flags, "-m", "mlpair.cli", "relay"], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    address = f"127.0.0.1:{port}"
    try:
        async def ready() -> bool:
            if process.poll() is not None:
                pytest.fail(f"mlpair relay exited with {process.returncode}: {process.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(Exception):
                return await health_of(address, "") == SERVING
            return False

        await eventually(ready, timeout_s=30)
        yield process, address, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        await asyncio.to_thread(process.wait, 10)
        process.stderr.close()


def float_sweep(seed: int, n: int) -> list[float]:
    """Finite floats of every form: whole numbers, short decimals at every scale, random doubles
    and bit patterns, and the neighbours of the shortest repr's edge cases."""
    r = random.Random(seed)
    edges = [1e-4, 1e15, 1e14, 0.1, 1.0, 0.3, 999999999999999.0, 123456789012345.0, 5e-324, 1.7976931348623157e308]
    makers = [
        lambda: float(r.randint(-(10**15), 10**15)),
        lambda: round(r.uniform(-1e6, 1e6), r.randrange(0, 8)),
        lambda: r.randint(1, 10 ** r.randint(1, 15)) / 10 ** r.randint(0, 19),
        lambda: float(f"{r.randint(1, 10**15 - 1)}e{r.randint(-22, 3)}"),
        lambda: r.random() * 10 ** r.randint(-6, 17),
        lambda: struct.unpack("<d", struct.pack("<Q", r.getrandbits(64)))[0],
        lambda: math.nextafter(r.choice(edges), r.choice([0.0, math.inf])) * r.choice([1, -1]),
        lambda: r.choice(edges) * r.choice([1, -1]),
    ]
    values = (r.choice(makers)() for _ in range(n))
    return [v for v in values if math.isfinite(v)] + [0.0, -0.0, 0.1 + 0.2, 1 / 3, 9.999999999999999e-05]
