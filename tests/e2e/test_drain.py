"""Drain on SIGTERM, both services as real processes (``mlpair serve``):

* calls sent back to back across the whole drain (before the signal, inside the accept window,
  after it, and while the server stops) end OK or UNAVAILABLE, never CANCELLED, over 5 SIGTERMs;
* an open ``grpc.health.v1`` Watch does not hold the shutdown: with a 6 s grace the process
  exits within 2 s of SIGTERM, and the watcher saw NOT_SERVING before its stream ended.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.inference.v1 import inference_service_pb2 as ipb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from mlpair.api.prediction.v1 import prediction_service_pb2 as ppb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as ppb_grpc
from mlpair.client import to_attributes
from mlpair.rpc import error_info, wait_until_serving
from tests.support import CONFIG_DIR, REPO_ROOT

DRAINS = 5
CALLERS = 4  # concurrent back-to-back callers per SIGTERM
CALLS_BEFORE_S = 0.3  # each caller runs this long before the signal
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ALLOWED = {"OK", "UNAVAILABLE/DRAINING", "UNAVAILABLE"}  # served; refused by the drain; no server any more


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serving(role: str, env: dict[str, str], port: int):
    """``mlpair serve <role>`` until SERVING; killed on the way out if it is still running.

    Async (waits in threads) so that pytest's event loop, where the session's in-process
    InferenceService runs, keeps serving PredictionService's calls meanwhile."""
    process = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", role], cwd=REPO_ROOT,
                               env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        if not await asyncio.to_thread(wait_until_serving, f"127.0.0.1:{port}", 60, lambda: process.poll() is None):
            raise AssertionError(f"{role} never became ready: {process.stderr.read().decode()[-2000:]}")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        await asyncio.to_thread(process.wait, 10)


def inference_env(model_repository: Path, port: int, grace_s: float = 6.0) -> dict[str, str]:
    return {"INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0",
            "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_SHUTDOWN_GRACE_S": str(grace_s),
            "INFERENCE_LOG_LEVEL": "WARNING", "INFERENCE_MODELS": '["credit-risk"]'}


@pytest.fixture(scope="module")
def prediction_databases(tmp_path_factory) -> dict[str, str]:
    """A migrated SQLite ledger and CRM, as `mlpair migrate` leaves them before a deploy."""
    folder = tmp_path_factory.mktemp("drain-crm")
    urls = {"PREDICTION_LEDGER_URL": f"sqlite+aiosqlite:///{folder / 'ledger.sqlite'}",
            "PREDICTION_CRM_URL": f"sqlite+aiosqlite:///{folder / 'crm.sqlite'}"}
    subprocess.run([sys.executable, "-m", "mlpair.cli", "migrate", "--ledger-url", urls["PREDICTION_LEDGER_URL"],
                    "--crm-url", urls["PREDICTION_CRM_URL"]], cwd=REPO_ROOT, check=True, timeout=120,
                   capture_output=True)
    return urls


def prediction_env(model_repository: Path, inference_target: str, databases: dict[str, str], port: int,
                   grace_s: float = 6.0) -> dict[str, str]:
    return {"PREDICTION_HOST": "127.0.0.1", "PREDICTION_PORT": str(port), "PREDICTION_METRICS_PORT": "0",
            "PREDICTION_INFERENCE_TARGET": inference_target, "PREDICTION_MODEL_REPOSITORY": str(model_repository),
            "PREDICTION_CONFIG_DIR": str(CONFIG_DIR), "PREDICTION_SHUTDOWN_GRACE_S": str(grace_s),
            "PREDICTION_LOG_LEVEL": "WARNING", "PREDICTION_DRIFT_INTERVAL_S": "0", **databases}


async def back_to_back(port: int, call, drain: Callable[[], Awaitable[None]]) -> tuple[collections.Counter, list]:
    """``CALLERS`` callers each sending ``call(channel, tag)`` back to back from before the drain
    until it has ended (``drain()`` returns when the server is gone) and a moment after; returns the
    count of each outcome and (ms after the drain began, status) of each call outside ``ALLOWED``."""
    began: list[float] = []
    outcomes: list[tuple[float, str]] = []
    ended = asyncio.Event()

    async def caller(index: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            n = 0
            while not ended.is_set():
                sent = time.monotonic()
                try:
                    await call(channel, f"{index}-{n}")
                    code = "OK"
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name
                    if code == "UNAVAILABLE":  # answered by the draining server, or no server any more
                        info = error_info(exc)
                        code = "UNAVAILABLE/DRAINING" if info is not None and info.reason == "DRAINING" else code
                outcomes.append((sent, code))
                n += 1

    callers = [asyncio.ensure_future(caller(i)) for i in range(CALLERS)]
    await asyncio.sleep(CALLS_BEFORE_S)
    began.append(time.monotonic())
    await drain()
    await asyncio.sleep(0.05)  # and a moment after the end: refused connections
    ended.set()
    await asyncio.gather(*callers)
    counts = collections.Counter(code for _, code in outcomes)
    odd = [(round((sent - began[0]) * 1000, 1), code) for sent, code in outcomes if code not in ALLOWED]
    return counts, odd


def sigterm(process: subprocess.Popen) -> Callable[[], Awaitable[None]]:
    async def drain() -> None:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 20)
    return drain


@pytest.mark.timeout(150)
async def test_c50_inference_calls_across_the_drain_end_ok_or_unavailable_never_cancelled(model_repository, holdout_x,
                                                                                good_metadata):
    """5 SIGTERMs to a real ``mlpair serve inference`` process, 4 callers sending 1-row Infer calls."""
    x = holdout_x[:1]
    request = ipb.InferRequest(model_name="credit-risk", inputs=ipb.Tensor(
        data_type=ipb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes()))

    async def infer(channel, _):
        await ipb_grpc.InferenceServiceStub(channel).Infer(request, metadata=good_metadata, timeout=5)

    totals: collections.Counter = collections.Counter()
    for _ in range(DRAINS):
        port = free_port()
        async with serving("inference", inference_env(model_repository, port), port) as process:
            counts, odd = await back_to_back(port, infer, sigterm(process))
            assert process.returncode == 0
        assert odd == [] and counts["OK"] > 0 and counts["UNAVAILABLE/DRAINING"] > 0, f"{dict(counts)} {odd[:20]}"
        totals += counts
    print(f"inference, {DRAINS} SIGTERMs x {CALLERS} callers: {dict(totals)}")  # the figures, for the record
    assert set(totals) <= ALLOWED and totals["CANCELLED"] == 0


@pytest.mark.timeout(150)
async def test_c50_prediction_calls_across_the_drain_end_ok_or_unavailable_never_cancelled(
        model_repository, inference_server, credit_holdout, tmp_path):
    """5 drains of PredictionService, in process (the code ``serve`` runs on SIGTERM: a process start
    costs ~9 s of imports here), 4 callers sending Predict calls for real applicants."""
    from mlpair.prediction.server import stop
    from mlpair.prediction.settings import PredictionSettings
    from tests.support import start_prediction

    records, entities = credit_holdout.records, credit_holdout.entity_ids
    settings = PredictionSettings(
        host="127.0.0.1", port=0, metrics_port=0, inference_target=inference_server,
        ledger_url=f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}",
        crm_url=f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}", model_repository=model_repository,
        config_dir=CONFIG_DIR, shutdown_grace_s=6.0, drift_interval_s=0)

    async def predict(channel, tag):
        i = hash(tag) % len(records)
        await ppb_grpc.PredictionServiceStub(channel).Predict(ppb.PredictRequest(
            request_id=f"drain-{time.monotonic_ns()}-{tag}", entity_id=entities[i],
            attributes=to_attributes(records[i]), model_name="credit-risk"), timeout=5)

    totals: collections.Counter = collections.Counter()
    for _ in range(DRAINS):
        server, port, health, predictor = await start_prediction(settings)
        # this round's server, bound now: a closure over the loop variables would stop whichever
        # server the loop last started
        drain = functools.partial(stop, server, health, predictor, settings.shutdown_grace_s,
                                  settings.shutdown_accept_ms / 1000)
        counts, odd = await back_to_back(port, predict, drain)
        assert odd == [] and counts["OK"] > 0 and counts["UNAVAILABLE/DRAINING"] > 0, f"{dict(counts)} {odd[:20]}"
        totals += counts
    print(f"prediction, {DRAINS} drains x {CALLERS} callers: {dict(totals)}")
    assert set(totals) <= ALLOWED and totals["CANCELLED"] == 0


async def watch_then_sigterm(port: int, process: subprocess.Popen) -> tuple[float, list[int]]:
    """Opens a Watch on readiness, sends SIGTERM; returns seconds to exit and the statuses watched."""
    seen: list[int] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))

        async def read() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                async for reply in stream:
                    seen.append(reply.status)

        reader = asyncio.ensure_future(read())
        while not seen:
            await asyncio.sleep(0.02)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 15)
        took = time.monotonic() - signalled
        await asyncio.wait_for(reader, 5)
    return took, seen


@pytest.mark.timeout(120)
async def test_c47_an_open_health_watch_does_not_hold_the_shutdown(model_repository, inference_server, prediction_databases):
    """6 s grace; each process exits within 2 s of SIGTERM, and its watcher saw NOT_SERVING first."""
    for role in ("inference", "prediction"):
        port = free_port()
        env = (inference_env(model_repository, port, grace_s=6.0) if role == "inference" else
               prediction_env(model_repository, inference_server, prediction_databases, port, grace_s=6.0))
        async with serving(role, env, port) as process:
            took, seen = await watch_then_sigterm(port, process)
            assert process.returncode == 0
        print(f"{role}: exited {took:.2f} s after SIGTERM with a Watch open (grace 6 s)")  # for the record
        assert took < 2.0, f"{role} took {took:.2f} s to exit with a Watch open"
        assert seen[0] == health_pb2.HealthCheckResponse.SERVING and seen[-1] == NOT_SERVING, (role, seen)


@pytest.mark.timeout(60)
def test_c48_a_second_server_on_a_port_in_use_exits_2_naming_the_port(inference_server, tmp_path):
    """Both services, a single process and a supervisor of two workers, started on the gRPC port the
    suite's InferenceService already serves: each exits 2 within 10 s with one line naming the port."""
    port = inference_server.rsplit(":", 1)[1]
    for role in ("inference", "prediction"):
        for workers in ("1", "2"):
            env = {k: v for k, v in os.environ.items() if not k.startswith(("INFERENCE_", "PREDICTION_"))}
            prefix = role.upper()
            env.update({f"{prefix}_HOST": "127.0.0.1", f"{prefix}_PORT": port, f"{prefix}_METRICS_PORT": "0",
                        f"{prefix}_WORKERS": workers, f"{prefix}_MODEL_REPOSITORY": str(tmp_path)})
            started = time.monotonic()
            run = subprocess.run([sys.executable, "-m", "mlpair.cli", "serve", role], cwd=REPO_ROOT, env=env,
                                 capture_output=True, text=True, timeout=30)
            took = time.monotonic() - started
            last = run.stderr.strip().splitlines()[-1] if run.stderr.strip() else ""
            assert run.returncode == 2, (role, workers, run.stderr[-1000:])
            assert f"port {port} is in use" in last, (role, workers, last)
            assert took < 10, (role, workers, took)


async def test_a_sigterm_while_prediction_service_starts_drains_instead_of_killing_it(
        model_repository, prediction_databases):
    # Kubernetes may stop a pod that is still starting (a rollout superseded, a scale-down): the
    # signal must start the drain, as it does once serving, not end the process by the default
    # action mid-start. The ledger here accepts connections and never answers, so the start
    # stays inside the ledger's open (its 2 s timeout) when the signal arrives.
    held = asyncio.Event()
    peers: list[asyncio.StreamWriter] = []

    async def silent(reader, writer) -> None:
        peers.append(writer)
        held.set()

    ledger = await asyncio.start_server(silent, "127.0.0.1", 0)
    ledger_port = ledger.sockets[0].getsockname()[1]
    port = free_port()
    env = {**prediction_env(model_repository, f"127.0.0.1:{free_port()}", prediction_databases, port, grace_s=1.0),
           "PREDICTION_LEDGER_URL": f"postgresql+asyncpg://mlpair@127.0.0.1:{ledger_port}/ledger",
           "PREDICTION_LEDGER_TIMEOUT_MS": "2000", "PREDICTION_WORKERS": "1", "PREDICTION_LOG_LEVEL": "INFO"}
    process = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "prediction"], cwd=REPO_ROOT,
                               env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await asyncio.wait_for(held.wait(), 60)  # the start has reached the ledger
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 30)
        log = process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait, 10)
        for writer in peers:
            writer.close()
        ledger.close()
    assert code == 0, log[-2000:]
    assert "termination signal received" in log and "PredictionService stopped" in log, log[-2000:]
    assert "alembic.runtime.plugins" not in log  # the schema check's library chatter stays out of INFO
