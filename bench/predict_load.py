"""``make bench-predict``: PredictionService end to end, and what its hop adds over a direct Infer call.

A benchmark, not a test: it reports numbers and checks every reply, but asserts no speed.

Both services run as their own processes (``mlpair serve inference`` / ``mlpair serve
prediction``) on loopback ports, the CRM in a throw-away PostgreSQL database on 127.0.0.1
(a SQLite file when PostgreSQL is down), the outbox with ``synchronous=FULL`` (the default:
an fsync per group commit). One load generator (:mod:`bench.load`) drives, in this order:

1. ``direct Infer`` — InferenceService's own ``Infer``, one real applicant's feature row per
   call, at concurrency 1 and ``--concurrency``: the inference hop alone;
2. ``Predict`` — one applicant per call, every one a distinct feature row (a cache miss: the
   holdout applicants with their loan amount perturbed), CRM write on, at concurrency 1 and
   ``--concurrency``: the two hops end to end;
3. ``BatchPredict`` — ``--batch-items`` applicants per call (distinct rows again);
4. optionally ``Predict`` again after restarting PredictionService with the outbox at
   ``synchronous=NORMAL`` (survives a process crash, not an OS crash), for comparison only;
5. ``null Predict`` and ``null BatchPredict`` — the same calls against ``bench/null_prediction.py``,
   a do-nothing PredictionService: the floor a Python gRPC prediction hop cannot beat here.

Each reply is parsed: a decision with a probability in [0, 1], not a fallback, not from the
cache. One JSON line per phase on stdout, then a table and the targets of issue 8
(Predict ≥ 1,200/s with p99 ≤ 120 ms; BatchPredict ≥ 20,000 rows/s). The added latency of
the prediction hop is Predict's p50 minus direct Infer's p50 at the same concurrency.
Client and servers share this machine's cores: every figure is "client + both servers".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import pair as harness  # noqa: E402
from bench.load import BadReply, Repeated, drive  # noqa: E402

PREDICT = "/mlpair.prediction.v1.PredictionService/Predict"
BATCH_PREDICT = "/mlpair.prediction.v1.PredictionService/BatchPredict"
INFER = "/mlpair.inference.v1.InferenceService/Infer"
TARGET_PREDICT_PER_S = 1200
TARGET_PREDICT_P99_MS = 120
TARGET_BATCH_ROWS_PER_S = 20_000


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
           "prediction_outbox_delivered_total", "prediction_outbox_depth", "prediction_outbox_oldest_age_seconds")


def scrape(metrics_ports: list[int]) -> dict[str, float]:
    """PredictionService's figures this bench reads, from the Prometheus endpoint of each replica:
    Infer calls and rows sent so far (``prediction_coalesced_call_rows_count``/``_sum``),
    decisions the relay has delivered to the CRM, and the outbox's depth now (summed over the
    replicas) and its oldest undelivered age (the largest)."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    found = dict.fromkeys(SCRAPED, 0.0)
    for port in metrics_ports:
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "prediction_outbox_oldest_age_seconds":
                    found[sample.name] = max(found[sample.name], sample.value)
                elif sample.name in found:
                    found[sample.name] += sample.value
    return found


def run(args) -> int:
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.prediction.converters import to_attributes

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
        real = {"infer", "predict", "batch"} & set(args.phases)
        outboxes = (["FULL", "NORMAL"] if args.with_normal else ["FULL"]) if real else []
        for synchronous in outboxes:
            metrics_port = harness.free_port()
            p = harness.pair(workdir / synchronous.lower(), root, crm_url=crm,
                             prediction_env={"PREDICTION_OUTBOX_SYNCHRONOUS": synchronous,
                                             "PREDICTION_METRICS_PORT": str(metrics_port),
                                             **dict(e.split("=", 1) for e in args.env)},
                             prediction_replicas=args.prediction_replicas)
            metrics_ports = [int(r.env["PREDICTION_METRICS_PORT"]) for r in p.predictions]
            replicas = [r.address for r in p.predictions]
            with harness.running(p):
                emit({"phase": "started", "outbox_synchronous": synchronous, "prediction_replicas": len(replicas),
                      "startup_s": {k: round(v, 2) for k, v in p.startup_s.items()}})
                cpu = {"inference": p.inference.cpu_seconds,
                       "prediction": lambda: sum(r.cpu_seconds() for r in p.predictions)}
                phases = []
                levels = [1, *args.concurrency]
                if synchronous == "FULL" and "infer" in args.phases:
                    infer, meta = infer_payloads(entry, budget(max(levels), timed))
                    phases += [("direct Infer", c, INFER, infer, check_infer, 1, meta) for c in levels]
                if "predict" in args.phases:
                    phases += [("Predict", c, PREDICT, None, checker.predict, 1, ()) for c in levels]
                if synchronous == "FULL" and "batch" in args.phases:
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
                    line = {"phase": name, "outbox_synchronous": synchronous if method != INFER else None,
                            "concurrency": concurrency, "rows_per_call": rows, **figures}
                    if method != INFER:
                        line["replies_from_cache"] = checker.sources["cache"] - before["cache"]
                        scraped1, phase_s = scrape(metrics_ports), time.monotonic() - phase_started
                        calls = scraped1["prediction_coalesced_call_rows_count"] - scraped0["prediction_coalesced_call_rows_count"]
                        rows_sent = scraped1["prediction_coalesced_call_rows_sum"] - scraped0["prediction_coalesced_call_rows_sum"]
                        line["infer_calls"] = int(calls)  # whole phase, warm-up included
                        line["rows_per_infer_call"] = round(rows_sent / max(1.0, calls), 2)
                        # did the relay keep up? decisions it delivered to the CRM per second over the
                        # whole phase, and what waited in the outbox when the phase ended
                        delivered = scraped1["prediction_outbox_delivered_total"] - scraped0["prediction_outbox_delivered_total"]
                        line["crm_delivered_per_s"] = round(delivered / phase_s, 1)
                        line["outbox_depth_at_end"] = int(scraped1["prediction_outbox_depth"])
                        line["outbox_oldest_age_s_at_end"] = round(scraped1["prediction_outbox_oldest_age_seconds"], 2)
                    emit(line)
                    results.append(line)
            emit({"phase": "stopped", "outbox_synchronous": synchronous,
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
                line = {"phase": name, "outbox_synchronous": None, "concurrency": concurrency, "rows_per_call": rows,
                        **figures}
                emit(line)
                results.append(line)
    return summarise(results, args.concurrency)


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


def summarise(results: list[dict], levels: list[int]) -> int:
    """Prints the table and one summary line (hop latency, targets); returns 1 if any call failed."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="PredictionService end to end (client + both services on this machine)")
    for column in ("phase", "outbox", "conc", "rows/call", "calls/s", "rows/s", "p50 ms", "p99 ms", "errors",
                   "rows/Infer", "outbox at end: rows / oldest s", "CPU % client / prediction / inference / others",
                   "µs CPU per call: client / prediction / inference"):
        table.add_column(column, justify="left" if column in ("phase", "outbox") else "right")
    for r in results:
        cpu, per_call = r.get("cpu_pct", {}), r.get("cpu_ms_per_call", {})
        table.add_row(r["phase"], r["outbox_synchronous"] or "-", str(r["concurrency"]), str(r["rows_per_call"]),
                      f"{r['calls_per_s']:,.0f}", f"{r['rows_per_s']:,.0f}", str(r["p50_ms"]), str(r["p99_ms"]),
                      str(r["errors"]), str(r.get("rows_per_infer_call", "-")),
                      f"{r['outbox_depth_at_end']:,} / {r['outbox_oldest_age_s_at_end']}" if "outbox_depth_at_end" in r else "-",
                      " / ".join(f"{cpu.get(k, 0):.0f}" for k in ("client", "prediction", "inference"))
                      + f" / {r.get('cpu_pct_others', 0):.0f}",
                      " / ".join(f"{1000 * per_call.get(k, 0):,.0f}" for k in ("client", "prediction", "inference")))
    Console(file=sys.stdout, width=200).print(table)

    def find(phase: str, conc: int, sync: str = "FULL") -> dict | None:
        return next((r for r in results if r["phase"] == phase and r["concurrency"] == conc
                     and r["outbox_synchronous"] in (sync, None)), None)

    summary: dict = {"phase": "summary"}
    for conc in [1, *levels]:
        predict, infer = find("Predict", conc), find("direct Infer", conc)
        if predict and infer and predict["p50_ms"] is not None and infer["p50_ms"] is not None:
            summary[f"prediction_hop_added_p50_ms_c{conc}"] = round(predict["p50_ms"] - infer["p50_ms"], 2)
            summary[f"prediction_hop_added_p99_ms_c{conc}"] = round(predict["p99_ms"] - infer["p99_ms"], 2)
    for conc in levels:
        for sync in ("FULL", "NORMAL"):
            if predict := find("Predict", conc, sync):
                suffix = f"c{conc}" + ("_outbox_normal" if sync == "NORMAL" else "")
                summary[f"predict_per_s_{suffix}"] = predict["calls_per_s"]
                summary[f"predict_p99_ms_{suffix}"] = predict["p99_ms"]
                summary[f"predict_target_met_{suffix}"] = (predict["calls_per_s"] >= TARGET_PREDICT_PER_S
                                                           and (predict["p99_ms"] or 1e9) <= TARGET_PREDICT_P99_MS)
    if batch := next((r for r in results if r["phase"] == "BatchPredict"), None):
        summary["batch_rows_per_s"] = batch["rows_per_s"]
        summary["batch_target_met"] = batch["rows_per_s"] >= TARGET_BATCH_ROWS_PER_S
    # the real service as a share of the do-nothing one (bench/null_prediction.py): 1.0 = the floor
    for conc in levels:
        predict, null = find("Predict", conc), find("null Predict", conc)
        if predict and null and null["calls_per_s"]:
            summary[f"predict_share_of_null_c{conc}"] = round(predict["calls_per_s"] / null["calls_per_s"], 2)
    null_batch = next((r for r in results if r["phase"] == "null BatchPredict"), None)
    if batch and null_batch and null_batch["rows_per_s"]:
        summary["batch_share_of_null"] = round(batch["rows_per_s"] / null_batch["rows_per_s"], 2)
    summary["targets"] = {"predict_per_s": TARGET_PREDICT_PER_S, "predict_p99_ms": TARGET_PREDICT_P99_MS,
                          "batch_rows_per_s": TARGET_BATCH_ROWS_PER_S}
    summary["errors"] = sum(r["errors"] for r in results)
    summary["replies_from_cache"] = sum(r.get("replies_from_cache", 0) for r in results)
    emit(summary)
    return 1 if summary["errors"] else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--workdir", default="var/bench-predict", help="outbox, CRM (SQLite case) and logs")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 32],
                        help="Predict / Infer calls in flight (each level is a phase; concurrency 1 always runs)")
    parser.add_argument("--duration-s", type=float, default=15.0, help="measured seconds per phase")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured seconds before each phase")
    parser.add_argument("--c1-seconds", type=float, default=5.0, help="measured seconds of the concurrency-1 phases")
    parser.add_argument("--batch-items", type=int, default=500, help="applicants per BatchPredict call")
    parser.add_argument("--batch-concurrency", type=int, default=4, help="BatchPredict calls in flight")
    parser.add_argument("--batch-rows-budget-per-s", type=int, default=40_000,
                        help="distinct rows prepared per second of the BatchPredict phase (its upper bound)")
    parser.add_argument("--max-calls", type=int, default=100_000, help="upper bound of calls per phase")
    parser.add_argument("--with-normal", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure Predict with the outbox at synchronous=NORMAL")
    parser.add_argument("--env", action="append", default=[], help="extra PREDICTION_*=value for PredictionService")
    parser.add_argument("--prediction-replicas", type=int, default=1,
                        help="PredictionService processes (own port and outbox each, one InferenceService and CRM); "
                             "calls are spread over them round-robin, as a Service over several pods would")
    parser.add_argument("--phases", nargs="+", default=["infer", "predict", "batch", "null"],
                        choices=["infer", "predict", "batch", "null"],
                        help="which phases to run (all by default); null = Predict and BatchPredict against "
                             "bench/null_prediction.py, a do-nothing PredictionService")
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
