"""``make bench-inference``: InferenceService over OIP gRPC, batching on and off, against its ceilings.

A benchmark, not a test: it reports numbers and asserts none. Steps:

1. the credit-risk model is trained into the repository, or the latest entry reused;
2. the real holdout applicants are assembled into feature rows (what gets sent);
3. in-process ceiling: the same ONNX Runtime session runs those rows with no RPC at all, at
   batch 1 and at ``max_batch_size``;
4. the service (``mlpair serve inference``, its own process, loopback port) is driven by
   ``bench/oip_load.py`` at each concurrency, with dynamic batching on, then off;
5. floor: a do-nothing Python OIP server (``bench/null_server.py``) under the same load, which
   shows what the Python gRPC stack alone allows on this machine;
6. a summary line with the ratios.

Every line is one JSON object. Client and server share this machine's cores, so figures are
client + server CPU per request, and are noisy when other work runs at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "config" / "credit-risk" / "feature-schema.toml"
MODEL = "credit-risk"


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def holdout_rows(root: Path) -> tuple[np.ndarray, str]:
    """The real holdout applicants as ``[n, n_features] float32`` and the model's feature version."""
    from mlpair.contracts.assembly import FeatureAssembler
    from mlpair.contracts.schema import FeatureSchema
    from mlpair.training.data import load_dataset, stratified_split
    from mlpair.training.pipeline import train_family

    entry, _ = train_family(SCHEMA, root, show_progress=False)
    data = load_dataset(FeatureSchema.from_toml(SCHEMA))
    holdout = data.subset(stratified_split(data.labels, int(entry.manifest.data_source["split"]["seed"]))["holdout"])
    rows = FeatureAssembler(entry.preprocessing).assemble_many(holdout.records)
    return rows, entry.manifest.versions.feature_schema_version, entry


def in_process_ceiling(entry, rows: np.ndarray, batch: int, seconds: float) -> dict:
    """Rows/s of the runtime alone on ``rows``, ``batch`` rows per call, for about ``seconds``."""
    from mlpair.inference.runtimes.onnx import OnnxRuntime

    runtime = OnnxRuntime(entry.model_path, provider="cpu", intra_op_threads=1)
    batches = [np.ascontiguousarray(rows[i:i + batch]) for i in range(0, len(rows) - batch + 1, batch)] or [rows[:batch]]
    for b in batches[:20]:
        runtime.run(b)
    done, calls, started = 0, 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for b in batches:
            runtime.run(b)
            done += b.shape[0]
            calls += 1
    elapsed = time.perf_counter() - started
    return {"label": f"in-process ceiling, batch {batch}", "runtime": runtime.description, "batch": batch,
            "rows_per_s": round(done / elapsed, 1), "calls_per_s": round(calls / elapsed, 1),
            "us_per_call": round(1e6 * elapsed / calls, 2)}


def start_service(root: Path, port: int, batching: bool, args) -> subprocess.Popen:
    env = {**os.environ, "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0",
           "INFERENCE_MODEL_REPOSITORY": str(root), "INFERENCE_MODELS": json.dumps([MODEL]),
           "INFERENCE_BATCHING": str(batching).lower(), "INFERENCE_MAX_BATCH_SIZE": str(args.max_batch_size),
           "INFERENCE_MAX_QUEUE_DELAY_MS": str(args.max_queue_delay_ms), "INFERENCE_LOG_LEVEL": "WARNING",
           "INFERENCE_WORKERS": "1"}  # one process: this bench's figures are per event loop
    return subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "inference"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_null(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "bench" / "null_server.py"), "--port", str(port),
                             "--model", MODEL], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process this script started, by PID; SIGKILL if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def load(url: str, rows_file: Path, concurrency: int, feature_version: str, pid: int, label: str, args) -> dict:
    cmd = [sys.executable, str(REPO / "bench" / "oip_load.py"), "--url", url, "--model", MODEL,
           "--rows-file", str(rows_file), "--concurrency", str(concurrency),
           "--duration-s", str(args.duration_s), "--warmup-s", str(args.warmup_s),
           "--parameter", f"x-feature-version={feature_version}", "--server-pid", str(pid), "--label", label]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.warmup_s + args.duration_s + 120)
    if out.returncode != 0:
        return {"label": label, "concurrency": concurrency, "failed": out.stderr.strip()[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--duration-s", type=float, default=8.0, help="measured seconds per point")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="unmeasured seconds before each point")
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--max-queue-delay-ms", type=float, default=2.0)
    parser.add_argument("--ceiling-s", type=float, default=2.0, help="seconds per in-process ceiling figure")
    args = parser.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    root = Path(args.model_repository).resolve()
    rows, feature_version, entry = holdout_rows(root)
    emit({"label": "setup", "model": MODEL, "version": entry.manifest.model_version, "rows": int(rows.shape[0]),
          "n_features": int(rows.shape[1]), "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)})
    ceilings = [in_process_ceiling(entry, rows, b, args.ceiling_s) for b in (1, args.max_batch_size)]
    for line in ceilings:
        emit(line)

    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "rows.npy"
        np.save(rows_file, rows)
        servers = [("service, batching on", lambda p: start_service(root, p, True, args), args.concurrency),
                   ("service, batching off", lambda p: start_service(root, p, False, args), args.concurrency),
                   ("do-nothing grpc.aio OIP server", start_null, [c for c in args.concurrency if c in (1, 64)])]
        for label, starter, concurrencies in servers:
            port = free_port()
            process = starter(port)
            try:
                for c in concurrencies:
                    line = load(f"127.0.0.1:{port}", rows_file, c, feature_version, process.pid, label, args)
                    results[(label, c)] = line
                    emit(line)
            finally:
                stop(process)

    top = max(args.concurrency)
    on, off = results.get(("service, batching on", top), {}), results.get(("service, batching off", top), {})
    null = results.get(("do-nothing grpc.aio OIP server", top), {})
    summary = {"label": "summary", "concurrency": top,
               "batching_on_rows_per_s": on.get("rows_per_s"), "batching_off_rows_per_s": off.get("rows_per_s"),
               "null_server_rows_per_s": null.get("rows_per_s"),
               "ceiling_batch1_rows_per_s": ceilings[0]["rows_per_s"],
               f"ceiling_batch{args.max_batch_size}_rows_per_s": ceilings[1]["rows_per_s"]}
    if on.get("rows_per_s"):
        summary["batching_on_vs_off"] = round(on["rows_per_s"] / off["rows_per_s"], 3) if off.get("rows_per_s") else None
        summary["service_to_ceiling_batch1"] = round(on["rows_per_s"] / ceilings[0]["rows_per_s"], 4)
        summary[f"service_to_ceiling_batch{args.max_batch_size}"] = round(on["rows_per_s"] / ceilings[1]["rows_per_s"], 4)
        summary["service_to_null_server"] = round(on["rows_per_s"] / null["rows_per_s"], 3) if null.get("rows_per_s") else None
    # Server CPU per request is steadier than req/s when other work shares the machine.
    summary["server_cpu_us_per_request"] = {
        name: round(line["server_cpu_pct"] * 1e4 / line["requests_per_s"], 1)
        for name, line in (("batching_on", on), ("batching_off", off), ("null_server", null))
        if line.get("server_cpu_pct") and line.get("requests_per_s")}
    summary["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
