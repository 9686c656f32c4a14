"""Benchmark, not a test: per-request cost of logging and tracing, before vs after.

"before" runs the pair from a git revision without this observability (default: the commit
the branch started from), "after" runs the working tree; both as separate `mlpair serve`
processes in production configuration (JSON logs at INFO, tracing on, no exporter), driven
by the same client over loopback with the real holdout applicants. Rounds alternate
before/after so a shared machine's noise hits both alike; the median round is reported.

    .venv/bin/python tests/observability/bench_overhead.py [--base 7fdd9b4] [--requests 400]
    .venv/bin/python tests/observability/bench_overhead.py --components

``--components`` instead prices each piece of per-call instrumentation (OpenTelemetry's gRPC
interceptors, :mod:`mlpair.observability.calls`) on one in-process gRPC hop with a trivial echo handler: client plus server CPU per call, the minimum over alternating blocks (the
minimum is what a busy machine disturbs least).

Prints one JSON line per variant and round (client p50/p99, throughput, and the servers' CPU
time per request read from /proc), then a summary line per concurrency. Bounded: a fixed number of
requests per round, 127.0.0.1 only, every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from tests.support.pair import assemble_package

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_revision(revision: str, into: Path) -> Path:
    """The revision's packages laid out as installed (``mlpair.inference`` = services/inference …)."""
    tar = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True).stdout
    src = into / "src"
    with tarfile.open(fileobj=BytesIO(tar)) as archive:
        archive.extractall(src, filter="data")
    pkgs = into / "pkgs"
    assemble_package(src, pkgs)
    return pkgs


def wait_serving(port: int, timeout_s: float = 60.0) -> None:
    from mlpair.rpc import wait_until_serving

    if not wait_until_serving(f"127.0.0.1:{port}", timeout_s, poll_s=0.2):
        raise TimeoutError(f"port {port} not serving after {timeout_s} s")


class PairProcesses:
    """Both services as processes, from ``pythonpath`` (None = the installed working tree)."""

    def __init__(self, pythonpath: Path | None, models: Path, workdir: Path) -> None:
        self.env = dict(os.environ)
        self.env.pop("PYTHONPATH", None)
        if pythonpath is not None:
            self.env["PYTHONPATH"] = str(pythonpath)
        self.models, self.workdir = models, workdir
        self.procs: list[subprocess.Popen] = []
        self.port = 0

    def __enter__(self) -> PairProcesses:
        inference_port, self.port = free_port(), free_port()
        common = ["--host", "127.0.0.1", "--metrics-port", "0", "--log-format", "json", "--log-level", "INFO",
                  "--workers", "1"]  # one process each: CPU is read from /proc/<pid>
        self._spawn(["serve", "inference", "--port", str(inference_port), "--model-repository", str(self.models),
                     *common], "inference")
        wait_serving(inference_port)
        crm = self.workdir / f"crm-{time.monotonic_ns()}.sqlite"
        self._spawn(["serve", "prediction", "--port", str(self.port), "--inference-target", f"127.0.0.1:{inference_port}",
                     "--crm-url", f"sqlite+aiosqlite:///{crm}", "--model-repository", str(self.models),
                     "--config-dir", str(REPO / "config"), "--inference-timeout-ms", "10000", *common], "prediction")
        wait_serving(self.port)
        return self

    def cpu_seconds(self) -> float:
        """User + system CPU time both server processes have used so far (from /proc)."""
        ticks = 0
        for proc in self.procs:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        return ticks / os.sysconf("SC_CLK_TCK")

    def _spawn(self, args: list[str], name: str) -> None:
        # cwd outside the repository, so `mlpair` resolves through PYTHONPATH or the installed tree.
        with open(self.workdir / f"{name}.log", "ab") as log:  # the child holds its own descriptor
            self.procs.append(subprocess.Popen([sys.executable, "-m", "mlpair.cli", *args], cwd=self.workdir,
                                               env=self.env, stdout=log, stderr=log))

    def __exit__(self, *exc) -> None:
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def drive(port: int, records: list[dict], ids: list[str], tag: str, concurrency: int) -> dict:
    import grpc

    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from mlpair.client import to_attributes

    requests = [pb.PredictRequest(request_id=f"{tag}-{i}", entity_id=eid, attributes=to_attributes(r))
                for i, (eid, r) in enumerate(zip(ids, records, strict=True))]
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.PredictionServiceStub(channel)
        for warm in requests[:20]:
            await stub.Predict(pb.PredictRequest(request_id=f"{tag}-warm-{warm.request_id}", entity_id=warm.entity_id,
                                                 attributes=warm.attributes), timeout=10)
        gate = asyncio.Semaphore(concurrency)

        async def one(request):
            async with gate:
                t0 = time.perf_counter()
                await stub.Predict(request, timeout=10)
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(one(r) for r in requests))
        wall = time.perf_counter() - started
    latencies.sort()
    return {"p50_ms": round(statistics.median(latencies) * 1000, 3),
            "p99_ms": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 3),
            "throughput_rps": round(len(requests) / wall, 1)}


async def components(blocks: int = 25, calls: int = 200) -> dict[str, float]:
    """CPU microseconds per echo call (client + server, one process) with each piece alone:
    OpenTelemetry's gRPC interceptors (what the services used before) and the in-handler
    instrumentation of :mod:`mlpair.observability.calls` (what they use now)."""
    import grpc
    from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor

    from mlpair import logs
    from mlpair.observability.calls import CallTracer, observe_servicer
    from mlpair.observability.tracing import build_tracer_provider

    provider = build_tracer_provider("mlpair-bench")  # production default: no exporter

    class Echo:
        async def Call(self, request, context):  # noqa: N802  (gRPC method name)
            return request

    # name: (server interceptors, client interceptors, wrap the servicer, trace the client call)
    variants = {
        "none": ([], None, False, False),
        "server: OpenTelemetry interceptor": ([aio_server_interceptor(tracer_provider=provider)], None, False, False),
        "client: OpenTelemetry interceptor": ([], [aio_client_interceptors(tracer_provider=provider)[0]], False, False),
        "server: observe_servicer (span, log context, Infer line check)": ([], None, True, False),
        "client: CallTracer (span, traceparent, x-request-id)": ([], None, False, True),
        "both of ours": ([], None, True, True),
    }
    tracer = CallTracer(provider)
    calls_by_variant, keep = {}, []
    for name, (server_side, client_side, wrap, traced) in variants.items():
        server = grpc.aio.server(interceptors=server_side)
        echo = observe_servicer(Echo(), "bench.Echo", "inference", provider, log_calls=True) if wrap else Echo()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(echo.Call)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_side)
        keep.append((server, channel))
        calls_by_variant[name] = (channel.unary_unary("/bench.Echo/Call"), traced)
    best = dict.fromkeys(variants, float("inf"))
    payload = b"x" * 256
    token = logs.begin_request(logs.RequestContext("prediction", request_id="bench-request-1"))
    for _ in range(blocks):
        for name, (call, traced) in calls_by_variant.items():
            started = time.process_time()
            for _ in range(calls):
                if traced:
                    with tracer.call("bench.Echo", "Call", ()) as metadata:
                        await call(payload, metadata=metadata)
                else:
                    await call(payload)
            best[name] = min(best[name], (time.process_time() - started) / calls * 1e6)
    logs.end_request(token)
    for server, channel in keep:
        await channel.close()
        await server.stop(0)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="7fdd9b4", help="revision without this observability [default: 7fdd9b4]")
    parser.add_argument("--requests", type=int, default=400, help="Predict calls per round [default: 400]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per variant, alternating [default: 3]")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16], help="calls in flight [default: 1 16]")
    parser.add_argument("--components", action="store_true", help="price each piece of per-call instrumentation on one echo hop instead")
    args = parser.parse_args()
    if args.components:
        best = asyncio.run(components())
        for name, us in best.items():
            print(json.dumps({"component": name, "cpu_us_per_call": round(us, 1),
                              "delta_us": round(us - best["none"], 1)}), flush=True)
        return 0

    from mlpair.contracts.schema import FeatureSchema
    from mlpair.training.data import load_dataset, stratified_split
    from mlpair.training.pipeline import train_family

    with tempfile.TemporaryDirectory(prefix="mlpair-bench-obs-") as tmp:
        tmp = Path(tmp)
        entry, _ = train_family(REPO / "config/credit-risk/feature-schema.toml", tmp / "models", show_progress=False)
        data = load_dataset(FeatureSchema.from_toml(REPO / "config/credit-risk/feature-schema.toml"))
        holdout = data.subset(stratified_split(data.labels, int(entry.manifest.data_source["split"]["seed"]))["holdout"])
        n = min(args.requests, len(holdout.records))
        variants = {"before": export_revision(args.base, tmp / "base"), "after": None}
        results: dict[tuple[str, int], list[dict]] = {}
        for round_ in range(args.rounds):
            for variant, pythonpath in variants.items():
                work = tmp / f"{variant}-{round_}"
                work.mkdir()
                with PairProcesses(pythonpath, tmp / "models", work) as pair:
                    for c in args.concurrency:
                        cpu_before = pair.cpu_seconds()
                        r = asyncio.run(drive(pair.port, holdout.records[:n], holdout.entity_ids[:n],
                                              f"{variant}-{round_}-{c}", c))
                        # Server CPU per Predict (both services; the 20 warm-up calls included).
                        r["server_cpu_ms_per_request"] = round((pair.cpu_seconds() - cpu_before) * 1000 / (n + 20), 3)
                        results.setdefault((variant, c), []).append(r)
                        print(json.dumps({"variant": variant, "round": round_, "concurrency": c, "requests": n, **r}),
                              flush=True)
        for c in args.concurrency:
            med = {v: {k: statistics.median(r[k] for r in results[(v, c)]) for k in results[(v, c)][0]}
                   for v in variants}
            print(json.dumps({"summary": True, "concurrency": c, "before": med["before"], "after": med["after"],
                              "p50_delta_ms": round(med["after"]["p50_ms"] - med["before"]["p50_ms"], 3),
                              "server_cpu_delta_ms": round(med["after"]["server_cpu_ms_per_request"]
                                                           - med["before"]["server_cpu_ms_per_request"], 3),
                              "throughput_ratio": round(med["after"]["throughput_rps"]
                                                        / med["before"]["throughput_rps"], 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
