"""``make bench-predict``: PredictionService end to end, and what its hop adds over a direct Infer call.

A benchmark, not a test: it reports numbers and checks every reply, but asserts no speed.

Both services run as their own processes (``mlpair serve inference`` / ``mlpair serve
prediction``) on loopback ports, the CRM and the shared decision ledger in a throw-away
PostgreSQL database on 127.0.0.1 (SQLite files when PostgreSQL is down; ``--ledgers sqlite`` adds
the one-machine SQLite ledger). One load generator (:mod:`bench.load`) drives, in this order:

1. ``direct Infer`` — InferenceService's own ``Infer``, one real applicant's feature row per
   call, at concurrency 1 and ``--concurrency``: the inference hop alone;
2. ``Predict`` — one applicant per call, every one a distinct feature row (a cache miss: the
   holdout applicants with their loan amount perturbed), CRM write on, at concurrency 1 and
   ``--concurrency``: the two hops end to end;
3. ``BatchPredict`` — ``--batch-items`` applicants per call (distinct rows again), with the
   relay's delivery rate to the CRM and the ledger backlog at the end of the phase;
4. ``A/B Predict`` — the previous release's PredictionService (per-pod SQLite outbox, from git
   history: :data:`tests.support.pair.PREVIOUS_RELEASE`) and this release's (shared PostgreSQL ledger),
   both running over the same InferenceService and CRM, loaded in turn (A, B, A, B, …) at
   ``--ab-concurrency``: the cost of the shared ledger, interleaved on one machine;
5. ``interleaved Predict / KServe chain / null Predict`` — the closest peer design
   (:mod:`bench.kserve_chain`: a KServe transformer doing the same feature assembly, calibration
   and policy with the same code, calling a KServe predictor running the same ONNX file over OIP
   gRPC) and the do-nothing PredictionService, loaded in turn by this one load generator for
   ``--chain-rounds`` rounds at ``--chain-concurrency``, Predict and the chain on the same
   applicants; first 200 applicants' answers are checked to be the same from both;
6. ``null Predict`` and ``null BatchPredict`` — the same calls against ``bench/null_prediction.py``,
   a do-nothing PredictionService: the floor a Python gRPC prediction hop cannot beat here.

With ``--workers 1 2`` (the default) the PredictionService phases run once per worker count
(``PREDICTION_WORKERS``; the first count also runs the Infer, BatchPredict and A/B phases, the
others Predict only), the client spreading its calls over ``--channels`` connections per replica
in every run (the kernel spreads connections, not calls, over a replica's workers).

Every phase of PredictionService also reports the ledger's commit latency p50/p99 over the phase
(``prediction_ledger_commit_duration_seconds``, interpolated within its buckets as Prometheus's
``histogram_quantile`` does).

Each reply is parsed: a decision with a probability in [0, 1], not a fallback, not from the
cache. One JSON line per phase on stdout, then a table and the targets of issue 8
(Predict ≥ 1,200/s with p99 ≤ 120 ms; BatchPredict ≥ 20,000 rows/s) and issue 16 (from the
interleaved rounds: Predict ≥ 3 × the KServe chain, ≥ 50 % of the do-nothing service with
p99 ≤ 120 ms). In the chain's lines the CPU columns "prediction" and "inference" are the KServe
transformer and predictor. The added latency of
the prediction hop is Predict's p50 minus direct Infer's p50 at the same concurrency.
Client and servers share this machine's cores: every figure is "client + both servers".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import BadReply, Repeated, drive  # noqa: E402
from tests.support import pair as harness  # noqa: E402

PREDICT = "/mlpair.prediction.v1.PredictionService/Predict"
BATCH_PREDICT = "/mlpair.prediction.v1.PredictionService/BatchPredict"
INFER = "/mlpair.inference.v1.InferenceService/Infer"
TARGET_PREDICT_PER_S = 1200
TARGET_PREDICT_P99_MS = 120
TARGET_BATCH_ROWS_PER_S = 20_000
TARGET_OVER_CHAIN = 3.0  # Predict's rate over the KServe chain's, same rounds
TARGET_SHARE_OF_NULL = 0.5  # … over the do-nothing PredictionService's
CHAIN_AGREEMENT_ROWS = 200  # applicants whose answers Predict and the KServe chain must agree on


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


class PredictCheck:
    """Checks a Predict reply; counts replies that came from the cache (should be none)."""

    def __init__(self) -> None:
        from mlpair.api.prediction.v1 import prediction_service_pb2 as pb

        self.pb = pb
        self.sources: Counter[str] = Counter()

    def predict(self, key: str, raw: bytes) -> str:
        return self._one(self.pb.PredictResponse.FromString(raw))

    def batch(self, key: str, raw: bytes) -> int:
        reply = self.pb.BatchPredictResponse.FromString(raw)
        for result in reply.results:
            if result.WhichOneof("outcome") != "prediction":
                raise BadReply(f"item error {result.error.code}")
            self._one(result.prediction)
        return len(reply.results)

    def _one(self, r) -> str:
        if r.fallback or not r.decision_label or not 0.0 <= r.probability <= 1.0:
            raise BadReply("no model decision")
        self.sources["cache" if r.from_cache else "inference"] += 1
        return r.decision_id


def predict_payloads(requests, pb, to_attributes) -> list[tuple[str, bytes]]:
    return [(rid, pb.PredictRequest(request_id=rid, entity_id=eid, model_name=harness.MODEL,
                                    attributes=to_attributes(attrs)).SerializeToString())
            for rid, eid, attrs in requests]


def batch_payloads(requests, items: int, pb, to_attributes) -> list[tuple[str, bytes]]:
    out = []
    while chunk := list(itertools.islice(requests, items)):
        message = pb.BatchPredictRequest(requests=[
            pb.PredictRequest(request_id=rid, entity_id=eid, model_name=harness.MODEL, attributes=to_attributes(attrs))
            for rid, eid, attrs in chunk])
        out.append((chunk[0][0], message.SerializeToString()))
    return out


def infer_payloads(entry, n: int, rows_per_call: int = 1) -> tuple[list[tuple[str, bytes]], tuple]:
    """``n`` Infer requests of ``rows_per_call`` real holdout applicants, and the metadata they need."""
    import numpy as np

    from mlpair.api.inference.v1 import inference_service_pb2 as ipb
    from mlpair.contracts.assembly import FeatureAssembler

    rows = FeatureAssembler(entry.preprocessing).assemble_many(harness.holdout(entry).records)
    payloads = []
    for k in range(n):
        x = np.ascontiguousarray(np.take(rows, range(k, k + rows_per_call), axis=0, mode="wrap"), "<f4")
        payloads.append((str(k), ipb.InferRequest(
            model_name=harness.MODEL, model_version=entry.manifest.model_version,
            inputs=ipb.Tensor(data_type=ipb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes())).SerializeToString()))
    return payloads, (("x-feature-version", entry.manifest.versions.feature_schema_version),)


def check_infer(key: str, raw: bytes) -> None:
    from mlpair.api.inference.v1 import inference_service_pb2 as ipb

    reply = ipb.InferResponse.FromString(raw)
    shape = list(reply.logits.shape)
    if len(shape) != 2 or shape[1] != 2 or len(reply.logits.content) != 8 * shape[0]:
        raise BadReply("malformed logits")


SCRAPED = ("prediction_coalesced_call_rows_count", "prediction_coalesced_call_rows_sum",
           "prediction_merged_calls_count", "prediction_merged_calls_sum", "prediction_outbox_delivered_total", "prediction_outbox_depth", "prediction_outbox_oldest_age_seconds")
COMMIT_BUCKETS = "prediction_ledger_commit_duration_seconds_bucket"
MAX_OF_REPLICAS = ("prediction_outbox_depth", "prediction_outbox_oldest_age_seconds")  # the shared ledger's


def scrape(metrics_ports: list[int]) -> dict:
    """PredictionService's figures this bench reads, from the Prometheus endpoint of each replica:
    Infer calls and rows sent so far (``prediction_coalesced_call_rows_count``/``_sum``),
    decisions the relays have delivered to the CRM (summed), the shared ledger's backlog and its
    oldest undelivered age (every replica reports the same: the largest), and the ledger commit
    histogram's cumulative buckets (``le`` → count, summed)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    found: dict = dict.fromkeys(SCRAPED, 0.0)
    found[COMMIT_BUCKETS] = Counter()
    for port in metrics_ports:
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in MAX_OF_REPLICAS:
                    found[sample.name] = max(found[sample.name], sample.value)
                elif sample.name in found and sample.name != COMMIT_BUCKETS:
                    found[sample.name] += sample.value
                elif sample.name == COMMIT_BUCKETS:
                    found[COMMIT_BUCKETS][float(sample.labels["le"])] += sample.value
    return found


def histogram_quantile(q: float, before: Counter, after: Counter) -> float | None:
    """The ``q`` quantile (0–1) of what a cumulative histogram counted between two scrapes, by
    linear interpolation inside the bucket it falls in (Prometheus's ``histogram_quantile``);
    None when nothing was counted."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / max(count - below, 1e-12))
        lower, below = bound, count
    return lower


def ledger_figures(scraped0: dict, scraped1: dict, phase_s: float) -> dict:
    """What the ledger and its relays did over a phase: commit latency p50/p99 (ms), decisions
    delivered to the CRM per second, the backlog left when the phase ended, and the Predict calls
    decided together per batch (``prediction_merged_calls``; None before that metric existed)."""
    delivered = scraped1["prediction_outbox_delivered_total"] - scraped0["prediction_outbox_delivered_total"]
    batches = scraped1["prediction_merged_calls_count"] - scraped0["prediction_merged_calls_count"]
    merged = scraped1["prediction_merged_calls_sum"] - scraped0["prediction_merged_calls_sum"]
    quantiles = {q: histogram_quantile(q, scraped0[COMMIT_BUCKETS], scraped1[COMMIT_BUCKETS]) for q in (0.5, 0.99)}
    return {"ledger_commit_p50_ms": None if quantiles[0.5] is None else round(1000 * quantiles[0.5], 2),
            "ledger_commit_p99_ms": None if quantiles[0.99] is None else round(1000 * quantiles[0.99], 2),
            "crm_delivered_per_s": round(delivered / phase_s, 1),
            "backlog_at_end": int(scraped1["prediction_outbox_depth"]),
            "backlog_oldest_age_s_at_end": round(scraped1["prediction_outbox_oldest_age_seconds"], 2),
            "predicts_per_merged_batch": round(merged / batches, 2) if batches else None}


def cpu_seconds(processes) -> float:
    """The CPU seconds the processes (each with a ``cpu_seconds()``) have used so far, together."""
    return sum(process.cpu_seconds() for process in processes)


def run(args) -> int:
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.client import to_attributes

    root = Path(args.model_repository).resolve()
    workdir = Path(args.workdir).resolve() / time.strftime("%Y%m%dT%H%M%S")
    entry = harness.trained_model(root)
    run_id = f"bench-{workdir.name}"
    workload = harness.credit_workload(entry, run_id)
    emit({"phase": "setup", **harness.machine(), "model": harness.MODEL, "model_version": entry.manifest.model_version,
          "workdir": str(workdir)})

    # Calls a phase can use at most: generous for this machine (a phase stops when its time is up).
    def budget(concurrency: int, seconds: float) -> int:
        return int(min(args.max_calls, (400 if concurrency == 1 else 5000) * seconds))

    checker = PredictCheck()
    results: list[dict] = []
    timed = args.warmup_s + args.duration_s
    with harness.scratch_postgres() as pg_url:
        crm = pg_url or None
        emit({"phase": "crm", "crm": "postgresql (throw-away database on 127.0.0.1)" if pg_url else "sqlite file"})
        real = {"infer", "predict", "batch", "ab", "chain"} & set(args.phases)
        for ledger, workers in itertools.product(args.ledgers if real else [], args.workers):
            metrics_port = harness.free_port()
            # PostgreSQL: the shared ledger in the CRM's database (its own schema), as replicas run it
            ledger_url = f"sqlite+aiosqlite:///{workdir / 'sqlite' / 'ledger.sqlite'}" if ledger == "sqlite" or not pg_url else None
            p = harness.pair(workdir / ledger, root, crm_url=crm, ledger_url=ledger_url,
                             prediction_env={"PREDICTION_METRICS_PORT": str(metrics_port),
                                             "PREDICTION_WORKERS": str(workers),
                                             **({"PREDICTION_RELAY_IN_PROCESS": "false"} if args.relay_processes else {}),
                                             **dict(e.split("=", 1) for e in args.env)},
                             prediction_replicas=args.prediction_replicas)
            metrics_ports = [int(r.env["PREDICTION_METRICS_PORT"]) for r in p.predictions]
            # several connections per replica: the kernel spreads connections, not calls, over its workers
            replicas = [r.address for r in p.predictions] * args.channels
            with harness.running(p), relay_processes(p, args.relay_processes) as relays:
                metrics_ports += [int(r.env["PREDICTION_RELAY_METRICS_PORT"]) for r in relays]
                emit({"phase": "started", "ledger": ledger, "workers": workers, "prediction_replicas": len(p.predictions),
                      "relay_processes": len(relays), "startup_s": {k: round(v, 2) for k, v in p.startup_s.items()}})
                cpu = {"inference": p.inference.cpu_seconds,
                       "prediction": functools.partial(cpu_seconds, p.predictions)}
                if relays:
                    cpu["relay"] = functools.partial(cpu_seconds, relays)
                phases = []
                levels = [1, *args.concurrency]
                first = ledger == args.ledgers[0] and workers == args.workers[0]
                if first and "infer" in args.phases:
                    infer, meta = infer_payloads(entry, budget(max(levels), timed))
                    phases += [("direct Infer", c, INFER, infer, check_infer, 1, meta) for c in levels]
                if "predict" in args.phases:
                    phases += [("Predict", c, PREDICT, None, checker.predict, 1, ()) for c in levels]
                if first and "batch" in args.phases:
                    phases.append(("BatchPredict", args.batch_concurrency, BATCH_PREDICT, "batch", checker.batch,
                                   args.batch_items, ()))
                for name, concurrency, method, payloads, check, rows, meta in phases:
                    seconds = timed if concurrency > 1 else args.c1_seconds + 1
                    if payloads is None:
                        payloads = predict_payloads(itertools.islice(workload, budget(concurrency, seconds)), pb,
                                                    to_attributes)
                    elif payloads == "batch":
                        n = int(min(args.max_calls * 20, args.batch_rows_budget_per_s * seconds))
                        payloads = batch_payloads(itertools.islice(workload, n), args.batch_items, pb, to_attributes)
                    before = checker.sources.copy()
                    scraped0, phase_started = scrape(metrics_ports), time.monotonic()
                    figures = asyncio.run(drive(
                        replicas if method != INFER else p.inference.address, method, payloads,
                        check=check, concurrency=concurrency, duration_s=args.duration_s if concurrency > 1 else args.c1_seconds,
                        warmup_s=args.warmup_s if concurrency > 1 else 1.0, metadata=meta, rows_per_call=rows,
                        cpu_of=cpu))
                    line = {"phase": name, "ledger": ledger if method != INFER else None,
                            "workers": workers if method != INFER else None,
                            "concurrency": concurrency, "rows_per_call": rows, **figures}
                    if method != INFER:
                        line["replies_from_cache"] = checker.sources["cache"] - before["cache"]
                        scraped1, phase_s = scrape(metrics_ports), time.monotonic() - phase_started
                        calls = scraped1["prediction_coalesced_call_rows_count"] - scraped0["prediction_coalesced_call_rows_count"]
                        rows_sent = scraped1["prediction_coalesced_call_rows_sum"] - scraped0["prediction_coalesced_call_rows_sum"]
                        line["infer_calls"] = int(calls)  # whole phase, warm-up included
                        line["rows_per_infer_call"] = round(rows_sent / max(1.0, calls), 2)
                        # did the relays keep up? decisions delivered to the CRM per second over the
                        # whole phase, and what waited in the ledger when the phase ended
                        line.update(ledger_figures(scraped0, scraped1, phase_s))
                    emit(line)
                    results.append(line)
                if first and "ab" in args.phases:
                    results += ab_predict(args, p, metrics_ports, workdir, workload, checker, pb, to_attributes)
                if first and "chain" in args.phases:
                    results += chain_rounds(args, p, metrics_ports, entry, workdir, workload, checker, pb,
                                            to_attributes)
            emit({"phase": "stopped", "ledger": ledger, "workers": workers,
                  "exit_codes": {**{f"prediction-{i + 1}" if i else "prediction": r.process.returncode
                                    for i, r in enumerate(p.predictions)},
                                 "inference": p.inference.process.returncode}})
    if "null" in args.phases:
        null_check = PredictCheck()
        with null_prediction(workdir) as null:
            cpu = {"prediction": null.cpu_seconds}
            phases = [("null Predict", c, PREDICT, null_check.predict, 1) for c in [1, *args.concurrency]]
            phases.append(("null BatchPredict", args.batch_concurrency, BATCH_PREDICT, null_check.batch,
                           args.batch_items))
            # distinct requests do not matter to a server that does nothing: a few, sent over and over
            predicts = predict_payloads(itertools.islice(workload, 2000), pb, to_attributes)
            batches = batch_payloads(itertools.islice(workload, 8 * args.batch_items), args.batch_items, pb,
                                     to_attributes)
            for name, concurrency, method, check, rows in phases:
                payloads = Repeated(predicts if method == PREDICT else batches, args.max_calls)
                figures = asyncio.run(drive(
                    null.address, method, payloads, check=check, concurrency=concurrency,
                    duration_s=args.duration_s if concurrency > 1 else args.c1_seconds,
                    warmup_s=args.warmup_s if concurrency > 1 else 1.0, rows_per_call=rows, cpu_of=cpu))
                line = {"phase": name, "ledger": None, "concurrency": concurrency, "rows_per_call": rows,
                        **figures}
                emit(line)
                results.append(line)
    return summarise(results, args.concurrency, args.workers)


def ab_predict(args, p: harness.Pair, metrics_ports: list[int], workdir: Path, workload, checker: PredictCheck, pb,
               to_attributes) -> list[dict]:
    """Interleaved A/B of Predict at ``--ab-concurrency``: A is the previous release's
    PredictionService (its own SQLite outbox, synchronous FULL, from git history), B this
    release's replicas of ``p`` (the shared ledger); both over ``p``'s InferenceService and CRM,
    loaded in turn for ``--ab-rounds`` rounds. Returns one line per variant and round."""
    release = harness.previous_release(workdir / "previous-release", args.baseline)
    if release is None:
        emit({"phase": "A/B Predict", "skipped": f"no git history with {args.baseline}"})
        return []
    baseline_metrics = harness.free_port()
    baseline = harness.Service("prediction", {
        **p.prediction.env, "PYTHONPATH": str(release / "package"),
        "PREDICTION_CONFIG_DIR": str(release / "source" / "config"),
        "PREDICTION_OUTBOX_URL": f"sqlite+aiosqlite:///{workdir / 'previous-release' / 'outbox.sqlite'}",
        "PREDICTION_OUTBOX_SYNCHRONOUS": "FULL", "PREDICTION_METRICS_PORT": str(baseline_metrics)},
        harness.free_port(), workdir / "previous-release.log")
    baseline.env["PREDICTION_PORT"] = str(baseline.port)
    baseline.start()
    variants = {"A: previous release, per-pod outbox": ([baseline.address], baseline.cpu_seconds, None),
                "B: this release, shared ledger": ([r.address for r in p.predictions],
                                                   lambda: sum(r.cpu_seconds() for r in p.predictions), metrics_ports)}
    lines = []
    try:
        for round_ in range(args.ab_rounds):
            for variant, (addresses, cpu, ports) in variants.items():
                n = int(min(args.max_calls, 5000 * (args.warmup_s + args.duration_s)))
                payloads = predict_payloads(itertools.islice(workload, n), pb, to_attributes)
                lines.append(measured(args, addresses, PREDICT, payloads, checker.predict, args.ab_concurrency,
                                      {"inference": p.inference.cpu_seconds, "prediction": cpu}, ports,
                                      {"phase": "A/B Predict", "variant": variant, "round": round_ + 1,
                                       "ledger": variant[:1]}))
    finally:
        baseline.terminate()
    return lines


def measured(args, addresses, method: str, payloads, check, concurrency: int, cpu_of: dict,
             metrics_ports: list[int], fields: dict) -> dict:
    """One measured phase of single-row calls: drives the load, adds the ledger's figures over the
    phase when ``metrics_ports`` are given, emits the line and returns it."""
    scraped0, started = (scrape(metrics_ports), time.monotonic()) if metrics_ports else (None, 0.0)
    figures = asyncio.run(drive(addresses, method, payloads, check=check, concurrency=concurrency,
                                duration_s=args.duration_s, warmup_s=args.warmup_s, cpu_of=cpu_of))
    line = {**fields, "concurrency": concurrency, "rows_per_call": 1, **figures}
    if metrics_ports:
        line.update(ledger_figures(scraped0, scrape(metrics_ports), time.monotonic() - started))
    emit(line)
    return line


def chain_rounds(args, p: harness.Pair, metrics_ports: list[int], entry, workdir: Path, workload,
                 checker: PredictCheck, pb, to_attributes) -> list[dict]:
    """Predict against the KServe transformer → predictor chain (:mod:`bench.kserve_chain`: the
    same business work, the same model version and policy) and the do-nothing PredictionService,
    interleaved: each of ``--chain-rounds`` rounds loads Predict, the chain and the null service in
    turn (the order rotating by round) at each ``--chain-concurrency``, with the same applicants
    for Predict and the chain (every Predict a cache miss). First the answers are compared: the
    chain's probability, decision and reason codes for ``CHAIN_AGREEMENT_ROWS`` applicants must be
    Predict's. Returns one line per setup, level and round."""
    from bench.kserve_chain import MODEL_INFER, Chain, chain_payloads, chain_reply

    try:
        chain = Chain(harness.MODEL, entry.path, entry.model_path, harness.CONFIG_DIR / harness.MODEL / "policy.toml",
                      workdir, Path(args.chain_venvs).resolve())
        chain.start()
    except RuntimeError as exc:
        emit({"phase": "chain", "skipped": str(exc)[-600:]})
        return []
    lines: list[dict] = []
    try:
        agreement = chain_agreement(p, chain, workload, pb, to_attributes, chain_payloads, chain_reply, MODEL_INFER)
        emit({"phase": "chain agreement", **agreement})
        if agreement["mismatches"]:
            return lines

        def chain_check(key: str, raw: bytes) -> str:
            try:
                probability, decision, _ = chain_reply(raw)
            except ValueError as exc:
                raise BadReply(str(exc)) from exc
            if not decision or not 0.0 <= probability <= 1.0:
                raise BadReply("no chain decision")
            return key

        null_check = PredictCheck()
        with null_prediction(workdir) as null:
            for round_ in range(args.chain_rounds):
                for concurrency in args.chain_concurrency:
                    n = int(min(args.max_calls, 5000 * (args.warmup_s + args.duration_s)))
                    requests = list(itertools.islice(workload, n))  # the same applicants for both
                    setups = [
                        ("Predict", [r.address for r in p.predictions], PREDICT,
                         predict_payloads(requests, pb, to_attributes), checker.predict,
                         {"inference": p.inference.cpu_seconds,
                          "prediction": lambda: sum(r.cpu_seconds() for r in p.predictions)}),
                        ("KServe chain", [chain.address], MODEL_INFER, chain_payloads(requests, harness.MODEL),
                         chain_check, {"prediction": lambda: chain.cpu_seconds("transformer"),
                                       "inference": lambda: chain.cpu_seconds("predictor")}),
                        ("null Predict", [null.address], PREDICT,
                         Repeated(predict_payloads(requests[:2000], pb, to_attributes), args.max_calls),
                         null_check.predict, {"prediction": null.cpu_seconds}),
                    ]
                    shift = round_ % len(setups)
                    for name, addresses, method, payloads, check, cpu in setups[shift:] + setups[:shift]:
                        predict = name == "Predict"  # only Predict has a ledger to report on
                        lines.append(measured(args, addresses, method, payloads, check, concurrency, cpu,
                                              metrics_ports if predict else [],
                                              {"phase": f"interleaved {name}", "round": round_ + 1,
                                               "ledger": "postgresql" if predict else None}))
    finally:
        chain.stop()
    return lines


def chain_agreement(p: harness.Pair, chain, workload, pb, to_attributes, chain_payloads, chain_reply,
                    method: str) -> dict:
    """Sends ``CHAIN_AGREEMENT_ROWS`` applicants to Predict and to the chain, one at a time, and
    counts the answers that differ (probability beyond float32 rounding, decision or reason codes)."""
    import grpc

    requests = list(itertools.islice(workload, CHAIN_AGREEMENT_ROWS))
    mismatches, worst = [], 0.0
    with grpc.insecure_channel(p.prediction.address) as ours, grpc.insecure_channel(chain.address) as theirs:
        predict, infer = ours.unary_unary(PREDICT), theirs.unary_unary(method)
        for (rid, raw), (_, chain_raw), _request in zip(predict_payloads(requests, pb, to_attributes),
                                                       chain_payloads(requests, harness.MODEL), requests):
            a = pb.PredictResponse.FromString(predict(raw, timeout=10))
            probability, decision, reasons = chain_reply(infer(chain_raw, timeout=10))
            worst = max(worst, abs(a.probability - probability))
            if abs(a.probability - probability) > 1e-6 or a.decision_label != decision \
                    or tuple(a.reason_codes) != reasons:
                mismatches.append({"request_id": rid, "predict": [a.probability, a.decision_label, list(a.reason_codes)],
                                   "chain": [probability, decision, list(reasons)]})
    return {"applicants": len(requests), "mismatches": len(mismatches), "first_mismatches": mismatches[:3],
            "max_abs_probability_diff": worst}


@contextlib.contextmanager
def relay_processes(p: harness.Pair, n: int) -> Iterator[list[harness.Service]]:
    """``n`` ``mlpair relay`` processes (the outbox relay in processes of its own) over the pair's
    ledger and CRM, with the serving processes' ``PREDICTION_*`` settings and ports of their own,
    each SERVING on its health port; stopped by PID on exit."""
    relays: list[harness.Service] = []
    try:
        for i in range(n):
            relay = harness.Service("relay", dict(p.prediction.env), harness.free_port(),
                                    p.workdir / f"relay-{i + 1}.log")
            relay.env.update({"PREDICTION_RELAY_PORT": str(relay.port),
                              "PREDICTION_RELAY_METRICS_PORT": str(harness.free_port())})
            with open(relay.log_path, "a") as log:
                relay.process = subprocess.Popen([sys.executable, "-P", "-m", "mlpair.cli", "relay"],
                                                 env={**os.environ, **relay.env}, stdout=log, stderr=subprocess.STDOUT)
            relays.append(relay)
            relay.wait_serving(60.0)
        yield relays
    finally:
        for relay in relays:
            relay.terminate(30.0)


@contextlib.contextmanager
def null_prediction(workdir: Path) -> Iterator[harness.Service]:
    """``bench/null_prediction.py`` (a do-nothing PredictionService) as a process on a free
    loopback port, SERVING; stopped by PID on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    service = harness.Service("null-prediction", {}, harness.free_port(), workdir / "null-prediction.log")
    with open(service.log_path, "a") as log:
        service.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("null_prediction.py")), "--port", str(service.port)],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        service.wait_serving(30.0)
        yield service
    finally:
        service.terminate(10.0)


def summarise(results: list[dict], levels: list[int], workers: list[int]) -> int:
    """Prints the table and one summary line (hop latency, targets); returns 1 if any call failed."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="PredictionService end to end (client + both services on this machine)")
    for column in ("phase", "ledger", "conc", "rows/call", "calls/s", "rows/s", "p50 ms", "p99 ms", "errors",
                   "rows/Infer", "ledger commit p50 / p99 ms", "CRM delivered/s", "backlog at end: rows / oldest s",
                   "CPU % client / prediction / inference / others", "µs CPU per call: client / prediction / inference"):
        table.add_column(column, justify="left" if column in ("phase", "ledger") else "right")
    for r in results:
        cpu, per_call = r.get("cpu_pct", {}), r.get("cpu_ms_per_call", {})
        phase = f"{r['phase']} {r['variant'][:1]}{r['round']}" if "variant" in r \
            else f"{r['phase']} r{r['round']}" if "round" in r else r["phase"]
        phase += f" ({r['workers']} workers)" if r.get("workers") and len(workers) > 1 else ""
        table.add_row(phase, r["ledger"] or "-", str(r["concurrency"]), str(r["rows_per_call"]),
                      f"{r['calls_per_s']:,.0f}", f"{r['rows_per_s']:,.0f}", str(r["p50_ms"]), str(r["p99_ms"]),
                      str(r["errors"]), str(r.get("rows_per_infer_call", "-")),
                      f"{r['ledger_commit_p50_ms']} / {r['ledger_commit_p99_ms']}" if "ledger_commit_p50_ms" in r else "-",
                      f"{r['crm_delivered_per_s']:,.0f}" if "crm_delivered_per_s" in r else "-",
                      f"{r['backlog_at_end']:,} / {r['backlog_oldest_age_s_at_end']}" if "backlog_at_end" in r else "-",
                      " / ".join(f"{cpu.get(k, 0):.0f}" for k in ("client", "prediction", "inference"))
                      + f" / {r.get('cpu_pct_others', 0):.0f}",
                      " / ".join(f"{1000 * per_call.get(k, 0):,.0f}" for k in ("client", "prediction", "inference")))
    Console(file=sys.stdout, width=200).print(table)

    def find(phase: str, conc: int, ledger: str = "postgresql", n: int = workers[0]) -> dict | None:
        return next((r for r in results if r["phase"] == phase and r["concurrency"] == conc
                     and r["ledger"] in (ledger, None) and r.get("workers") in (n, None)), None)

    summary: dict = {"phase": "summary"}
    for conc in [1, *levels]:
        predict, infer = find("Predict", conc), find("direct Infer", conc)
        if predict and infer and predict["p50_ms"] is not None and infer["p50_ms"] is not None:
            summary[f"prediction_hop_added_p50_ms_c{conc}"] = round(predict["p50_ms"] - infer["p50_ms"], 2)
            summary[f"prediction_hop_added_p99_ms_c{conc}"] = round(predict["p99_ms"] - infer["p99_ms"], 2)
    for conc in levels:
        for ledger in ("postgresql", "sqlite"):
            if predict := find("Predict", conc, ledger):
                suffix = f"c{conc}" + ("_sqlite_ledger" if ledger == "sqlite" else "")
                summary[f"predict_per_s_{suffix}"] = predict["calls_per_s"]
                summary[f"predict_p99_ms_{suffix}"] = predict["p99_ms"]
                summary[f"predict_target_met_{suffix}"] = (predict["calls_per_s"] >= TARGET_PREDICT_PER_S
                                                           and (predict["p99_ms"] or 1e9) <= TARGET_PREDICT_P99_MS)
    for conc in levels:  # the same load over `--channels` connections per replica, by workers per replica
        by_workers = {n: find("Predict", conc, n=n) for n in workers}
        if len(workers) > 1 and all(by_workers.values()):
            summary[f"predict_per_s_c{conc}_by_workers"] = {n: r["calls_per_s"] for n, r in by_workers.items()}
            summary[f"predict_p99_ms_c{conc}_by_workers"] = {n: r["p99_ms"] for n, r in by_workers.items()}
    if batch := next((r for r in results if r["phase"] == "BatchPredict"), None):
        summary["batch_rows_per_s"] = batch["rows_per_s"]
        summary["batch_crm_delivered_per_s"] = batch.get("crm_delivered_per_s")
        summary["batch_backlog_at_end"] = batch.get("backlog_at_end")
        summary["batch_target_met"] = batch["rows_per_s"] >= TARGET_BATCH_ROWS_PER_S
    # the real service as a share of the do-nothing one (bench/null_prediction.py): 1.0 = the floor
    for conc in levels:
        predict, null = find("Predict", conc), find("null Predict", conc)
        if predict and null and null["calls_per_s"]:
            summary[f"predict_share_of_null_c{conc}"] = round(predict["calls_per_s"] / null["calls_per_s"], 2)
    null_batch = next((r for r in results if r["phase"] == "null BatchPredict"), None)
    if batch and null_batch and null_batch["rows_per_s"]:
        summary["batch_share_of_null"] = round(batch["rows_per_s"] / null_batch["rows_per_s"], 2)
    ab = [r for r in results if r["phase"] == "A/B Predict"]
    if ab:  # this release's shared ledger against the previous release's per-pod outbox, same rounds
        rates = {v: [r["calls_per_s"] for r in ab if r["ledger"] == v] for v in ("A", "B")}
        summary["ab_predict_per_s"] = {v: rates[v] for v in rates}
        summary["ab_p99_ms"] = {v: [r["p99_ms"] for r in ab if r["ledger"] == v] for v in ("A", "B")}
        if rates["A"] and rates["B"]:
            summary["ab_rate_ratio_b_over_a"] = round(sum(rates["B"]) / sum(rates["A"]), 3)
        summary["ab_ledger_commit_p50_p99_ms"] = [(r.get("ledger_commit_p50_ms"), r.get("ledger_commit_p99_ms"))
                                                  for r in ab if r["ledger"] == "B"]
    summary.update(chain_summary(results))
    summary["targets"] = {"predict_per_s": TARGET_PREDICT_PER_S, "predict_p99_ms": TARGET_PREDICT_P99_MS,
                          "batch_rows_per_s": TARGET_BATCH_ROWS_PER_S,
                          "predict_over_chain": TARGET_OVER_CHAIN, "predict_share_of_null": TARGET_SHARE_OF_NULL}
    summary["errors"] = sum(r["errors"] for r in results)
    summary["replies_from_cache"] = sum(r.get("replies_from_cache", 0) for r in results)
    emit(summary)
    return 1 if summary["errors"] else 0


def chain_summary(results: list[dict]) -> dict:
    """The interleaved rounds' medians per setup and level, and Predict's ratios to the KServe
    chain and to the do-nothing PredictionService (same rounds), against the targets."""
    import statistics

    out: dict = {}
    interleaved = [r for r in results if r["phase"].startswith("interleaved ")]
    for conc in sorted({r["concurrency"] for r in interleaved}):
        rates, p99 = {}, {}
        for name in ("Predict", "KServe chain", "null Predict"):
            lines = [r for r in interleaved if r["phase"] == f"interleaved {name}" and r["concurrency"] == conc]
            if lines:
                rates[name] = statistics.median(r["calls_per_s"] for r in lines)
                p99[name] = statistics.median(r["p99_ms"] or 1e9 for r in lines)
                out[f"interleaved_{name.lower().replace(' ', '_')}_per_s_c{conc}"] = [r["calls_per_s"] for r in lines]
        if rates.get("Predict") and rates.get("KServe chain"):
            ratio = round(rates["Predict"] / rates["KServe chain"], 2)
            out[f"predict_over_chain_c{conc}"] = {"value": ratio, "target": TARGET_OVER_CHAIN,
                                                  "met": ratio >= TARGET_OVER_CHAIN}
        if rates.get("Predict") and rates.get("null Predict"):
            share = round(rates["Predict"] / rates["null Predict"], 2)
            out[f"predict_share_of_null_interleaved_c{conc}"] = {
                "value": share, "p99_ms": p99["Predict"], "target": f">= {TARGET_SHARE_OF_NULL} with p99 <= "
                f"{TARGET_PREDICT_P99_MS} ms", "met": share >= TARGET_SHARE_OF_NULL and p99["Predict"] <= TARGET_PREDICT_P99_MS}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--workdir", default="var/bench-predict", help="logs, and SQLite ledger and CRM files")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 32],
                        help="Predict / Infer calls in flight (each level is a phase; concurrency 1 always runs)")
    parser.add_argument("--duration-s", type=float, default=15.0, help="measured seconds per phase")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured seconds before each phase")
    parser.add_argument("--c1-seconds", type=float, default=5.0, help="measured seconds of the concurrency-1 phases")
    parser.add_argument("--batch-items", type=int, default=500, help="applicants per BatchPredict call")
    parser.add_argument("--batch-concurrency", type=int, default=4, help="BatchPredict calls in flight")
    parser.add_argument("--batch-rows-budget-per-s", type=int, default=60_000,
                        help="distinct rows prepared per second of the BatchPredict phase (its upper bound: "
                             "above issue 16's 50,000 rows/s, so the phase can show that target met)")
    parser.add_argument("--max-calls", type=int, default=100_000, help="upper bound of calls per phase")
    parser.add_argument("--ledgers", nargs="+", default=["postgresql"], choices=["postgresql", "sqlite"],
                        help="decision ledgers to run the phases with (the first also runs Infer, BatchPredict and A/B)")
    parser.add_argument("--ab-concurrency", type=int, default=32, help="Predict calls in flight in the A/B phases")
    parser.add_argument("--ab-rounds", type=int, default=2, help="interleaved A/B rounds (A then B in each)")
    parser.add_argument("--baseline", default=harness.PREVIOUS_RELEASE,
                        help="git commit of the A side of the A/B [default: the previous release]")
    parser.add_argument("--chain-concurrency", type=int, nargs="+", default=[32],
                        help="calls in flight in the interleaved Predict / KServe chain / null rounds")
    parser.add_argument("--chain-rounds", type=int, default=2, help="interleaved rounds of the chain phase")
    parser.add_argument("--chain-venvs", default="var/bench/venvs",
                        help="where the KServe virtualenv is (made there on first use, as `make bench` does)")
    parser.add_argument("--env", action="append", default=[], help="extra PREDICTION_*=value for PredictionService")
    parser.add_argument("--relay-processes", type=int, default=0,
                        help="deliver with this many `mlpair relay` processes (the serving processes' relay off; "
                             "their CPU reported as cpu_s_relay); 0 = the relay in the serving processes")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                        help="PredictionService workers per replica, one run each (the first also runs Infer, "
                             "BatchPredict, A/B; the others Predict only)")
    parser.add_argument("--channels", type=int, default=4,
                        help="client connections per PredictionService replica (its workers each take some)")
    parser.add_argument("--prediction-replicas", type=int, default=1,
                        help="PredictionService processes (own port each; one InferenceService, ledger and CRM); "
                             "calls are spread over them round-robin, as a Service over several pods would")
    parser.add_argument("--phases", nargs="+", default=["infer", "predict", "batch", "ab", "chain", "null"],
                        choices=["infer", "predict", "batch", "ab", "chain", "null"],
                        help="which phases to run (all by default); ab = Predict, previous release against this "
                             "one, interleaved; chain = Predict, the KServe transformer → predictor chain (bench/kserve_chain.py) "
                             "and the do-nothing PredictionService, interleaved; null = Predict and BatchPredict "
                             "against bench/null_prediction.py, a do-nothing PredictionService")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 2 or args.duration_s <= 0 or args.warmup_s + args.duration_s > 300:
        parser.error("need concurrency >= 2 (1 always runs) and 0 < duration-s, warmup-s + duration-s <= 300")
    return args


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
