"""``mlpair demo``: the main job end to end on real data, for every model family in ``config/``.

Trains (or reuses) each family's model, starts InferenceService and PredictionService as
separate processes on free local ports (one pair serving every family), waits for readiness,
replays every holdout entity's raw record through ``PredictionService.Predict`` concurrently
as a business system would, retries a sample with the same request ids to show idempotency,
asks ``BatchPredict`` to explain a few decisions, reads the raw logits of the holdout from
InferenceService to show calibration before and after, prints a summary per family (ROC AUC,
Brier score, ECE before and after calibration against the family's targets), writes a report
picture and stops both services with SIGTERM. Exits non-zero if anything failed or a target
was missed.
"""

from __future__ import annotations

import asyncio
import json
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

from mlpair.contracts.metrics import brier_score, expected_calibration_error, roc_auc

READY_TIMEOUT_S = 60.0
RETRY_SAMPLE = 50
EXPLAIN_SAMPLE = 3
INFER_CHUNK_ROWS = 512  # raw-logit reads stay well below InferenceService's max batch size


@dataclass
class Replay:
    """What the business-system side saw for one family."""

    probabilities: dict[str, float] = field(default_factory=dict)
    decisions: dict[str, str] = field(default_factory=dict)
    decision_ids: dict[str, str] = field(default_factory=dict)
    reasons: Counter = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)
    wall_s: float = 0.0
    concurrency: int = 0  # Predict calls in flight


@dataclass
class FamilyRun:
    """One family's holdout, its requests and everything measured about them."""

    name: str
    entry: object  # mlpair.contracts.manifest.ModelEntry
    fresh: bool
    holdout: object  # mlpair.training.data.Dataset
    requests: list[tuple[str, str, dict]]
    targets: dict[str, float]
    baseline: np.ndarray  # [n holdout] P(positive) of logistic regression fitted on the same training split
    result: Replay = field(default_factory=Replay)
    retry: Replay = field(default_factory=Replay)
    explained: list = field(default_factory=list)  # PredictResponse with contributions
    explain_failures: int = 0
    uncalibrated: np.ndarray | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def discover_families(config_dir: Path) -> list[str]:
    """Every ``config_dir/<name>/`` holding a feature schema, sorted."""
    return sorted(p.parent.name for p in config_dir.glob("*/feature-schema.toml"))


def start_service(role: str, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """Starts ``mlpair serve <role>`` as its own process, logging to ``log_path``."""
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "mlpair.cli", "serve", role],
            env={**os.environ, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def wait_ready(target: str, process: subprocess.Popen, log_path: Path) -> None:
    """Polls ``grpc.health.v1`` until SERVING.

    Raises:
        RuntimeError: the process exited or did not become ready in time (log tail included).
    """
    from mlpair.rpc import wait_until_serving

    if wait_until_serving(target, READY_TIMEOUT_S, lambda: process.poll() is None, poll_s=0.1):
        return
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


async def replay(
    target: str, model_name: str, requests: list[tuple[str, str, dict]], concurrency: int, progress: bool
) -> Replay:
    """Sends every ``(request_id, entity_id, attributes)`` through Predict, ``concurrency`` at a time."""
    import grpc
    from rich.progress import Progress

    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from mlpair.prediction.converters import to_attributes

    out = Replay(concurrency=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.PredictionServiceStub(channel)
        with Progress(disable=not progress) as bar:
            task = bar.add_task(f"Predict {model_name}", total=len(requests))

            async def one(request_id: str, entity_id: str, attributes: dict) -> None:
                async with gate:
                    t0 = time.perf_counter()
                    try:
                        reply = await stub.Predict(
                            pb.PredictRequest(
                                request_id=request_id,
                                entity_id=entity_id,
                                model_name=model_name,
                                attributes=to_attributes(attributes),
                            ),
                            timeout=10,
                        )
                    except grpc.RpcError as exc:
                        out.failures[exc.code().name] += 1
                    else:
                        out.latencies_ms.append((time.perf_counter() - t0) * 1000)
                        out.probabilities[request_id] = reply.probability
                        out.decisions[request_id] = reply.decision_label
                        out.decision_ids[request_id] = reply.decision_id
                        out.reasons.update(reply.reason_codes)
                    bar.advance(task)

            started = time.perf_counter()
            await asyncio.gather(*(one(*r) for r in requests))
            out.wall_s = time.perf_counter() - started
    return out


async def explain_sample(target: str, run: FamilyRun, run_id: str) -> None:
    """Asks BatchPredict to explain the first few holdout entities (new request ids)."""
    import grpc

    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from mlpair.prediction.converters import to_attributes

    items = [
        pb.PredictRequest(
            request_id=f"demo-{run_id}-{run.name}-explain-{eid}",
            entity_id=eid,
            model_name=run.name,
            attributes=to_attributes(rec),
            explain=True,
        )
        for eid, rec in zip(run.holdout.entity_ids[:EXPLAIN_SAMPLE], run.holdout.records)
    ]
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await pb_grpc.PredictionServiceStub(channel).BatchPredict(
            pb.BatchPredictRequest(requests=items), timeout=10
        )
    run.explained = [r.prediction for r in reply.results if r.WhichOneof("outcome") == "prediction"]
    run.explain_failures = len(items) - len(run.explained)


async def uncalibrated_probabilities(target: str, run: FamilyRun) -> np.ndarray:
    """Softmax of the raw holdout logits, read straight from InferenceService (as an internal caller)."""
    from mlpair.contracts.assembly import FeatureAssembler
    from mlpair.prediction.inference_client import InferenceClient

    manifest = run.entry.manifest
    x = FeatureAssembler(run.entry.preprocessing).assemble_many(run.holdout.records)
    client = InferenceClient(target, timeout_ms=10_000, max_message_bytes=16 * 1024 * 1024)
    try:
        logits = [
            (
                await client.infer(
                    run.name,
                    manifest.model_version,
                    manifest.versions.feature_schema_version,
                    x[i : i + INFER_CHUNK_ROWS],
                )
            )[0]
            for i in range(0, len(x), INFER_CHUNK_ROWS)
        ]
    finally:
        await client.close()
    return manifest.calibration.probabilities(np.concatenate(logits), manifest.positive_index, "none")


async def crm_rows(crm_url: str, request_ids: list[str], wait_s: float = 10.0) -> int:
    """Rows in the CRM for these request ids. Decisions reach the CRM through the ledger's relay
    moments after they are returned, so this waits up to ``wait_s`` for all of them."""
    from sqlalchemy import func, select

    from mlpair.prediction.crm.models import DecisionRecord
    from mlpair.prediction.crm.store import make_engine

    engine = make_engine(crm_url)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            async with engine.connect() as conn:
                rows = int(
                    await conn.scalar(
                        select(func.count())
                        .select_from(DecisionRecord)
                        .where(DecisionRecord.request_id.in_(request_ids))
                    )
                )
            if rows >= len(request_ids) or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(0.1)
    finally:
        await engine.dispose()


def prepare(config_dir: Path, model_repository: Path, name: str, run_id: str, progress: bool) -> FamilyRun:
    """Trains (or reuses) one family, lists its holdout requests and scores the logistic-regression
    baseline on the identical split and features."""
    from mlpair.contracts.assembly import FeatureAssembler
    from mlpair.contracts.schema import FeatureSchema
    from mlpair.training.baseline import fit_logistic_regression, predict_probability
    from mlpair.training.data import load_dataset, stratified_split
    from mlpair.training.model import quality_targets
    from mlpair.training.pipeline import TRAINING_CONFIG_FILE, train_family

    schema_path = config_dir / name / "feature-schema.toml"
    entry, fresh = train_family(schema_path, model_repository, show_progress=progress)
    data = load_dataset(FeatureSchema.from_toml(schema_path))
    splits = stratified_split(data.labels, int(entry.manifest.data_source["split"]["seed"]))
    train, holdout = data.subset(splits["train"]), data.subset(splits["holdout"])
    requests = [(f"demo-{run_id}-{name}-{eid}", eid, rec) for eid, rec in zip(holdout.entity_ids, holdout.records)]
    assembler = FeatureAssembler(entry.preprocessing)
    weights = fit_logistic_regression(assembler.assemble_many(train.records), train.labels)
    baseline = predict_probability(weights, assembler.assemble_many(holdout.records))
    return FamilyRun(
        name, entry, fresh, holdout, requests, quality_targets(config_dir / name / TRAINING_CONFIG_FILE), baseline
    )


def run_demo(
    model_repository: Path, workdir: Path, config_dir: Path, *, concurrency: int = 32, progress: bool = True
) -> int:
    """Runs the whole job; returns the process exit code (0 only if everything succeeded)."""
    from rich.console import Console

    console = Console()
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%dT%H%M%S")
    names = discover_families(config_dir)
    console.rule("[bold]1. Train (or reuse) on real data")
    runs = [prepare(config_dir, model_repository, name, run_id, progress) for name in names]
    for run in runs:
        m = run.entry.manifest
        console.print(
            f"{run.name} version {m.model_version}: {'trained' if run.fresh else 'reused (up to date)'}"
            f"{', ' + _training_end(m.training) if _training_end(m.training) else ''}; source {m.data_source['source']}, {m.data_source['rows']} rows, "
            f"holdout {len(run.requests)}"
        )

    crm_url = f"sqlite+aiosqlite:///{(workdir / 'crm.sqlite').resolve()}"
    ledger_url = f"sqlite+aiosqlite:///{(workdir / 'ledger.sqlite').resolve()}"
    ports = {name: free_port() for name in ("inference", "inference_metrics", "prediction", "prediction_metrics")}
    console.rule("[bold]2. Migrate the decision ledger and the CRM, start both services")
    migrated = subprocess.run(
        [sys.executable, "-m", "mlpair.cli", "migrate", "--ledger-url", ledger_url, "--crm-url", crm_url],
        capture_output=True,
        text=True,
    )
    if migrated.returncode != 0:
        console.print(f"[red]mlpair migrate failed: {migrated.stderr.strip()}")
        return 1
    console.print(f"mlpair migrate: {migrated.stdout.strip()}")
    inference = start_service(
        "inference",
        {
            "INFERENCE_HOST": "127.0.0.1",
            "INFERENCE_PORT": str(ports["inference"]),
            "INFERENCE_METRICS_PORT": str(ports["inference_metrics"]),
            "INFERENCE_MODEL_REPOSITORY": str(model_repository.resolve()),
            "INFERENCE_MODELS": json.dumps(names),
        },
        workdir / "inference.log",
    )
    prediction = None
    rows = 0
    try:
        inference_target = f"127.0.0.1:{ports['inference']}"
        wait_ready(inference_target, inference, workdir / "inference.log")
        prediction = start_service(
            "prediction",
            {
                "PREDICTION_HOST": "127.0.0.1",
                "PREDICTION_PORT": str(ports["prediction"]),
                "PREDICTION_METRICS_PORT": str(ports["prediction_metrics"]),
                "PREDICTION_INFERENCE_TARGET": inference_target,
                "PREDICTION_CRM_URL": crm_url,
                "PREDICTION_LEDGER_URL": ledger_url,
                "PREDICTION_MODEL_REPOSITORY": str(model_repository.resolve()),
                "PREDICTION_CONFIG_DIR": str(config_dir.resolve()),
                "PREDICTION_MODELS": json.dumps(names),
                "PREDICTION_MODEL_NAME": names[0],
            },
            workdir / "prediction.log",
        )
        target = f"127.0.0.1:{ports['prediction']}"
        wait_ready(target, prediction, workdir / "prediction.log")
        console.print(
            f"InferenceService on :{ports['inference']} (metrics :{ports['inference_metrics']}), "
            f"PredictionService on :{ports['prediction']} (metrics :{ports['prediction_metrics']}), "
            f"serving {', '.join(names)}"
        )

        console.rule(f"[bold]3. Replay {sum(len(r.requests) for r in runs)} holdout records through Predict")
        for run in runs:
            run.result = asyncio.run(replay(target, run.name, run.requests, concurrency, progress))
            run.retry = asyncio.run(replay(target, run.name, run.requests[:RETRY_SAMPLE], concurrency, False))
            asyncio.run(explain_sample(target, run, run_id))
            run.uncalibrated = asyncio.run(uncalibrated_probabilities(inference_target, run))
        expected_ids = [r[0] for run in runs for r in run.requests] + [
            p.request_id for run in runs for p in run.explained
        ]
        rows = asyncio.run(crm_rows(crm_url, expected_ids))
    finally:
        codes = {"prediction": stop_service(prediction) if prediction else None, "inference": stop_service(inference)}
    return _summarise(console, runs, rows, codes, workdir)


def _training_end(training: dict) -> str:
    """How the entry's training ended (``"stopped early at epoch 18 of 40 (best epoch 13)"``); empty for
    entries written before training recorded it."""
    from mlpair.training.model import TrainingRun

    if "epochs_run" not in training:
        return ""
    return TrainingRun(training["epochs_run"], training["best_epoch"], training["config"]["epochs"]).describe()


def _family_rows(run: FamilyRun) -> tuple[list[tuple[str, str]], bool]:
    """The summary lines of one family and whether everything in them is as it must be."""
    result = run.result
    ids = [r[0] for r in run.requests if r[0] in result.probabilities]
    labels = np.array([run.holdout.labels[i] for i, r in enumerate(run.requests) if r[0] in result.probabilities])
    after = np.array([result.probabilities[i] for i in ids])
    before = np.array([p for p, r in zip(run.uncalibrated, run.requests) if r[0] in result.probabilities])
    lat = np.array(result.latencies_ms or [float("nan")])
    both_classes = bool(ids) and 0 < labels.sum() < len(labels)
    auc = roc_auc(labels, after) if both_classes else float("nan")
    baseline = np.array([p for p, r in zip(run.baseline, run.requests) if r[0] in result.probabilities])
    baseline_auc = roc_auc(labels, baseline) if both_classes else float("nan")
    ece_before, ece_after = expected_calibration_error(labels, before), expected_calibration_error(labels, after)
    min_auc, max_ece = run.targets.get("min_roc_auc", 0.0), run.targets.get("max_ece", 1.0)
    auc_ok, ece_ok = auc >= min_auc, ece_after <= max_ece
    same_ids = all(
        run.retry.decision_ids.get(r[0]) == result.decision_ids.get(r[0]) for r in run.requests[:RETRY_SAMPLE]
    )
    mark = {True: "[green]met[/]", False: "[bold red]MISSED[/]"}
    example = run.explained[0] if run.explained else None
    lines = [
        ("holdout records", str(len(run.requests))),
        (
            "decisions returned",
            f"{len(ids)} ({sum(result.failures.values())} failed"
            + (f": {dict(result.failures)})" if result.failures else ")"),
        ),
        ("holdout ROC AUC (returned probabilities)", f"{auc:.4f}  (target ≥ {min_auc:.2f}: {mark[auc_ok]})"),
        (
            "holdout ROC AUC, logistic regression",
            f"{baseline_auc:.4f}  (same split and features; served model {auc - baseline_auc:+.4f})",
        ),
        ("training", _training_end(run.entry.manifest.training) or "-"),
        (
            "Brier score before → after calibration",
            f"{brier_score(labels, before):.4f} → {brier_score(labels, after):.4f}",
        ),
        (
            "ECE (15 bins) before → after calibration",
            f"{ece_before:.4f} → {ece_after:.4f}  (target ≤ {max_ece:.2f}: {mark[ece_ok]})",
        ),
        (
            "calibration",
            f"{run.entry.manifest.calibration.method} (fitted on {run.entry.manifest.calibration.n_samples} "
            "calibration-split rows)",
        ),
        ("decisions", ", ".join(f"{d} {n}" for d, n in Counter(result.decisions.values()).most_common())),
        ("top reason codes", ", ".join(f"{c} {n}" for c, n in result.reasons.most_common(4))),
        (
            f"client latency p50 / p99 at {result.concurrency} in flight",
            f"{np.percentile(lat, 50):.1f} ms / {np.percentile(lat, 99):.1f} ms",
        ),
        (
            f"throughput at {result.concurrency} in flight",
            f"{len(ids) / result.wall_s:.0f} predictions/s" if result.wall_s else "-",
        ),
        (
            f"retried {RETRY_SAMPLE} request ids",
            f"same decision ids: {'yes' if same_ids else 'NO'}; {sum(run.retry.failures.values())} failed",
        ),
        (
            f"explained (entity {example.request_id.rsplit('-', 1)[-1]})" if example else "explained",
            f"{example.decision_label} p={example.probability:.3f}: " + "; ".join(example.top_reasons)
            if example
            else "FAILED",
        ),
    ]
    ok = (
        not result.failures
        and not run.retry.failures
        and len(ids) == len(run.requests)
        and same_ids
        and auc_ok
        and ece_ok
        and run.explain_failures == 0
    )
    return lines, ok


def _summarise(console, runs: list[FamilyRun], rows: int, codes: dict, workdir: Path) -> int:
    from rich.table import Table

    from mlpair.report import FamilyReport, write_report

    console.rule("[bold]4. Summary")
    all_ok = True
    for run in runs:
        table = Table(
            title=f"{run.name} (model version {run.entry.manifest.model_version})",
            show_header=False,
            title_justify="left",
        )
        lines, ok = _family_rows(run)
        for key, value in lines:
            table.add_row(key, value)
        console.print(table)
        all_ok &= ok
    holdout, explained = sum(len(r.requests) for r in runs), sum(len(r.explained) for r in runs)
    expected_rows = holdout + explained
    console.print(
        f"CRM rows written: {rows} = {holdout} holdout decisions + {explained} explain calls (BatchPredict, "
        f"{EXPLAIN_SAMPLE} per family, own request ids); the {sum(len(r.retry.decision_ids) for r in runs)} "
        f"retries reused request ids and added none (one row per request id: "
        f"{'yes' if rows == expected_rows else 'NO'})"
    )
    console.print(f"service exit codes: {', '.join(f'{k} {v}' for k, v in codes.items())}")
    if all(run.result.probabilities for run in runs):
        report = write_report(
            [
                FamilyReport(
                    run.name,
                    np.array(
                        [run.holdout.labels[i] for i, r in enumerate(run.requests) if r[0] in run.result.probabilities]
                    ),
                    np.array([p for p, r in zip(run.uncalibrated, run.requests) if r[0] in run.result.probabilities]),
                    np.array(
                        [run.result.probabilities[r[0]] for r in run.requests if r[0] in run.result.probabilities]
                    ),
                    dict(Counter(run.result.decisions.values()).most_common()),
                    np.array(run.result.latencies_ms),
                    np.array([p for p, r in zip(run.baseline, run.requests) if r[0] in run.result.probabilities]),
                    run.result.concurrency,
                )
                for run in runs
            ],
            workdir / "report.png",
        )
        console.print(f"report: {report}")
    failed = not all_ok or rows != expected_rows or any(c != 0 for c in codes.values())
    console.print("[bold red]demo FAILED[/]" if failed else "[bold green]demo OK[/]")
    return 1 if failed else 0
