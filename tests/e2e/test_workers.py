"""``--workers 2``: one supervisor, two serving processes on one port, as real processes.

For each service: both workers serve calls on the shared port (each holds connections of the
calls), the supervisor's metrics port counts every call exactly once across them, a second server
or supervisor on the port is refused (exit 2 naming the port, within 10 s), and SIGTERM drains
both workers (calls in flight on each are answered) and the supervisor exits 0 within the grace.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from mlpair.api.inference.v1 import inference_service_pb2 as ipb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as ppb_grpc
from tests.e2e.replicas import crm_rows, request
from tests.support.e2e import OWN_CONNECTION, both_listening, listeners
from tests.support.pair import Service, free_port, pair

MODEL = "credit-risk"
GRACE_S = 10.0
CHANNELS = 12  # fresh connections: the kernel spreads them over the workers (all on one: 2**-11)


def metric_sum(metrics_port: int, name: str, **labels: str) -> float:
    """Sum over the samples of ``name`` with ``labels`` scraped from the supervisor's metrics port."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def free_within(port: int, seconds: float) -> int | None:
    """The port once nothing listens on it any more (polled), or None after ``seconds``."""
    from mlpair.startup import StartupError
    from mlpair.workers import check_port_free

    deadline = time.monotonic() + seconds
    while True:
        try:
            return check_port_free("127.0.0.1", port)
        except StartupError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def every_worker_serving(address: str, checks: int = 12, timeout_s: float = 60.0) -> None:
    """Waits until ``checks`` health checks in a row, each on a new connection, say SERVING."""
    deadline, in_a_row = time.monotonic() + timeout_s, 0
    while in_a_row < checks:
        assert time.monotonic() < deadline, "the workers never all became ready"
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                in_a_row = in_a_row + 1 if reply.status == health_pb2.HealthCheckResponse.SERVING else 0
            except grpc.aio.AioRpcError:
                in_a_row = 0
        await asyncio.sleep(0 if in_a_row else 0.2)


def second_server_is_refused(role: str, env: dict[str, str], port: int) -> None:
    """Another ``mlpair serve <role>`` on ``port`` exits 2 within 10 s, naming the port in one line."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mlpair.cli", "serve", role], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=30)
    took = time.monotonic() - started
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert took < 10, took
    assert len(lines) == 1 and f"port {port} is in use" in lines[0], lines


def sigterm_drains(service: Service) -> tuple[int, float]:
    """SIGTERM to the supervisor; returns its exit code and the seconds it took to exit."""
    signalled = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    code = service.wait_exit(GRACE_S + 15)
    return code, time.monotonic() - signalled


@pytest.mark.timeout(150)
def test_inference_workers_share_the_port_count_every_call_and_drain(model_repository, holdout_x, good_metadata,
                                                                     tmp_path) -> None:
    port, metrics_port = free_port(), free_port()
    env = {"INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": str(metrics_port),
           "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_MODELS": json.dumps([MODEL]),
           "INFERENCE_WORKERS": "2", "INFERENCE_SHUTDOWN_GRACE_S": str(GRACE_S), "INFERENCE_SHUTDOWN_ACCEPT_MS": "100",
           "INFERENCE_MAX_QUEUE_DELAY_MS": "2000", "INFERENCE_LOG_LEVEL": "WARNING"}
    service = Service("inference", env, port, tmp_path / "inference.log")
    service.start(ready_timeout_s=90)
    try:
        both_listening(service.pid, port)
        asyncio.run(every_worker_serving(service.address))
        second_server_is_refused("inference", {**env, "INFERENCE_WORKERS": "1", "INFERENCE_METRICS_PORT": "0"}, port)
        second_server_is_refused("inference", {**env, "INFERENCE_METRICS_PORT": "0"}, port)
        served, counted, depth, in_flight, (code, took) = asyncio.run(_drive_inference(service, metrics_port, holdout_x,
                                                                                        good_metadata))
    finally:
        service.kill()
    assert len(served) == 2 and service.pid not in served, served  # two workers, the supervisor does not listen
    assert all(n > 0 for n in served.values()), served  # each holds some of the calls' connections
    assert counted == 2 * CHANNELS  # every call once, whichever worker served it
    assert depth == CHANNELS  # the rows queued in both workers, summed (the autoscaler's signal)
    assert in_flight == [(1, 2)] * CHANNELS  # calls queued in both workers at SIGTERM were answered
    assert code == 0 and took < GRACE_S, (code, took)


async def _drive_inference(service: Service, metrics_port: int, holdout_x, good_metadata):
    def infer(stub, i: int):
        x = holdout_x[i:i + 1]
        return stub.Infer(ipb.InferRequest(model_name=MODEL, inputs=ipb.Tensor(
            data_type=ipb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes())), metadata=good_metadata, timeout=20)

    channels = [grpc.aio.insecure_channel(service.address, options=OWN_CONNECTION) for _ in range(CHANNELS)]
    try:
        stubs = [ipb_grpc.InferenceServiceStub(c) for c in channels]
        before = metric_sum(metrics_port, "inference_requests_total", code="OK")
        await asyncio.gather(*(infer(stub, i) for i, stub in enumerate(stubs * 2)))
        served = listeners(service.pid, service.port)
        counted = await asyncio.to_thread(metric_sum, metrics_port, "inference_requests_total", code="OK") - before
        calls = [asyncio.ensure_future(infer(stub, i)) for i, stub in enumerate(stubs)]
        depth, deadline = 0.0, time.monotonic() + 1.5  # queued: each worker holds its calls for the 2 s window
        while depth != CHANNELS and time.monotonic() < deadline:  # sampled every 0.5 s
            await asyncio.sleep(0.1)
            depth = await asyncio.to_thread(metric_sum, metrics_port, "inference_queue_depth_rows")
        code, took = await asyncio.to_thread(sigterm_drains, service)
        replies = await asyncio.gather(*calls)
        return served, counted, depth, [tuple(r.logits.shape) for r in replies], (code, took)
    finally:
        for channel in channels:
            await channel.close()


@pytest.mark.timeout(180)
def test_prediction_workers_share_the_port_and_the_ledger_and_drain(model_repository, credit_holdout, tmp_path) -> None:
    metrics_port = free_port()
    p = pair(tmp_path, model_repository, prediction_env={
        "PREDICTION_WORKERS": "2", "PREDICTION_METRICS_PORT": str(metrics_port), "PREDICTION_CACHE_BACKEND": "off",
        "PREDICTION_SHUTDOWN_GRACE_S": str(GRACE_S), "PREDICTION_SHUTDOWN_ACCEPT_MS": "100",
        "PREDICTION_RELAY_LINGER_MS": "10", "PREDICTION_INFERENCE_TIMEOUT_MS": "10000"})
    p.start()
    try:
        both_listening(p.prediction.pid, p.prediction.port)
        asyncio.run(every_worker_serving(p.prediction.address))
        second_server_is_refused("prediction", {**p.prediction.env, "PREDICTION_WORKERS": "1",
                                                "PREDICTION_METRICS_PORT": "0"}, p.prediction.port)
        served, counts, first, again, rows = asyncio.run(_drive_prediction(p, metrics_port, credit_holdout.records))
        code, took = sigterm_drains(p.prediction)
    finally:
        p.kill()
    assert len(served) == 2 and p.prediction.pid not in served and all(n > 0 for n in served.values()), served
    n = 2 * CHANNELS
    assert counts == {"ok": 2 * n, "replays": n}, counts  # every call counted once across the workers
    # each request id decided once: the replays (over other connections, so often the other worker) say so
    assert [r.decision_label for r in again] == [r.decision_label for r in first]
    assert all(r.replayed for r in again) and not any(r.replayed for r in first)
    assert sorted(rows) == sorted(f"w-{i}" for i in range(n)) and all(len(v) == 1 for v in rows.values())
    assert code == 0 and took < GRACE_S, (code, took)


async def _drive_prediction(p, metrics_port: int, records: list[dict]):
    n = 2 * CHANNELS

    async def predict_all():
        channels = [grpc.aio.insecure_channel(p.prediction.address, options=OWN_CONNECTION) for _ in range(CHANNELS)]
        try:
            stubs = [ppb_grpc.PredictionServiceStub(c) for c in channels]
            replies = await asyncio.gather(*(stubs[i % CHANNELS].Predict(request(f"w-{i}", records[i]), timeout=20)
                                             for i in range(n)))
            return replies, listeners(p.prediction.pid, p.prediction.port)
        finally:
            for channel in channels:
                await channel.close()

    ok_before = metric_sum(metrics_port, "prediction_requests_total", code="OK")
    replays_before = metric_sum(metrics_port, "prediction_idempotent_replays_total")
    first, served = await predict_all()
    again, _ = await predict_all()  # the same request ids over new connections
    counts = {"ok": metric_sum(metrics_port, "prediction_requests_total", code="OK") - ok_before,
              "replays": metric_sum(metrics_port, "prediction_idempotent_replays_total") - replays_before}
    deadline = time.monotonic() + 30
    while len(rows := await crm_rows(p.crm_url, [f"w-{i}" for i in range(n)])) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.2)  # the workers' relays deliver from the one ledger
    return served, counts, first, again, rows


@pytest.mark.timeout(120)
def test_a_dead_worker_stops_the_supervisor_and_a_dead_supervisor_its_workers(model_repository, tmp_path) -> None:
    """kill -9 of one worker: the supervisor drains the other and exits 1 (the orchestrator restarts
    the container), freeing the port; kill -9 of a supervisor: its workers die with it (the port is
    free within seconds for the next start: the kernel may still be tearing a dead worker's
    listening socket down when its process is already gone from the table)."""
    from mlpair.workers import check_port_free

    port = free_port()
    env = {"INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0",
           "INFERENCE_MODEL_REPOSITORY": str(model_repository), "INFERENCE_MODELS": json.dumps([MODEL]),
           "INFERENCE_WORKERS": "2", "INFERENCE_SHUTDOWN_GRACE_S": str(GRACE_S), "INFERENCE_LOG_LEVEL": "WARNING"}
    service = Service("inference", env, port, tmp_path / "inference.log")
    try:
        service.start(ready_timeout_s=90)
        workers = both_listening(service.pid, port)
        os.kill(workers[0], signal.SIGKILL)
        code = service.wait_exit(GRACE_S + 15)
        crashed_exit, port_after_crash = code, check_port_free("127.0.0.1", port)
        service.start(ready_timeout_s=90)  # the same port again
        workers = both_listening(service.pid, port)
        service.kill()
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in workers):
            assert time.monotonic() < deadline, "workers outlived their supervisor"
            time.sleep(0.1)
        port_after_kill = free_within(port, 5.0)
    finally:
        service.kill()
    assert len(workers) == 2
    assert crashed_exit == 1 and port_after_crash == port
    assert port_after_kill == port
