"""Resident memory of PredictionService under calls that end DEADLINE_EXCEEDED or are cancelled.

Issue 36 C52: such calls must leave nothing behind. Both services run as real processes on
loopback (:func:`tests.support.pair.pair`: InferenceService, one PredictionService process with the
in-process cache); one client process sends Predict calls of real credit applicants (each a
distinct feature row and request id), ``--concurrency`` at a time, alternately:

* **expired** — a deadline of ``--deadline-ms``, shorter than the server takes under this load,
  so the call ends DEADLINE_EXCEEDED (some before the server reads it, some while it works);
* **cancelled** — no tight deadline, cancelled by the client ``--cancel-after-ms`` after it was sent.

Every ``--report-every`` calls the client pauses ``--settle-s`` (the server finishes what it
had), then samples the server's resident set size (RSS) and prints one JSON line. The summary
line gives the series and the growth in bytes per call from the second sample to the last
(the first interval includes warm-up: imports, the cache filling, gRPC's pools).

``--guard-request-reads off`` runs the server without :func:`mlpair.rpc.guard_request_reads`
(``PREDICTION_GUARD_REQUEST_READS=false``), to measure what it prevents. ``--target HOST:PORT``
skips the services and only sends the calls to a PredictionService already running (the suite's
C52 test measures its own server's heap that way); it prints the outcome counts.

    nice .venv/bin/python bench/soak_cancelled.py --calls 500000 --report-every 50000

Bounded: at most ``--calls`` calls (≤ 1,000,000), loopback only; ends only the processes it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from tests.support import pair as harness  # noqa: E402

PREDICT = "/mlpair.prediction.v1.PredictionService/Predict"
MAX_CALLS = 1_000_000
ID_SLOT = b"#" * 24  # the request id's place in each serialised request, filled per call


def payloads(count: int) -> list[bytes]:
    """``count`` serialised PredictRequests of distinct real applicants, each with a placeholder
    request id of 24 bytes that :func:`send` replaces."""
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.client.prediction import to_attributes

    entry = harness.trained_model(harness.REPO / "var" / "models")
    out: list[bytes] = []
    for _, entity_id, attributes in harness.credit_workload(entry, "c52"):
        request = pb.PredictRequest(request_id=ID_SLOT.decode(), entity_id=entity_id, model_name=harness.MODEL,
                                    attributes=to_attributes(attributes))
        out.append(request.SerializeToString())
        if len(out) == count:
            return out
    return out


async def send(target: str, calls: int, *, concurrency: int, deadline_s: float, cancel_after_s: float,
               report_every: int = 0, on_report=None, settle_s: float = 1.0, first_id: int = 0) -> Counter:
    """Sends ``calls`` Predict calls to ``target``, even ones with a deadline of ``deadline_s``,
    odd ones cancelled ``cancel_after_s`` after they were sent (with a 10 s deadline).

    Every ``report_every`` calls (0 = never) the workers pause, wait ``settle_s`` and await
    ``on_report(calls_so_far, counts)``.

    Returns:
        Outcome counts: a status code name, ``CANCELLED_BY_CLIENT`` for a call this client
        cancelled before it was answered, or ``OK``; they add up to ``calls``.

    Raises:
        ValueError: ``target`` is not on loopback, or ``calls`` is out of bounds.
    """
    if not target.startswith(("127.", "localhost:")):
        raise ValueError(f"refusing non-loopback target {target!r}")
    if not 0 < calls <= MAX_CALLS:
        raise ValueError(f"calls must be in 1..{MAX_CALLS}")
    bodies = payloads(min(calls, 4000))
    counts: Counter = Counter()
    sent = 0
    resume = asyncio.Event()
    resume.set()
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(PREDICT)  # bytes in, bytes out

        async def worker() -> None:
            nonlocal sent
            while sent < calls:
                await resume.wait()
                if sent >= calls:
                    return
                i = sent
                sent += 1
                report = report_every and (i + 1) % report_every == 0
                if report:
                    resume.clear()
                body = bodies[i % len(bodies)].replace(ID_SLOT, b"c52-%020d" % (first_id + i))
                try:
                    if i % 2:
                        pending = call(body, timeout=10)
                        await asyncio.sleep(cancel_after_s)
                        pending.cancel()
                        await pending
                    else:
                        await call(body, timeout=deadline_s)
                    counts["OK"] += 1
                except asyncio.CancelledError:
                    counts["CANCELLED_BY_CLIENT"] += 1
                except grpc.RpcError as exc:
                    counts[exc.code().name] += 1
                if report:
                    while sum(counts.values()) < i + 1:  # the other workers' calls end first
                        await asyncio.sleep(0.01)
                    await asyncio.sleep(settle_s)
                    if on_report is not None:
                        await on_report(i + 1, counts)
                    resume.set()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


def soak(args: argparse.Namespace) -> dict:
    """Starts the pair, sends the calls, samples PredictionService's RSS; returns the summary."""
    env = {"PREDICTION_CACHE_BACKEND": "memory",
           "PREDICTION_GUARD_REQUEST_READS": "true" if args.guard_request_reads == "on" else "false"}
    series: list[tuple[int, int]] = []
    with tempfile.TemporaryDirectory(prefix="soak-cancelled-") as folder:
        pair = harness.pair(Path(folder), harness.REPO / "var" / "models", prediction_env=env)
        with harness.running(pair):
            service = pair.prediction
            series.append((0, service.rss_bytes()))
            print(json.dumps({"calls": 0, "rss_mib": round(series[-1][1] / 2**20, 2)}), flush=True)

            async def report(done: int, counts: Counter) -> None:
                series.append((done, service.rss_bytes()))
                print(json.dumps({"calls": done, "rss_mib": round(series[-1][1] / 2**20, 2),
                                  "outcomes": dict(counts)}), flush=True)

            started = time.monotonic()
            counts = asyncio.run(send(service.address, args.calls, concurrency=args.concurrency,
                                      deadline_s=args.deadline_ms / 1000, cancel_after_s=args.cancel_after_ms / 1000,
                                      report_every=args.report_every, on_report=report, settle_s=args.settle_s))
            elapsed = time.monotonic() - started
            alive = service.alive()
    (c1, r1), (cn, rn) = series[min(1, len(series) - 1)], series[-1]
    return {"summary": True, "guard_request_reads": args.guard_request_reads, "calls": args.calls,
            "outcomes": dict(counts), "seconds": round(elapsed, 1), "server_alive": alive,
            "rss_mib": [[c, round(r / 2**20, 2)] for c, r in series],
            "growth_bytes_per_call_after_first_report": round((rn - r1) / (cn - c1), 1) if cn > c1 else None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500_000)
    parser.add_argument("--report-every", type=int, default=50_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--deadline-ms", type=float, default=5.0)
    parser.add_argument("--cancel-after-ms", type=float, default=1.0)
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--guard-request-reads", choices=("on", "off"), default="on")
    parser.add_argument("--target", help="only send the calls to this running PredictionService (host:port)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.target:
        counts = asyncio.run(send(args.target, args.calls, concurrency=args.concurrency,
                                  deadline_s=args.deadline_ms / 1000, cancel_after_s=args.cancel_after_ms / 1000))
        print(json.dumps({"calls": args.calls, "outcomes": dict(counts)}), flush=True)
        return 0
    summary = soak(args)
    print(json.dumps(summary), flush=True)
    return 0 if summary["server_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
