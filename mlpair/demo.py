"""``mlpair demo``: the main job end to end on real data, for every model family in ``config/``.

Trains (or reuses) each family's model, starts InferenceService and PredictionService as
separate processes on free local ports (one pair serving every family), waits for readiness,
replays every holdout entity's raw record through ``PredictionService.Predict`` concurrently
as a business system would, retries a sample with the same request ids to show idempotency,
asks ``BatchPredict`` to explain a few decisions, reads the raw logits of the holdout from
InferenceService to show calibration before and after, feeds the holdout's true labels back
through ``RecordOutcomes`` and reads the realised figures PredictionService computes from them,
prints a summary per family (ROC AUC,
Brier score, ECE before and after calibration against the family's targets, realised beside
holdout figures), writes a report
picture and stops both services with SIGTERM. Exits non-zero if anything failed or a target
was missed.

The demo is a client of the pair like any other: it calls both services through
:mod:`mlpair.client` alone, never their code (``tests/test_demo_boundary.py``). The services as
processes are :mod:`mlpair.local_pair`; the summary and verdict :mod:`mlpair.demo_summary`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mlpair.client import AsyncPredictionClient, BatchItem, ItemError, infer_logits
from mlpair.demo_summary import summarise, training_end
from mlpair.local_pair import free_port, migrate, start_service, stop_service, wait_ready

if TYPE_CHECKING:
    import subprocess

    from mlpair.api.prediction.v1.prediction_service_pb2 import PredictResponse
    from mlpair.contracts.manifest import Manifest, ModelEntry
    from mlpair.training.data import Dataset

RETRY_SAMPLE = 50
OUTCOMES_PER_CALL = 5000  # true labels per RecordOutcomes call
EXPLAIN_SAMPLE = 3
# The CRM's decisions table (one row per request id), which the summary counts: the CRM is the
# business's database, read here by name as a report would read it (tests/test_demo_boundary.py
# checks the name against PredictionService's model of the table).
CRM_TABLE = "decisions"


# (request id, entity id, raw attributes) of one holdout entity's Predict call
Request = tuple[str, str, dict[str, Any]]


@dataclass
class Replay:
    """What the business-system side saw for one family."""

    probabilities: dict[str, float] = field(default_factory=dict)
    decisions: dict[str, str] = field(default_factory=dict)
    decision_ids: dict[str, str] = field(default_factory=dict)
    reasons: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)  # status code name → calls refused
    wall_s: float = 0.0
    concurrency: int = 0  # Predict calls in flight


@dataclass
class FamilyRun:
    """One family's holdout, its requests and everything measured about them."""

    name: str
    entry: ModelEntry
    fresh: bool  # trained by this run (else reused: the repository's latest was up to date)
    holdout: Dataset
    requests: list[Request]
    targets: dict[str, float]
    baseline: np.ndarray  # [n holdout] P(positive) of logistic regression fitted on the same training split
    result: Replay = field(default_factory=Replay)
    retry: Replay = field(default_factory=Replay)
    explained: list[PredictResponse] = field(default_factory=list)  # with top reasons
    explain_failures: int = 0
    uncalibrated: np.ndarray | None = None  # [n holdout] softmax of the raw logits, once read
    outcomes_stored: int = 0  # true labels fed back through RecordOutcomes and stored
    outcomes_refused: int = 0
    realised: dict[str, float] = field(default_factory=dict)  # PredictionService's realised_* gauges, window "all"


def discover_families(config_dir: Path) -> list[str]:
    """Every ``config_dir/<name>/`` holding a feature schema, sorted."""
    return sorted(p.parent.name for p in config_dir.glob("*/feature-schema.toml"))


async def replay(target: str, model_name: str, requests: list[Request], concurrency: int, progress: bool) -> Replay:
    """Sends every ``(request_id, entity_id, attributes)`` through Predict, ``concurrency`` at a time."""
    import grpc
    from rich.progress import Progress

    out = Replay(concurrency=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with AsyncPredictionClient(target, timeout_s=10) as client:
        with Progress(disable=not progress) as bar:
            task = bar.add_task(f"Predict {model_name}", total=len(requests))

            async def one(request_id: str, entity_id: str, attributes: dict[str, Any]) -> None:
                async with gate:
                    t0 = time.perf_counter()
                    try:
                        reply = await client.predict(model_name, entity_id, attributes, request_id)
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
    items = [
        BatchItem(run.name, eid, rec, request_id=f"demo-{run_id}-{run.name}-explain-{eid}", explain=True)
        for eid, rec in zip(run.holdout.entity_ids[:EXPLAIN_SAMPLE], run.holdout.records)
    ]
    async with AsyncPredictionClient(target, timeout_s=10) as client:
        outcomes = await client.batch_predict(items)
    run.explained = [o for o in outcomes if not isinstance(o, ItemError)]
    run.explain_failures = len(items) - len(run.explained)


async def feed_outcomes(target: str, run: FamilyRun) -> None:
    """Feeds each answered holdout entity's true label back through RecordOutcomes, as the business
    would once it learns it (its class name as the manifest names it)."""
    from mlpair.client import Outcome, OutcomeError

    names = run.entry.manifest.class_names
    positive, negative = names[run.entry.manifest.positive_index], names[1 - run.entry.manifest.positive_index]
    outcomes = [
        Outcome(positive if run.holdout.labels[i] else negative, request_id)
        for i, (request_id, _, _) in enumerate(run.requests)
        if request_id in run.result.probabilities
    ]
    async with AsyncPredictionClient(target, timeout_s=60) as client:
        for start in range(0, len(outcomes), OUTCOMES_PER_CALL):
            results = await client.record_outcomes(outcomes[start : start + OUTCOMES_PER_CALL])
            refused = sum(isinstance(r, OutcomeError) for r in results)
            run.outcomes_refused += refused
            run.outcomes_stored += len(results) - refused


def read_realised(metrics_url: str, runs: list[FamilyRun], wait_s: float = 30.0) -> None:
    """Reads each family's ``prediction_realised_*`` gauges (window ``all``) once PredictionService's
    refresh has joined every outcome fed back (or ``wait_s`` passed)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + wait_s
    while True:
        with urllib.request.urlopen(metrics_url, timeout=5) as reply:
            text = reply.read().decode()
        for run in runs:
            run.realised = {
                s.name.removeprefix("prediction_realised_"): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name.startswith("prediction_realised_")
                and s.labels.get("family") == run.name
                and s.labels.get("model_version") == run.entry.manifest.model_version
                and s.labels.get("window") == "all"
                and "band" not in s.labels
                and "decision" not in s.labels
            }
        if all(r.realised.get("outcomes") == r.outcomes_stored for r in runs) or time.monotonic() > deadline:
            return
        time.sleep(0.5)


def uncalibrated_probabilities(target: str, run: FamilyRun) -> np.ndarray:
    """Softmax of the raw holdout logits ``[n holdout]``, read straight from InferenceService (as an
    internal caller would).

    Raises:
        grpc.RpcError: InferenceService refused a call (see :func:`mlpair.client.infer_logits`).
    """
    from mlpair.contracts.assembly import FeatureAssembler

    manifest = run.entry.manifest
    x = FeatureAssembler(run.entry.preprocessing).assemble_many(run.holdout.records)
    logits, _ = infer_logits(
        target, run.name, manifest.model_version, manifest.versions.feature_schema_version, x, timeout_s=10
    )
    return manifest.calibration.probabilities(logits, manifest.positive_index, "none")


async def crm_rows(crm_url: str, request_ids: list[str], wait_s: float = 10.0) -> int:
    """Rows in the CRM for these request ids. Decisions reach the CRM through the ledger's relay
    moments after they are returned, so this waits up to ``wait_s`` seconds for all of them.

    The CRM is the business's database: this counts rows in it by table and column name, as any
    report on it would (:data:`CRM_TABLE`), not through PredictionService's code.
    """
    from sqlalchemy import column, func, select, table
    from sqlalchemy.ext.asyncio import create_async_engine

    decisions = table(CRM_TABLE, column("request_id"))
    counted = select(func.count()).select_from(decisions).where(decisions.c.request_id.in_(request_ids))
    engine = create_async_engine(crm_url)
    deadline = time.monotonic() + wait_s
    try:
        while True:
            async with engine.connect() as conn:
                rows = await conn.scalar(counted) or 0
            if rows >= len(request_ids) or time.monotonic() > deadline:
                return rows
            await asyncio.sleep(0.1)
    finally:
        await engine.dispose()


def _split_seed(manifest: Manifest) -> int:
    """The seed training split the data with (manifest ``data_source.split.seed``).

    Raises:
        ValueError: the manifest records no integer split seed.
    """
    split = manifest.data_source.get("split")
    seed = split.get("seed") if isinstance(split, dict) else None
    if not isinstance(seed, int):
        raise ValueError(f"{manifest.model_name} version {manifest.model_version}: the manifest records no split seed")
    return seed


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
    splits = stratified_split(data.labels, _split_seed(entry.manifest))
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
            f"{', ' + training_end(m.training) if training_end(m.training) else ''}; source {m.data_source['source']}, {m.data_source['rows']} rows, "
            f"holdout {len(run.requests)}"
        )

    crm_url = f"sqlite+aiosqlite:///{(workdir / 'crm.sqlite').resolve()}"
    ledger_url = f"sqlite+aiosqlite:///{(workdir / 'ledger.sqlite').resolve()}"
    ports = {name: free_port() for name in ("inference", "inference_metrics", "prediction", "prediction_metrics")}
    console.rule("[bold]2. Migrate the decision ledger and the CRM, start both services")
    migrated = migrate(ledger_url, crm_url)
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
    prediction: subprocess.Popen[bytes] | None = None
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
                # the realised figures over every decision, refreshed each second for the summary
                "PREDICTION_OUTCOME_WINDOWS_H": "[0]",
                "PREDICTION_OUTCOME_REFRESH_S": "1",
                "PREDICTION_OUTCOME_MIN_JOINED": "1",
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
        for run in runs:  # then the holdout's true labels fed back (RecordOutcomes), as outcomes
            run.result = asyncio.run(replay(target, run.name, run.requests, concurrency, progress))
            run.retry = asyncio.run(replay(target, run.name, run.requests[:RETRY_SAMPLE], concurrency, False))
            asyncio.run(explain_sample(target, run, run_id))
            run.uncalibrated = uncalibrated_probabilities(inference_target, run)
            asyncio.run(feed_outcomes(target, run))
        read_realised(f"http://127.0.0.1:{ports['prediction_metrics']}/metrics", runs)
        expected_ids = [r[0] for run in runs for r in run.requests] + [
            p.request_id for run in runs for p in run.explained
        ]
        rows = asyncio.run(crm_rows(crm_url, expected_ids))
    finally:
        codes = {"prediction": stop_service(prediction) if prediction else None, "inference": stop_service(inference)}
    return summarise(console, runs, rows, codes, workdir, retry_sample=RETRY_SAMPLE, explain_sample=EXPLAIN_SAMPLE)
