"""Where InferenceService's CPU goes per single-row OIP ``ModelInfer``, beside the do-nothing server.

A measurement, not a test. Starts InferenceService (``mlpair serve inference``, deployed
settings: batching on, tracing on without an exporter) and ``bench/null_server.py`` (grpc.aio
answering zeros: the floor of a Python gRPC server here), then for ``--rounds`` interleaved
rounds drives each with ``bench/oip_load.py`` at ``--concurrency`` (single-row requests of real
holdout rows) while ``py-spy`` samples the server's threads. Per server it reports the server's
CPU µs per request (psutil, process tree, over the load window) split by what the sampled stacks
were running, innermost known frame first:

* ``tracing and log context`` — ``mlpair/observability``, ``mlpair/logs.py``, OpenTelemetry;
* ``metrics and statistics`` — ``prometheus_client``, ``services/inference/mlpair/inference/statistics.py``;
* ``model compute`` — the runtime (``services/inference/mlpair/inference/runtimes``, ONNX Runtime);
* ``batcher`` — queue, timer, concatenate and scatter (``services/inference/mlpair/inference/batcher.py``);
* ``checks`` — the engine's checks and the tensor's validation (``engine.py``, ``validation.py``);
* ``conversion`` — request and response messages ⇄ domain (``converters.py``, ``oip_extensions.py``,
  the servicer, ``mlpair/rpc/servicers.py``'s error guard); the null server's own ``ModelInfer`` is here;
  a Cython call (gRPC's ``invocation_metadata()``, a protobuf constructor) counts for the Python
  frame that made it;
* ``gRPC and asyncio`` — everything else: grpc.aio's Cython and Python per-call machinery and the
  event loop, which every Python gRPC server pays.

CPU that py-spy cannot see (native threads without Python frames: gRPC's core) is spread over
the categories in proportion to the samples; the totals are psutil's, not the sampler's.

    .venv/bin/python bench/oip_profile.py --model-repository var/models --concurrency 64 --rounds 2

Needs ``py-spy`` on PATH or in the venv (``pip install py-spy``; root or ptrace rights). Loopback
only; both servers stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import side_by_side as sbs  # noqa: E402

CATEGORIES = (  # (name, substrings of a frame: "function (/full/path.py:line)"), tried innermost frame first
    ("tracing and log context", ("/opentelemetry/", "/mlpair/observability/", "/mlpair/logs.py")),
    ("metrics and statistics", ("/prometheus_client/", "/inference/statistics.py",
                                "/inference/metrics.py")),
    ("model compute", ("/inference/runtimes/", "/onnxruntime/")),
    ("batcher", ("/inference/batcher.py",)),
    ("checks", ("/inference/engine.py", "/inference/validation.py")),
    ("conversion", ("/inference/converters.py", "/inference/oip_extensions.py",
                    "/inference/servicer.py", "/mlpair/rpc/", "/mlpair/wire.py", "NullServicer.")),
)
MACHINERY = "gRPC and asyncio"


def py_spy() -> str | None:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return found if Path(found).exists() else None


def categorise(raw: Path) -> collections.Counter[str]:
    """Samples per category from py-spy's raw (collapsed) output: ``frame;frame;... count``."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        name = MACHINERY
        for frame in reversed(frames):  # innermost first
            hit = next((c for c, keys in CATEGORIES if any(k in frame for k in keys)), None)
            if hit is not None:
                name = hit
                break
        counts[name] += int(n)
    return counts


def profile_point(server: sbs.Server, rows_file: Path, args, out_dir: Path, round_: int) -> dict:
    """One load point with py-spy attached to the server; the load line plus the split."""
    raw = out_dir / f"{server.name}-r{round_}.txt"
    spy = subprocess.Popen([args.py_spy, "record", "--format", "raw", "--nonblocking", "--full-filenames", "--rate", str(args.rate),
                            "--duration", str(int(args.warmup_s + args.duration_s + 1)), "--pid",
                            str(server.process.pid), "--output", str(raw)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)  # attached before the load starts
    line = sbs.measure(server, sbs.MODEL, args.concurrency, rows_file, args)
    try:
        spy.wait(60)
    except subprocess.TimeoutExpired:
        spy.terminate()
        spy.wait(10)
    counts = categorise(raw) if raw.exists() else collections.Counter()
    total = sum(counts.values())
    per_request = None
    if line.get("server_cpu_pct") and line.get("requests_per_s"):
        per_request = line["server_cpu_us_per_request"] = round(line["server_cpu_pct"] * 1e4 / line["requests_per_s"], 1)
    line["profile_samples"] = total
    if total and per_request:
        line["server_cpu_us_per_request_by_category"] = {
            name: round(per_request * counts[name] / total, 1) for name in [c for c, _ in CATEGORIES] + [MACHINERY]}
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--workdir", default="var/bench-profile")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--warmup-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--max-queue-delay-ms", type=float, default=1.0)
    parser.add_argument("--env", action="append", default=[], help="extra INFERENCE_*=value for InferenceService")
    parser.add_argument("--baseline", default="", help="git commit whose InferenceService is profiled too, "
                        "interleaved (mlpair-baseline): the same measurement before and after a change")
    args = parser.parse_args(argv)
    args.py_spy = py_spy()
    if args.py_spy is None:
        parser.error("py-spy not found: pip install py-spy")
    work = Path(args.workdir).resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows, feature_version, _ = sbs.prepare_models(Path(args.model_repository).resolve(), work / "models")
    rows_file = work / "rows.npy"
    np.save(rows_file, rows)
    ours = sbs.mlpair_server("mlpair", work / "models", True, feature_version, args)
    ours.env.update(dict(e.split("=", 1) for e in args.env))
    servers = [ours, sbs.null_server()]
    if args.baseline:
        sys.path.insert(0, str(BENCH.parent))
        from tests.support.pair import previous_release

        shutil.rmtree(work / "baseline", ignore_errors=True)  # ours, from an earlier run
        release = previous_release(work / "baseline", args.baseline)
        if release is None:
            parser.error(f"commit {args.baseline} is not in this checkout's history")
        before = sbs.mlpair_server("mlpair-baseline", work / "models", True, feature_version, args)
        before.env.update({**ours.env, "INFERENCE_PORT": str(before.port), "PYTHONPATH": str(release / "package")})
        before.command = [sys.executable, "-P", *before.command[1:]]  # -P: not this checkout's mlpair first
        servers.insert(1, before)
    results: dict[str, list[dict]] = {s.name: [] for s in servers}
    out_dir = Path(tempfile.mkdtemp(prefix="oip-profile-", dir=work))
    try:
        for server in servers:
            sbs.start(server, logs)
            sbs.wait_ready(server, 120)
        for round_ in range(1, args.rounds + 1):
            for server in servers[round_ % len(servers):] + servers[:round_ % len(servers)]:  # order rotates
                line = profile_point(server, rows_file, args, out_dir, round_)
                results[server.name].append(line)
                print(json.dumps({"round": round_, **line}), flush=True)
    finally:
        for server in servers:
            sbs.stop(server)
    summary = {}
    for name, lines in results.items():
        ok = [line for line in lines if "server_cpu_us_per_request_by_category" in line]
        if not ok:
            continue
        summary[name] = {
            "requests_per_s": float(np.median([line["requests_per_s"] for line in ok])),
            "server_cpu_us_per_request": float(np.median([line["server_cpu_us_per_request"] for line in ok])),
            "by_category": {c: float(np.median([line["server_cpu_us_per_request_by_category"][c] for line in ok]))
                            for c in ok[0]["server_cpu_us_per_request_by_category"]}}
    print(json.dumps({"label": f"median of {args.rounds} rounds", **summary}), flush=True)
    names = list(summary)
    if names:
        print("\n| per request (server CPU µs) | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
        for c in summary[names[0]]["by_category"]:
            print(f"| {c} | " + " | ".join(f"{summary[n]['by_category'][c]:.1f}" for n in names) + " |")
        print("| **total** | " + " | ".join(f"{summary[n]['server_cpu_us_per_request']:.1f}" for n in names) + " |")
        print("| req/s | " + " | ".join(f"{summary[n]['requests_per_s']:,.0f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
