"""``make soak``: sustained load and faults through both services, as real processes on loopback.

Both services run as their own processes (``mlpair serve inference`` / ``mlpair serve
prediction``), PredictionService as ``--prediction-replicas`` processes (at least 2, a
round-robin client over them) sharing one decision ledger; the CRM is a throw-away PostgreSQL
database on 127.0.0.1 reached through a TCP proxy this script controls (the ledger is in the same
database, reached directly). Requests are real credit applicants, each a distinct feature row
unless a scenario says otherwise. Scenarios, each on fresh processes:

1. ``sustained`` — Predict at a target rate for a while: zero errors, and the resident
   memory of both processes plateaus (the in-process cache is bounded low so that its bound is
   reached early and eviction is exercised);
2. ``inference-killed`` — ``kill -9`` of InferenceService mid-load, restarted on the same port
   after a few seconds: every Predict is still answered — stale from the cache (half the
   requests repeat an applicant seen seconds before) or by the fallback — and fresh inference
   resumes once it is back;
3. ``prediction-killed`` — ``kill -9`` of one PredictionService replica mid-load, restarted:
   the calls it dropped are retried with the same request ids on any replica, and every
   acknowledged decision is in the CRM exactly once, as answered (the shared ledger is what makes
   this true; reconciliation: 0 lost, 0 duplicated, 0 contradicting);
4. ``sigterm-drain`` — SIGTERM to one PredictionService replica with Predict and BatchPredict
   calls in flight (what it leaves undelivered, the other replicas' relays deliver), then to
   InferenceService with Infer calls in flight: no in-flight call fails and every process exits
   cleanly within its grace period;
5. ``crm-outage`` — the CRM database cut off mid-load, then restored: every Predict is still
   answered, readiness stays SERVING, and every decision reaches the CRM once it is back.

Every scenario is bounded in time and requests, ends only processes it started (by PID), and
checks the CRM at the end: every acknowledged answer equals the CRM row of its request id. One JSON line per scenario, then a summary table; the exit code is
1 if any check failed. ``--short`` scales every phase down (the version ``make test`` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import BadReply, Outcomes, Repeated, drive  # noqa: E402
from tests.support import pair as harness  # noqa: E402

PREDICT = "/mlpair.prediction.v1.PredictionService/Predict"
BATCH_PREDICT = "/mlpair.prediction.v1.PredictionService/BatchPredict"
INFER = "/mlpair.inference.v1.InferenceService/Infer"
MiB = 1024 * 1024
PRESTOP_S = 0.01  # between the last new call and SIGTERM (a stand-in for the preStop pause): what was sent has arrived
RESTART_BOUND_S = 20.0  # longest a restarted service may take to be SERVING on a busy 2-core machine
# A caller's deadline for one Predict: "every call answered" must not hinge on a busy 2-core machine's
# scheduling (a short soak inside the test suite shares it with everything else); p99 is reported anyway
CALL_TIMEOUT_S = 5.0


@dataclass
class Result:
    """One scenario's figures and the checks it failed (none: it passed)."""

    name: str
    figures: dict = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    skipped: str = ""

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.violations.append(message)


@dataclass(frozen=True)
class Timing:
    """Phase lengths in seconds (``--short`` scales them down)."""

    sustained_s: float
    before_fault_s: float
    fault_s: float
    after_fault_s: float

    @classmethod
    def of(cls, short: bool, sustained_s: float) -> Timing:
        return cls(6.0, 1.5, 2.5, 4.5) if short else cls(sustained_s, 5.0, 6.0, 10.0)


def classify(key: str, raw: bytes) -> tuple[str, str, float, str, float]:
    """A Predict reply → (decision id, where it came from, when it arrived, decision,
    probability); raises BadReply."""
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb

    r = pb.PredictResponse.FromString(raw)
    if not r.decision_id or not r.decision_label:
        raise BadReply("no decision")
    source = "fallback" if r.fallback else "stale" if r.stale else "cache" if r.from_cache else "inference"
    return r.decision_id, source, time.monotonic(), r.decision_label, r.probability


Answer = tuple[str, str, float]  # (decision id, decision, probability) as a caller got it, or the CRM holds it


def classify_batch(key: str, raw: bytes) -> dict[str, Answer]:
    """A BatchPredict reply → request id → (decision id, decision, probability) of every item;
    raises BadReply."""
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb

    reply = pb.BatchPredictResponse.FromString(raw)
    decided = {}
    for result in reply.results:
        r = result.prediction
        if result.WhichOneof("outcome") != "prediction" or not r.decision_id:
            raise BadReply("an item without a decision")
        decided[r.request_id] = (r.decision_id, r.decision_label, r.probability)
    return decided


class Soak:
    """Shared set-up of the scenarios: model, workload, CRM database and its proxy."""

    def __init__(self, args, entry, crm_url: str, proxy: harness.TcpProxy | None) -> None:
        from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
        from mlpair.client import to_attributes

        self.args = args
        self.entry = entry
        self.crm_url = crm_url  # what the services use (through the proxy when there is one)
        self.direct_crm_url = args.crm_direct_url or crm_url  # what reconciliation reads
        # the shared ledger: in the CRM's PostgreSQL database, reached directly (a CRM outage is not a
        # ledger outage); without PostgreSQL, a SQLite file in each scenario's folder
        self.ledger_url = args.crm_direct_url
        self.proxy = proxy
        self.timing = Timing.of(args.short, args.sustained_s)
        self.run_id = f"soak-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self.workdir = Path(args.workdir).resolve() / self.run_id
        self.rows = harness.credit_workload(entry, self.run_id)
        self.pb, self.to_attributes = pb, to_attributes

    # -- building blocks ---------------------------------------------------------------------

    def pair(self, name: str, prediction_env: dict | None = None) -> harness.Pair:
        return harness.pair(self.workdir / name, Path(self.args.model_repository).resolve(), crm_url=self.crm_url,
                            ledger_url=self.ledger_url, prediction_replicas=self.args.prediction_replicas,
                            prediction_env={"PREDICTION_HEALTH_INTERVAL_MS": "500", **(prediction_env or {})})

    @staticmethod
    def addresses(p: harness.Pair) -> list[str]:
        """Every PredictionService replica (the load goes round robin over them)."""
        return [replica.address for replica in p.predictions]

    def predicts(self, prefix: str, n: int, *, repeat_lag: int = 0) -> list[tuple[str, bytes]]:
        """``n`` Predict requests with ids ``<prefix>-<k>``; with ``repeat_lag``, every odd
        request repeats the applicant of request ``k - repeat_lag`` (a new request id)."""
        attributes: list[dict] = []
        out = []
        for k in range(n):
            if repeat_lag and k % 2 and k >= repeat_lag:
                attrs = attributes[k - repeat_lag]
            else:
                _, _, attrs = next(self.rows)
            attributes.append(attrs)
            rid = f"{prefix}-{k}"
            out.append((rid, self.pb.PredictRequest(request_id=rid, entity_id=f"e{k}", model_name=harness.MODEL,
                                                    attributes=self.to_attributes(attrs)).SerializeToString()))
        return out

    def batches(self, prefix: str, calls: int, items: int) -> list[tuple[str, bytes]]:
        out = []
        for c in range(calls):
            requests = [self.pb.PredictRequest(request_id=f"{prefix}-{c}-{i}", entity_id=f"e{i}", model_name=harness.MODEL,
                                               attributes=self.to_attributes(attrs))
                        for i, (_, _, attrs) in enumerate(itertools.islice(self.rows, items))]
            out.append((f"{prefix}-{c}", self.pb.BatchPredictRequest(requests=requests).SerializeToString()))
        return out

    async def crm_rows(self, prefix: str) -> dict[str, list[Answer]]:
        """request id → the decisions the CRM holds for it (one, if all is well)."""
        from sqlalchemy import select

        from mlpair.prediction.recording.models import DecisionRecord
        from mlpair.prediction.recording.store import make_engine

        engine = make_engine(self.direct_crm_url, timeout_s=10)
        try:
            async with engine.connect() as conn:
                rows = (await conn.execute(select(DecisionRecord.request_id, DecisionRecord.decision_id,
                                                  DecisionRecord.decision, DecisionRecord.probability)
                                           .where(DecisionRecord.request_id.like(f"{prefix}-%")))).all()
        finally:
            await engine.dispose()
        out: dict[str, list[Answer]] = {}
        for request_id, decision_id, decision, probability in rows:
            out.setdefault(request_id, []).append((decision_id, decision, probability or 0.0))
        return out

    async def reconcile(self, result: Result, prefix: str, acknowledged: dict[str, Answer], *,
                        wait_s: float = 60.0) -> None:
        """Waits for the acknowledged decisions to reach the CRM, then counts lost, duplicated and
        contradicting (an answer whose decision id, decision or probability differs from the CRM row)."""
        started = time.monotonic()
        while True:
            crm = await self.crm_rows(prefix)
            lost = [rid for rid in acknowledged if rid not in crm]
            if not lost or time.monotonic() - started > wait_s:
                break
            await asyncio.sleep(0.5)
        duplicated = sum(len(rows) - 1 for rows in crm.values())
        contradicting = sum(1 for rid, answer in acknowledged.items() if rid in crm and crm[rid] != [answer])
        result.figures.update({"acknowledged": len(acknowledged), "crm_rows": sum(len(v) for v in crm.values()),
                               "lost": len(lost), "duplicated": duplicated, "contradicting": contradicting})
        result.check(not lost, f"{len(lost)} acknowledged decision(s) missing from the CRM")
        result.check(duplicated == 0, f"{duplicated} duplicated CRM row(s)")
        result.check(contradicting == 0, f"{contradicting} answer(s) that differ from the CRM row of their request id")

    @staticmethod
    def decisions(outcomes: Outcomes) -> dict[str, Answer]:
        """request id → (decision id, decision, probability) of every acknowledged Predict."""
        return {key: (value[0], value[3], value[4]) for key, value in outcomes.acknowledged.items()}

    @staticmethod
    async def at(t0: float, seconds: float) -> None:
        await asyncio.sleep(max(0.0, t0 + seconds - time.monotonic()))

    @staticmethod
    def stopped(result: Result, p: harness.Pair, codes: dict[str, int]) -> None:
        result.figures["exit_codes"] = codes
        result.check(all(code == 0 for code in codes.values()), f"unclean exit: {codes}")

    # -- scenarios ---------------------------------------------------------------------------

    async def sustained(self) -> Result:
        result = Result("sustained")
        rate, seconds = self.args.rate, self.timing.sustained_s
        p = self.pair("sustained", {"PREDICTION_CACHE_MAX_ENTRIES": "2000"})
        await asyncio.to_thread(p.start)
        samples: list[tuple[float, ...]] = []  # (seconds, InferenceService RSS, each replica's RSS)
        done = asyncio.Event()

        async def sample() -> None:
            t0 = time.monotonic()
            while not done.is_set():
                samples.append((time.monotonic() - t0, p.inference.rss_bytes(), *(r.rss_bytes() for r in p.predictions)))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await done.wait()

        sampler = asyncio.create_task(sample())
        outcomes = Outcomes()
        try:
            figures = await drive(self.addresses(p), PREDICT, self.predicts(f"{self.run_id}-sustained", int(rate * seconds)),
                                  check=classify, concurrency=64, rate_per_s=rate, duration_s=seconds, timeout_s=CALL_TIMEOUT_S,
                                  outcomes=outcomes, cpu_of={"inference": p.inference.cpu_seconds,
                                                             **{f"prediction-{k + 1}": r.cpu_seconds
                                                                for k, r in enumerate(p.predictions)}})
        finally:
            done.set()
            await sampler
            self.stopped(result, p, await asyncio.to_thread(p.stop))
        result.figures.update({"target_per_s": rate, "seconds": seconds, "achieved_per_s": figures["calls_per_s"],
                               "p50_ms": figures["p50_ms"], "p99_ms": figures["p99_ms"], "errors": figures["errors"],
                               "cpu_pct": figures.get("cpu_pct"), "cpu_pct_others": figures.get("cpu_pct_others")})
        result.check(figures["errors"] == 0, f"{figures['errors']} failed call(s): {figures.get('error_codes')}")
        result.check(figures["calls_per_s"] >= 0.95 * rate, f"rate {figures['calls_per_s']}/s below 95% of {rate}/s")
        for index, name in ((1, "inference"), *((2 + k, f"prediction-{k + 1}") for k in range(len(p.predictions)))):
            growth, start, end = memory_growth(samples, index)
            result.figures[f"rss_{name}_mib"] = {"start": round(start / MiB, 1), "end": round(end / MiB, 1),
                                                 "growth_second_half": round(growth / MiB, 1)}
            # plateau: the median RSS of the last quarter is within a small margin of the middle's
            result.check(growth <= max(8 * MiB, 0.03 * start),
                         f"{name} memory still growing: +{growth / MiB:.1f} MiB in the second half")
        await self.reconcile(result, f"{self.run_id}-sustained", self.decisions(outcomes))
        return result

    async def inference_killed(self) -> Result:
        result = Result("inference-killed")
        t, rate = self.timing, self.args.fault_rate
        bound_s = t.before_fault_s + t.fault_s + RESTART_BOUND_S + t.after_fault_s
        # entries older than 1 s are stale: half the requests repeat an applicant seen 2 s before
        p = self.pair("inference-killed", {"PREDICTION_CACHE_FRESH_TTL_S": "1"})
        await asyncio.to_thread(p.start)
        outcomes, done = Outcomes(), asyncio.Event()
        marks: dict[str, float] = {}

        async def fault(t0: float) -> None:
            try:
                await self.at(t0, t.before_fault_s)
                marks["killed"] = time.monotonic()
                await asyncio.to_thread(p.inference.kill)
                await self.at(t0, t.before_fault_s + t.fault_s)
                await asyncio.to_thread(p.inference.start)
                marks["serving"] = time.monotonic()
                await asyncio.sleep(t.after_fault_s)  # load goes on after the recovery
            finally:
                done.set()

        t0 = time.monotonic()
        try:
            figures, _ = await asyncio.gather(
                drive(self.addresses(p), PREDICT, self.predicts(f"{self.run_id}-inference-killed",
                                                                   int(rate * bound_s), repeat_lag=int(2 * rate)),
                      check=classify, concurrency=64, rate_per_s=rate, duration_s=bound_s, timeout_s=CALL_TIMEOUT_S,
                      outcomes=outcomes, stop=done),
                fault(t0))
        finally:
            self.stopped(result, p, await asyncio.to_thread(p.stop))
        replies = outcomes.acknowledged
        during = [v[1] for k, v in replies.items() if marks["killed"] <= outcomes.started[k] < marks["serving"]]
        settled = marks["serving"] + 3.0  # breaker open 2 s, then a probe; the channel reconnects within 1 s
        after = [v[1] for k, v in replies.items() if outcomes.started[k] >= settled]
        first_fresh = min((outcomes.started[k] for k, v in replies.items()
                           if outcomes.started[k] >= marks["serving"] and v[1] == "inference"), default=None)
        result.figures.update({
            "rate_per_s": rate, "calls": len(replies) + len(outcomes.failed), "errors": figures["errors"],
            "p99_ms": figures["p99_ms"], "down_s": round(marks["serving"] - marks["killed"], 2),
            "while_down": count(during), "after_recovery": count(after),
            "fresh_again_after_s": None if first_fresh is None else round(first_fresh - marks["serving"], 2)})
        result.check(not outcomes.failed, f"{len(outcomes.failed)} Predict call(s) failed: "
                                          f"{sorted(set(outcomes.failed.values()))}")
        result.check(during.count("stale") > 0, "no stale result served while InferenceService was down")
        result.check(during.count("fallback") > 0, "no fallback decision while InferenceService was down")
        result.check(bool(after) and all(s in ("inference", "cache") for s in after),
                     f"not recovered 3 s after InferenceService returned: {count(after)}")
        await self.reconcile(result, f"{self.run_id}-inference-killed", self.decisions(outcomes))
        return result

    async def prediction_killed(self) -> Result:
        result = Result("prediction-killed")
        t, rate = self.timing, self.args.fault_rate
        bound_s = t.before_fault_s + 1.0 + RESTART_BOUND_S + t.after_fault_s
        prefix = f"{self.run_id}-prediction-killed"
        p = self.pair("prediction-killed")
        await asyncio.to_thread(p.start)
        payloads = self.predicts(prefix, int(rate * bound_s))
        # a burst of BatchPredict calls to the replica about to be killed, just before the kill, so
        # that some decisions are committed to the ledger but their answer never leaves the process
        burst_payloads = self.batches(f"{prefix}-burst", 3, 300)
        outcomes, burst, done = Outcomes(), Outcomes(), asyncio.Event()
        marks: dict[str, float] = {}

        async def fault(t0: float) -> None:
            try:
                await self.at(t0, t.before_fault_s)
                burst_calls = asyncio.create_task(drive(  # sent 60 ms apart, the last 30 ms before the kill
                    p.prediction.address, BATCH_PREDICT, burst_payloads, check=classify_batch, concurrency=3,
                    rate_per_s=1 / 0.06, duration_s=30, timeout_s=10.0, outcomes=burst))
                await asyncio.sleep(0.15)
                marks["in_flight_at_kill"] = outcomes.in_flight + burst.in_flight
                await asyncio.to_thread(p.prediction.kill)
                await burst_calls
                await asyncio.sleep(1.0)
                marks["restart_s"] = await asyncio.to_thread(p.prediction.start)
                await asyncio.sleep(t.after_fault_s)
            finally:
                done.set()

        t0 = time.monotonic()
        try:
            figures, _ = await asyncio.gather(
                drive(self.addresses(p), PREDICT, payloads, check=classify, concurrency=64, rate_per_s=rate,
                      duration_s=bound_s, timeout_s=CALL_TIMEOUT_S, outcomes=outcomes, stop=done),
                fault(t0))
            acknowledged = self.decisions(outcomes)
            for items in burst.acknowledged.values():
                acknowledged.update(items)
            failed = set(outcomes.failed)
            failed_items = {f"{key}-{i}" for key in burst.failed for i in range(300)}
            # what the shared ledger holds of what the client never heard back about
            committed = await ledger_has(p.ledger_url, sorted(failed | failed_items))
            # a client retries what failed with the same request ids, on any replica, as the API asks it to
            retries, burst_retries = Outcomes(), Outcomes()
            for _ in range(5):
                todo = [(k, v) for k, v in payloads if k in failed and k not in retries.acknowledged]
                todo_burst = [(k, v) for k, v in burst_payloads if k in burst.failed and k not in burst_retries.acknowledged]
                if not todo and not todo_burst:
                    break
                if todo:
                    await drive(self.addresses(p), PREDICT, todo, check=classify, concurrency=16, duration_s=60,
                                timeout_s=5.0, outcomes=retries)
                if todo_burst:
                    await drive(self.addresses(p), BATCH_PREDICT, todo_burst, check=classify_batch, concurrency=3,
                                duration_s=60, timeout_s=10.0, outcomes=burst_retries)
            retried = self.decisions(retries)
            for items in burst_retries.acknowledged.values():
                retried.update(items)
        finally:
            self.stopped(result, p, await asyncio.to_thread(p.stop))
        never = (failed | failed_items) - set(retried)
        # a retry of a request id committed before the kill must get that recorded decision back
        replayed_differently = [k for k, recorded in committed.items() if k in retried and retried[k] != recorded]
        acknowledged.update(retried)
        result.figures.update({
            "rate_per_s": rate, "sent": len(outcomes.started) + 300 * len(burst.started), "p99_ms": figures["p99_ms"],
            "in_flight_at_kill": marks.get("in_flight_at_kill"), "failed_while_down": len(failed | failed_items),
            "committed_but_unanswered": len(committed), "restart_to_serving_s": round(marks["restart_s"], 2),
            "retried_ok": len(set(retried) & (failed | failed_items)), "never_acknowledged": len(never),
            "replayed_differently": len(replayed_differently)})
        result.check(bool(failed), "no call failed: PredictionService was not killed mid-load")
        result.check(not never, f"{len(never)} request(s) never acknowledged after retries")
        result.check(not replayed_differently,
                     f"{len(replayed_differently)} retried request id(s) got another decision than the one recorded")
        await self.reconcile(result, prefix, acknowledged)
        return result

    async def sigterm_drain(self) -> Result:
        result = Result("sigterm-drain")
        prefix = f"{self.run_id}-sigterm"
        p = self.pair("sigterm-drain", {"PREDICTION_SHUTDOWN_GRACE_S": "20"})
        p.inference.env["INFERENCE_SHUTDOWN_GRACE_S"] = "20"
        await asyncio.to_thread(p.start)
        acknowledged: dict[str, Answer] = {}
        try:
            # one PredictionService replica: Predict and BatchPredict calls in flight when SIGTERM arrives
            predicts, batches = Outcomes(), Outcomes()
            await self.terminate_under_load(result, "prediction", p.prediction, [
                (PREDICT, self.predicts(prefix, int(1500 * self.timing.before_fault_s)), classify, 48, predicts, ()),
                (BATCH_PREDICT, self.batches(f"{prefix}-batch", 100, 500), classify_batch, 4, batches, ())])
            acknowledged.update(self.decisions(predicts))
            for items in batches.acknowledged.values():
                acknowledged.update(items)
            # InferenceService: Infer calls of 8,192 rows (its max_request_rows; two fill its queue
            # bound exactly), 16 distinct payloads sent over and over until the signal itself: one
            # takes only a few ms here, so any pause before SIGTERM would let every call finish
            large, metadata = infer_payloads(self.entry, 16, rows=8192)
            await self.terminate_under_load(result, "inference", p.inference, [
                (INFER, Repeated(large, 20_000), check_infer, 2, Outcomes(), metadata)], prestop_s=0.0)
            # what the drained replica had not delivered when it exited, the others' relays deliver:
            # a replica that goes away strands nothing
            await self.reconcile(result, prefix, acknowledged)
            codes = {f"prediction-{k + 2}": await asyncio.to_thread(r.terminate) for k, r in enumerate(p.more_predictions)}
            result.figures["other_replicas_exit"] = codes
            result.check(all(code == 0 for code in codes.values()), f"unclean exit of the other replicas: {codes}")
        finally:
            p.kill()  # only if something above failed: every process is normally gone by now
        return result

    async def terminate_under_load(self, result: Result, name: str, service: harness.Service, loads: list,
                                   prestop_s: float = PRESTOP_S) -> None:
        """Sends SIGTERM to ``service`` while ``loads`` (method, payloads, check, concurrency,
        outcomes, metadata) keep calls in flight; checks that every call sent before the signal
        succeeds and that the process exits by itself with 0. New calls stop ``prestop_s``
        before the signal."""
        freeze = asyncio.Event()
        marks: dict[str, float] = {}
        seconds = self.timing.before_fault_s + 60

        async def signal_later() -> None:
            await asyncio.sleep(self.timing.before_fault_s)
            freeze.set()  # no new call from here on: the load balancer has moved on (the preStop pause)
            await asyncio.sleep(prestop_s)
            marks["sigterm"] = time.monotonic()
            service.process.send_signal(signal.SIGTERM)

        await asyncio.gather(*(drive(service.address, method, payloads, check=check, concurrency=concurrency,
                                     duration_s=seconds, timeout_s=30.0, outcomes=outcomes, stop=freeze,
                                     metadata=metadata) for method, payloads, check, concurrency, outcomes, metadata in loads),
                             signal_later())
        code = await asyncio.to_thread(service.wait_exit, 60.0)
        failed: dict[str, str] = {}
        for *_, outcomes, _ in loads:
            failed.update(outcomes.failed)
        in_flight = sum(outcomes.in_flight_at(marks["sigterm"]) for *_, outcomes, _ in loads)
        result.figures[f"{name}_in_flight_at_sigterm"] = in_flight
        result.figures[f"{name}_calls"] = sum(len(outcomes.started) for *_, outcomes, _ in loads)
        result.figures[f"{name}_failed"] = len(failed)
        result.figures[f"{name}_exit"] = {"code": code, "after_s": round(time.monotonic() - marks["sigterm"], 2)}
        result.check(code == 0, f"{name} exit code {code} after SIGTERM")
        result.check(not failed, f"{len(failed)} {name} call(s) sent before SIGTERM failed: {sorted(set(failed.values()))}")
        result.check(in_flight > 0, f"no {name} call was in flight at SIGTERM: the drain was not exercised")

    async def crm_outage(self) -> Result:
        result = Result("crm-outage")
        if self.proxy is None:
            result.skipped = "PostgreSQL is not reachable at 127.0.0.1:5432"
            if os.environ.get("CI") == "true":
                result.violations.append(result.skipped)
            return result
        t, rate = self.timing, self.args.fault_rate
        total_s = t.before_fault_s + t.fault_s + t.after_fault_s
        prefix = f"{self.run_id}-crm-outage"
        metrics_port = harness.free_port()
        p = self.pair("crm-outage", {"PREDICTION_METRICS_PORT": str(metrics_port), "PREDICTION_CRM_TIMEOUT_MS": "1000",
                                     "PREDICTION_RELAY_BACKOFF_MAX_MS": "500"})
        await asyncio.to_thread(p.start)
        outcomes = Outcomes()
        marks: dict[str, float] = {}
        readiness: list[int] = []
        backlog: list[float] = []

        async def fault(t0: float) -> None:
            await self.at(t0, t.before_fault_s)
            await self.proxy.cut()
            marks["cut"] = time.monotonic()
            while time.monotonic() < t0 + t.before_fault_s + t.fault_s:
                readiness.extend([await health(address, "") for address in self.addresses(p)])
                backlog.append(await asyncio.to_thread(gauge, metrics_port, "prediction_outbox_depth"))
                await asyncio.sleep(0.5)
            await self.proxy.restore()
            marks["restored"] = time.monotonic()
            # the relay catches up while new decisions keep coming: when is the backlog back to
            # what steady delivery leaves (a few relay lingers' worth)?
            steady = max(20.0, rate * 0.5)
            while time.monotonic() < t0 + t.before_fault_s + t.fault_s + t.after_fault_s:
                if await asyncio.to_thread(gauge, metrics_port, "prediction_outbox_depth") <= steady:
                    marks["caught_up"] = time.monotonic()
                    break
                await asyncio.sleep(0.25)

        t0 = time.monotonic()
        try:
            figures, _ = await asyncio.gather(
                drive(self.addresses(p), PREDICT, self.predicts(prefix, int(rate * total_s)), check=classify,
                      concurrency=64, rate_per_s=rate, duration_s=total_s, timeout_s=CALL_TIMEOUT_S, outcomes=outcomes),
                fault(t0))
            await self.reconcile(result, prefix, self.decisions(outcomes))
            result.figures["backlog_cleared_after_s"] = (round(marks["caught_up"] - marks["restored"], 2)
                                                         if "caught_up" in marks else None)
        finally:
            if "restored" not in marks:
                await self.proxy.restore()
            self.stopped(result, p, await asyncio.to_thread(p.stop))
        from grpc_health.v1 import health_pb2

        result.figures.update({"rate_per_s": rate, "errors": figures["errors"], "p99_ms": figures["p99_ms"],
                               "outage_s": round(marks["restored"] - marks["cut"], 2),
                               "max_ledger_backlog": int(max(backlog, default=0)),
                               "ready_during_outage": f"{readiness.count(health_pb2.HealthCheckResponse.SERVING)}"
                                                      f"/{len(readiness)} checks"})
        result.check(not outcomes.failed, f"{len(outcomes.failed)} Predict call(s) failed during the CRM outage")
        result.check(bool(readiness) and all(s == health_pb2.HealthCheckResponse.SERVING for s in readiness),
                     "readiness left SERVING while only the CRM was down")
        result.check(max(backlog, default=0) > 0, "no decision waited in the ledger: the outage did not bite")
        return result


def memory_growth(samples: list[tuple[float, int, int]], index: int) -> tuple[float, int, int]:
    """(growth in bytes between the medians of the third and fourth quarters of the run, first
    sample after warm-up, last sample) for column ``index``."""
    values = [s[index] for s in samples if s[index]]
    if len(values) < 8:
        return 0.0, values[0] if values else 0, values[-1] if values else 0
    quarter = len(values) // 4
    third, fourth = values[2 * quarter:3 * quarter], values[3 * quarter:]
    return statistics.median(fourth) - statistics.median(third), values[quarter], values[-1]


def count(sources: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in sources:
        out[s] = out.get(s, 0) + 1
    return out


async def ledger_has(ledger_url: str, request_ids: list[str]) -> dict[str, Answer]:
    """request id → (decision id, decision, probability), for those of ``request_ids`` the shared
    ledger holds."""
    from mlpair.prediction.recording.ledger import open_ledger

    ledger = open_ledger(ledger_url)
    await ledger.open()
    try:
        found = {}
        for rid in request_ids:
            if (recorded := await ledger.find(rid)) is not None:
                d = recorded.decision
                found[rid] = (d.decision_id, d.decision, d.probability or 0.0)
        return found
    finally:
        await ledger.close()


async def health(address: str, service: str) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                   timeout=2)
        except grpc.RpcError:
            return -1
    return reply.status


def gauge(metrics_port: int, name: str) -> float:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as reply:
        for family in text_string_to_metric_families(reply.read().decode()):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
    return 0.0


def infer_payloads(entry, n: int, rows: int = 1):
    from bench.predict_load import infer_payloads as build

    return build(entry, n, rows)


def check_infer(key: str, raw: bytes) -> None:
    from bench.predict_load import check_infer as check

    return check(key, raw)


SCENARIOS = {"sustained": Soak.sustained, "inference-killed": Soak.inference_killed,
             "prediction-killed": Soak.prediction_killed, "sigterm-drain": Soak.sigterm_drain,
             "crm-outage": Soak.crm_outage}


async def run(args, entry, crm_url: str | None) -> list[Result]:
    proxy = None
    services_url = crm_url
    if crm_url is not None:
        from sqlalchemy import make_url

        url = make_url(crm_url)
        proxy = harness.TcpProxy(url.host or "127.0.0.1", url.port or 5432)
        await proxy.start()
        services_url = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        args.crm_direct_url = crm_url
    else:
        args.crm_direct_url = None
    soak = Soak(args, entry, services_url or "", proxy)
    if crm_url is None:
        soak.crm_url = soak.direct_crm_url = f"sqlite+aiosqlite:///{soak.workdir / 'crm.sqlite'}"
    results = []
    try:
        for name in args.scenarios:
            started = time.monotonic()
            try:
                result = await SCENARIOS[name](soak)
            except Exception as exc:  # noqa: BLE001  (a scenario that could not run is a failed check, with the reason)
                result = Result(name, violations=[f"scenario aborted: {type(exc).__name__}: {exc}"])
            result.figures["wall_s"] = round(time.monotonic() - started, 1)
            print(json.dumps({"scenario": result.name, "ok": not result.violations, "skipped": result.skipped or None,
                              **result.figures, "violations": result.violations}), flush=True)
            results.append(result)
    finally:
        if proxy is not None:
            await proxy.cut()
    return results


def summarise(results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="make soak: both services as processes, loopback only")
    for column in ("scenario", "result", "figures", "violations"):
        table.add_column(column)
    keys = {"sustained": ("achieved_per_s", "p99_ms", "errors", "rss_inference_mib", "rss_prediction-1_mib", "rss_prediction-2_mib", "lost",
                          "duplicated", "contradicting"),
            "inference-killed": ("down_s", "while_down", "after_recovery", "fresh_again_after_s", "errors", "lost",
                                 "duplicated", "contradicting"),
            "prediction-killed": ("in_flight_at_kill", "failed_while_down", "committed_but_unanswered", "retried_ok",
                                  "never_acknowledged", "replayed_differently", "lost", "duplicated", "contradicting"),
            "sigterm-drain": ("prediction_in_flight_at_sigterm", "prediction_failed", "prediction_exit",
                              "inference_in_flight_at_sigterm", "inference_failed", "inference_exit", "lost",
                              "duplicated", "contradicting"),
            "crm-outage": ("outage_s", "errors", "max_ledger_backlog", "ready_during_outage",
                           "backlog_cleared_after_s", "lost", "duplicated", "contradicting")}
    for r in results:
        figures = "\n".join(f"{k}: {r.figures[k]}" for k in keys.get(r.name, ()) if k in r.figures)
        table.add_row(r.name, "skipped" if r.skipped and not r.violations else "FAIL" if r.violations else "ok",
                      figures or r.skipped, "\n".join(r.violations) or "-")
    Console(file=sys.stdout, width=180).print(table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--workdir", default="var/soak", help="service logs (and SQLite ledgers without PostgreSQL)")
    parser.add_argument("--prediction-replicas", type=int, default=2,
                        help="PredictionService processes sharing the ledger, round robin (at least 2)")
    parser.add_argument("--short", action="store_true", help="every phase scaled down (the make test version)")
    parser.add_argument("--rate", type=float, default=300.0, help="Predict calls/s of the sustained scenario")
    parser.add_argument("--fault-rate", type=float, default=150.0, help="Predict calls/s during the fault scenarios")
    parser.add_argument("--sustained-s", type=float, default=180.0, help="length of the sustained scenario")
    parser.add_argument("--postgres-url", default=None,
                        help="CRM database (postgresql+asyncpg://…, 127.0.0.1 only); default a throw-away one")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = parser.parse_args(argv)
    if args.short:
        args.rate, args.fault_rate = min(args.rate, 100.0), min(args.fault_rate, 100.0)
    if args.rate <= 0 or args.fault_rate <= 0 or not 0 < args.sustained_s <= 600:
        parser.error("need positive rates and 0 < sustained-s <= 600")
    if not 2 <= args.prediction_replicas <= 10:
        parser.error("--prediction-replicas: 2 to 10 (every promise is about several replicas)")
    if args.postgres_url and "127.0.0.1" not in args.postgres_url and "localhost" not in args.postgres_url:
        parser.error("the CRM database must be on 127.0.0.1")
    return args


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    entry = harness.trained_model(Path(args.model_repository).resolve())
    print(json.dumps({"soak": "setup", **harness.machine(), "short": args.short, "scenarios": args.scenarios}), flush=True)
    started = time.monotonic()
    if args.postgres_url:
        results = asyncio.run(run(args, entry, args.postgres_url))
    else:
        with harness.scratch_postgres() as url:
            results = asyncio.run(run(args, entry, url))
    summarise(results)
    failed = [r.name for r in results if r.violations]
    print(json.dumps({"soak": "summary", "scenarios": len(results), "failed": failed,
                      "wall_s": round(time.monotonic() - started, 1)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
