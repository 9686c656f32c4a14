"""Priorities under a saturating bulk client: what it adds to an online caller's p99 at 100 calls/s.

A benchmark, not a test: it reports numbers and asserts none. One InferenceService process
(``mlpair serve inference``, loopback port, one worker, ``priority_levels`` 2, the bulk level's
queue limited to ``--bulk-queue-rows``) serves the credit-risk model; three phases of
``--duration-s`` each (after ``--warmup-s``):

1. ``alone``: the online caller only: single-row OIP ``ModelInfer`` calls, paced at ``--rate``
   calls/s (open loop: a call starts every 1/rate s whatever the others do), ``priority`` 1;
2. ``priorities on``: the same online caller while a bulk client (its own process) keeps
   ``--bulk-concurrency`` calls of ``--bulk-rows`` rows in flight at ``priority`` 2: it fills
   its level's queue and gets RESOURCE_EXHAUSTED beyond it (it retries after ``--bulk-backoff-ms``);
3. ``priorities off``: the same, with every request at one level (the bulk client sends
   ``priority`` 1 too, so it shares the online caller's queue, as before priorities existed).

``--heavy`` serves the compute-heavy variant of the model instead (``bench/heavy_model.py``: the
same rows, a wide untrained MLP, several milliseconds per batch), where the queue, not the RPC
handling, is what a bulk client fills.

Prints one JSON line per phase and a summary: the online caller's p50/p99 per phase and what the
bulk client added to its p99 with priorities on and off. Client and server share this machine's
cores, so the figures include CPU contention. Bounded: about 3 × (warm-up + duration) seconds
plus the server's start; only loopback.

    .venv/bin/python bench/priorities.py --model-repository var/models
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable as `bench`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.inference import MODEL, emit, free_port, holdout_rows, stop  # noqa: E402
from bench.load import percentile  # noqa: E402


def request(model: str, rows: np.ndarray, feature_version: str, level: int):
    from mlpair.api.oip import grpc_predict_v2_pb2 as oip

    params = {"x-feature-version": oip.InferParameter(string_param=feature_version),
              "priority": oip.InferParameter(uint64_param=level)}
    tensor = oip.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=list(rows.shape))
    return oip.ModelInferRequest(model_name=model, parameters=params, inputs=[tensor],
                                 raw_input_contents=[np.ascontiguousarray(rows, "<f4").tobytes()])


def start_service(root: Path, model: str, port: int, args) -> subprocess.Popen:
    env = {**os.environ, "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0",
           "INFERENCE_MODEL_REPOSITORY": str(root), "INFERENCE_MODELS": json.dumps([model]),
           "INFERENCE_MAX_BATCH_SIZE": str(args.max_batch_size), "INFERENCE_MAX_QUEUE_DELAY_MS": "2", "INFERENCE_LOG_LEVEL": "WARNING",
           "INFERENCE_PRIORITY_LEVELS": "2", "INFERENCE_MAX_REQUEST_ROWS": str(args.bulk_queue_rows),
           "INFERENCE_PRIORITY_QUEUE_ROWS": json.dumps([16384, args.bulk_queue_rows]), "INFERENCE_WORKERS": "1"}
    return subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "inference"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def wait_ready(stub, seconds: float = 60.0) -> None:
    from mlpair.api.oip import grpc_predict_v2_pb2 as oip

    until = time.monotonic() + seconds
    while time.monotonic() < until:
        try:
            if (await stub.ServerReady(oip.ServerReadyRequest(), timeout=1)).ready:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.2)
    raise SystemExit("InferenceService did not turn ready within 60 s")


async def online(url: str, rows: np.ndarray, feature_version: str, args) -> dict:
    """The paced online caller: latencies of the calls started inside the measured window."""
    from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    async with grpc.aio.insecure_channel(url) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        await wait_ready(stub)
        latencies: list[float] = []
        errors: dict[str, int] = {}
        began = time.perf_counter()
        measure_from, end = began + args.warmup_s, began + args.warmup_s + args.duration_s

        async def one(k: int) -> None:
            t0 = time.perf_counter()
            try:
                await stub.ModelInfer(request(args.model, rows[k % len(rows)][None, :], feature_version, 1), timeout=2.0)
                code = None
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
            if t0 >= measure_from:
                if code is None:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors[code] = errors.get(code, 0) + 1

        calls, k = [], 0
        while (due := began + k / args.rate) < end:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            calls.append(asyncio.ensure_future(one(k)))
            k += 1
        await asyncio.gather(*calls)
    latencies.sort()
    return {"calls": len(latencies), "errors": errors, "p50_ms": round(1e3 * percentile(latencies, 50), 2),
            "p99_ms": round(1e3 * percentile(latencies, 99), 2), "max_ms": round(1e3 * latencies[-1], 2)}


async def bulk(url: str, rows_file: str, feature_version: str, level: int, args) -> None:
    """The bulk client (``--bulk-client``): prints "ready" once its first call was answered, keeps its
    calls in flight for the online caller's warm-up and window (and a second more), then prints its counts."""
    from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc

    data = np.load(rows_file).astype(np.float32)
    counts = {"ok": 0, "refused": 0, "other": 0}
    async with grpc.aio.insecure_channel(url) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        await wait_ready(stub)
        first = request(args.model, data[: args.bulk_rows], feature_version, level)
        await stub.ModelInfer(first, timeout=10.0)
        print("ready", flush=True)
        end = time.perf_counter() + args.warmup_s + args.duration_s + 1

        async def worker(i: int) -> None:
            start = (i * args.bulk_rows) % max(1, len(data) - args.bulk_rows)
            message = request(args.model, data[start:start + args.bulk_rows], feature_version, level)
            while time.perf_counter() < end:
                try:
                    await stub.ModelInfer(message, timeout=10.0)
                    counts["ok"] += 1
                except grpc.aio.AioRpcError as exc:
                    refused = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    counts["refused" if refused else "other"] += 1
                    await asyncio.sleep(args.bulk_backoff_ms / 1000)

        await asyncio.gather(*(worker(i) for i in range(args.bulk_concurrency)))
    print(json.dumps(counts), flush=True)


def phase(label: str, url: str, rows: np.ndarray, rows_file: Path, feature_version: str, bulk_level: int | None,
          args) -> dict:
    client = None
    if bulk_level is not None:
        client = subprocess.Popen([sys.executable, __file__, "--bulk-client", url, str(rows_file), feature_version,
                                   str(bulk_level), *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
    try:
        if client is not None and client.stdout is not None and client.stdout.readline().strip() != "ready":
            raise SystemExit("the bulk client did not start")
        line = {"label": label, "load_avg_1m": round(os.getloadavg()[0], 2),
                **asyncio.run(online(url, rows, feature_version, args))}
        if client is not None:
            out, _ = client.communicate(timeout=30)
            line["bulk_calls"] = json.loads(out.strip().splitlines()[-1])
    finally:
        if client is not None:
            stop(client)
    emit(line)
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default="var/models")
    parser.add_argument("--rate", type=float, default=100.0, help="online calls per second")
    parser.add_argument("--duration-s", type=float, default=5.0, help="measured seconds per phase")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="unmeasured seconds before each phase")
    parser.add_argument("--heavy", action="store_true", help="serve the compute-heavy variant of the model")
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--bulk-concurrency", type=int, default=10,
                        help="bulk calls in flight: the bulk level's queue holds about bulk-queue-rows / bulk-rows")
    parser.add_argument("--bulk-rows", type=int, default=128)
    parser.add_argument("--bulk-queue-rows", type=int, default=1024, help="the bulk level's queue limit, rows")
    parser.add_argument("--bulk-backoff-ms", type=float, default=5.0, help="the bulk client's wait after a refusal")
    parser.add_argument("--bulk-client", nargs=4, metavar=("URL", "ROWS", "FEATURE_VERSION", "LEVEL"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.model = MODEL + ("-heavy" if args.heavy else "")
    if args.bulk_client:
        url, rows_file, feature_version, level = args.bulk_client
        asyncio.run(bulk(url, rows_file, feature_version, int(level), args))
        return 0

    root = Path(args.model_repository).resolve()
    rows, feature_version, entry = holdout_rows(root)
    port = free_port()
    url = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        if args.heavy:
            from bench.heavy_model import write_heavy_entry

            root = Path(tmp) / "models"
            write_heavy_entry(entry.path, root)
        process = start_service(root, args.model, port, args)
        try:
            rows_file = Path(tmp) / "rows.npy"
            np.save(rows_file, rows)
            alone = phase("alone", url, rows, rows_file, feature_version, None, args)
            on = phase("priorities on (bulk at level 2)", url, rows, rows_file, feature_version, 2, args)
            off = phase("priorities off (every request at level 1)", url, rows, rows_file, feature_version, 1, args)
        finally:
            stop(process)
    emit({"label": "summary", "model": args.model, "rate": args.rate, "p99_ms": {"alone": alone["p99_ms"], "on": on["p99_ms"],
                                                             "off": off["p99_ms"]},
          "added_p99_ms": {"on": round(on["p99_ms"] - alone["p99_ms"], 2),
                           "off": round(off["p99_ms"] - alone["p99_ms"], 2)},
          "model_version": entry.manifest.model_version, "cpu_count": os.cpu_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
