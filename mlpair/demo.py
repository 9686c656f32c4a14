"""``mlpair demo``: the main job end to end on real data.

Trains (or reuses) the credit-risk model, starts InferenceService and PredictionService as
separate processes on free local ports, waits for readiness, replays every holdout
applicant's raw record through ``PredictionService.Predict`` concurrently as a business
system would, retries a sample with the same request ids to show idempotency, prints a
summary and stops both services with SIGTERM. Exits non-zero if anything failed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlpair.contracts.metrics import roc_auc
from mlpair.contracts.schema import FeatureSchema

MODEL_NAME = "credit-risk"
READY_TIMEOUT_S = 60.0
RETRY_SAMPLE = 50


@dataclass
class Replay:
    """What the business-system side saw."""

    probabilities: dict[str, float] = field(default_factory=dict)
    decisions: dict[str, str] = field(default_factory=dict)
    decision_ids: dict[str, str] = field(default_factory=dict)
    reasons: Counter = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)
    wall_s: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(role: str, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Starts ``mlpair serve <role>`` as its own process, logging to ``log_path``."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", role], env={**os.environ, **env},
                            stdout=log, stderr=subprocess.STDOUT)


def wait_ready(target: str, process: subprocess.Popen, log_path: Path) -> None:
    """Polls ``grpc.health.v1`` until SERVING.

    Raises:
        RuntimeError: the process exited or did not become ready in time (log tail included).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
    raise RuntimeError(f"service at {target} did not become ready:\n{tail}")


def stop_service(process: subprocess.Popen, grace_s: float = 30.0) -> int:
    """SIGTERM, then wait for a clean exit (SIGKILL only past ``grace_s``). Returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


async def replay(target: str, requests: list[tuple[str, str, dict]], concurrency: int, progress: bool) -> Replay:
    """Sends every ``(request_id, entity_id, attributes)`` through Predict, ``concurrency`` at a time."""
    import grpc
    from rich.progress import Progress

    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from mlpair.prediction.converters import to_attributes

    out = Replay()
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.PredictionServiceStub(channel)
        with Progress(disable=not progress) as bar:
            task = bar.add_task("Predict", total=len(requests))

            async def one(request_id: str, entity_id: str, attributes: dict) -> None:
                async with gate:
                    t0 = time.perf_counter()
                    try:
                        reply = await stub.Predict(pb.PredictRequest(
                            request_id=request_id, entity_id=entity_id, model_name=MODEL_NAME,
                            attributes=to_attributes(attributes)), timeout=10)
                    except grpc.RpcError as exc:
                        out.failures[exc.code().name] += 1
                    else:
                        out.latencies_ms.append((time.perf_counter() - t0) * 1000)
                        out.probabilities[request_id] = reply.probability
                        out.decisions[request_id] = pb.Decision.Name(reply.decision).removeprefix("DECISION_")
                        out.decision_ids[request_id] = reply.decision_id
                        out.reasons.update(reply.reason_codes)
                    bar.advance(task)

            started = time.perf_counter()
            await asyncio.gather(*(one(*r) for r in requests))
            out.wall_s = time.perf_counter() - started
    return out


async def crm_rows(crm_url: str, request_ids: list[str], wait_s: float = 10.0) -> int:
    """Rows in the CRM for these request ids. Decisions reach the CRM through the outbox relay
    moments after they are returned, so this waits up to ``wait_s`` for all of them."""
    from sqlalchemy import func, select

    from mlpair.prediction.crm.models import DecisionRecord
    from mlpair.prediction.crm.store import make_engine

    engine = make_engine(crm_url)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            async with engine.connect() as conn:
                rows = int(await conn.scalar(select(func.count()).select_from(DecisionRecord)
                                             .where(DecisionRecord.request_id.in_(request_ids))))
            if rows >= len(request_ids) or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(0.1)
    finally:
        await engine.dispose()


def run_demo(model_repository: Path, workdir: Path, config_dir: Path, *, concurrency: int = 32,
             progress: bool = True) -> int:
    """Runs the whole job; returns the process exit code (0 only if everything succeeded)."""
    from rich.console import Console

    from mlpair.training.data import load_dataset, stratified_split
    from mlpair.training.pipeline import train_family

    console = Console()
    workdir.mkdir(parents=True, exist_ok=True)
    schema_path = config_dir / MODEL_NAME / "feature-schema.toml"
    console.rule("[bold]1. Train (or reuse) on real data")
    entry, fresh = train_family(schema_path, model_repository, show_progress=progress)
    manifest = entry.manifest
    console.print(f"{MODEL_NAME} version {manifest.model_version}: {'trained' if fresh else 'reused (up to date)'}; "
                  f"source {manifest.data_source['source']}, {manifest.data_source['rows']} rows")

    schema = FeatureSchema.from_toml(schema_path)
    data = load_dataset(schema)
    holdout = data.subset(stratified_split(data.labels, int(manifest.data_source["split"]["seed"]))["holdout"])
    run_id = time.strftime("%Y%m%dT%H%M%S")
    requests = [(f"demo-{run_id}-{eid}", eid, rec) for eid, rec in zip(holdout.entity_ids, holdout.records)]

    crm_path = workdir / "crm.sqlite"
    crm_url = f"sqlite+aiosqlite:///{crm_path.resolve()}"
    ports = {name: free_port() for name in ("inference", "inference_metrics", "prediction", "prediction_metrics")}
    console.rule("[bold]2. Start both services")
    inference = start_service("inference", {
        "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(ports["inference"]),
        "INFERENCE_METRICS_PORT": str(ports["inference_metrics"]),
        "INFERENCE_MODEL_REPOSITORY": str(model_repository.resolve()), "INFERENCE_MODELS": f'["{MODEL_NAME}"]',
    }, workdir / "inference.log")
    prediction = None
    try:
        wait_ready(f"127.0.0.1:{ports['inference']}", inference, workdir / "inference.log")
        prediction = start_service("prediction", {
            "PREDICTION_HOST": "127.0.0.1", "PREDICTION_PORT": str(ports["prediction"]),
            "PREDICTION_METRICS_PORT": str(ports["prediction_metrics"]),
            "PREDICTION_INFERENCE_TARGET": f"127.0.0.1:{ports['inference']}", "PREDICTION_CRM_URL": crm_url,
            "PREDICTION_OUTBOX_URL": f"sqlite+aiosqlite:///{(workdir / 'outbox.sqlite').resolve()}",
            "PREDICTION_MODEL_REPOSITORY": str(model_repository.resolve()),
            "PREDICTION_CONFIG_DIR": str(config_dir.resolve()), "PREDICTION_MODEL_NAME": MODEL_NAME,
        }, workdir / "prediction.log")
        wait_ready(f"127.0.0.1:{ports['prediction']}", prediction, workdir / "prediction.log")
        console.print(f"InferenceService on :{ports['inference']} (metrics :{ports['inference_metrics']}), "
                      f"PredictionService on :{ports['prediction']} (metrics :{ports['prediction_metrics']})")

        console.rule(f"[bold]3. Replay {len(requests)} holdout applicants through Predict")
        target = f"127.0.0.1:{ports['prediction']}"
        result = asyncio.run(replay(target, requests, concurrency, progress))
        retry = asyncio.run(replay(target, requests[:RETRY_SAMPLE], concurrency, progress=False))
        rows = asyncio.run(crm_rows(crm_url, [r[0] for r in requests]))
    finally:
        codes = {"prediction": stop_service(prediction) if prediction else None,
                 "inference": stop_service(inference)}
    return _summarise(console, result, retry, holdout, requests, rows, codes)


def _summarise(console, result: Replay, retry: Replay, holdout, requests, rows: int, codes: dict) -> int:
    from rich.table import Table

    console.rule("[bold]4. Summary")
    ok = len(result.probabilities)
    labels = np.array([holdout.labels[i] for i, r in enumerate(requests) if r[0] in result.probabilities])
    scores = np.array([result.probabilities[r[0]] for r in requests if r[0] in result.probabilities])
    auc = roc_auc(labels, scores) if ok and 0 < labels.sum() < len(labels) else float("nan")
    lat = np.array(result.latencies_ms) if result.latencies_ms else np.array([float("nan")])
    same_ids = all(retry.decision_ids.get(r[0]) == result.decision_ids.get(r[0]) for r in requests[:RETRY_SAMPLE])

    table = Table(show_header=False)
    table.add_row("holdout applicants", str(len(requests)))
    table.add_row("decisions returned", f"{ok} ({sum(result.failures.values())} failed {dict(result.failures)})")
    table.add_row("holdout ROC AUC (returned probabilities)", f"{auc:.4f}")
    table.add_row("decisions", ", ".join(f"{d} {n}" for d, n in Counter(result.decisions.values()).most_common()))
    table.add_row("top reason codes", ", ".join(f"{c} {n}" for c, n in result.reasons.most_common(5)))
    table.add_row("client latency p50 / p99", f"{np.percentile(lat, 50):.1f} ms / {np.percentile(lat, 99):.1f} ms")
    table.add_row("throughput", f"{ok / result.wall_s:.0f} predictions/s" if result.wall_s else "-")
    table.add_row("CRM rows written", f"{rows} (one per applicant: {'yes' if rows == len(requests) else 'NO'})")
    table.add_row(f"retried {RETRY_SAMPLE} request ids", f"same decision ids: {'yes' if same_ids else 'NO'}; "
                  f"{sum(retry.failures.values())} failed")
    table.add_row("service exit codes", ", ".join(f"{k} {v}" for k, v in codes.items()))
    console.print(table)

    failed = (result.failures or retry.failures or ok != len(requests) or rows != len(requests)
              or not same_ids or any(c != 0 for c in codes.values()))
    console.print("[bold red]demo FAILED[/]" if failed else "[bold green]demo OK[/]")
    return 1 if failed else 0
