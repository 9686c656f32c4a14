"""A small, bounded Predict latency run against real processes (a benchmark, not a test).

Starts InferenceService and PredictionService as processes on free local ports (the demo's
helpers), replays real holdout applicants through ``Predict`` with fresh request ids, and
prints one JSON line per phase: requests, concurrency, client p50 / p99 in ms and
predictions/s. Phases: concurrency 1 and 32 on a cold cache (every call reaches
InferenceService), then the same applicants again with new request ids (cache hits where a
cache is on). Usage::

    .venv/bin/python benchmarks/predict_latency.py --requests 400 [--workdir var/bench]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from mlpair.demo import free_port, start_service, stop_service, wait_ready

MODEL_NAME = "credit-risk"


async def drive(target: str, requests: list[tuple[str, str, dict]], concurrency: int) -> dict:
    import grpc

    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from mlpair.prediction.converters import to_attributes

    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.PredictionServiceStub(channel)
        messages = [pb.PredictRequest(request_id=r, entity_id=e, model_name=MODEL_NAME, attributes=to_attributes(a))
                    for r, e, a in requests]

        async def one(message) -> None:
            async with gate:
                t0 = time.perf_counter()
                await stub.Predict(message, timeout=10)
                latencies.append((time.perf_counter() - t0) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(one(m) for m in messages))
        wall = time.perf_counter() - started
    lat = np.array(latencies)
    return {"requests": len(lat), "concurrency": concurrency, "p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p99_ms": round(float(np.percentile(lat, 99)), 2), "predictions_per_s": round(len(lat) / wall, 1)}


def main() -> None:
    from mlpair.contracts.schema import FeatureSchema
    from mlpair.training.data import load_dataset, stratified_split
    from mlpair.training.pipeline import train_family

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="Predict calls per phase (≤ holdout size)")
    parser.add_argument("--workdir", default="var/bench", help="model repository, CRM, outbox and logs")
    parser.add_argument("--config-dir", default="config")
    parser.add_argument("--env", action="append", default=[], help="extra PREDICTION_*=value for the service")
    args = parser.parse_args()

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    schema_path = Path(args.config_dir) / MODEL_NAME / "feature-schema.toml"
    entry, _ = train_family(schema_path, workdir / "models", show_progress=False)
    data = load_dataset(FeatureSchema.from_toml(schema_path))
    holdout = data.subset(stratified_split(data.labels, int(entry.manifest.data_source["split"]["seed"]))["holdout"])
    n = min(args.requests, len(holdout.records))
    run = time.strftime("%Y%m%dT%H%M%S")

    ports = {k: free_port() for k in ("inference", "prediction")}
    inference = start_service("inference", {
        "INFERENCE_HOST": "127.0.0.1", "INFERENCE_PORT": str(ports["inference"]), "INFERENCE_METRICS_PORT": "0",
        "INFERENCE_MODEL_REPOSITORY": str(workdir / "models"), "INFERENCE_MODELS": f'["{MODEL_NAME}"]',
    }, workdir / "inference.log")
    prediction = None
    try:
        wait_ready(f"127.0.0.1:{ports['inference']}", inference, workdir / "inference.log")
        extra = dict(item.split("=", 1) for item in args.env)
        prediction = start_service("prediction", {
            "PREDICTION_HOST": "127.0.0.1", "PREDICTION_PORT": str(ports["prediction"]), "PREDICTION_METRICS_PORT": "0",
            "PREDICTION_INFERENCE_TARGET": f"127.0.0.1:{ports['inference']}",
            "PREDICTION_CRM_URL": f"sqlite+aiosqlite:///{workdir / f'crm-{run}.sqlite'}",
            "PREDICTION_OUTBOX_URL": f"sqlite+aiosqlite:///{workdir / f'outbox-{run}.sqlite'}",
            "PREDICTION_MODEL_REPOSITORY": str(workdir / "models"),
            "PREDICTION_CONFIG_DIR": str(Path(args.config_dir).resolve()), **extra,
        }, workdir / "prediction.log")
        target = f"127.0.0.1:{ports['prediction']}"
        wait_ready(target, prediction, workdir / "prediction.log")
        rows = list(zip(holdout.entity_ids[:n], holdout.records[:n]))
        half = n // 2
        phases = [("cold c=1", rows[:half], 1), ("cold c=32", rows[half:], 32), ("repeat c=32", rows, 32)]
        for name, subset, concurrency in phases:
            requests = [(f"bench-{run}-{name}-{eid}", eid, rec) for eid, rec in subset]
            print(json.dumps({"phase": name, **asyncio.run(drive(target, requests, concurrency))}), flush=True)
    finally:
        if prediction is not None:
            stop_service(prediction)
        stop_service(inference)


if __name__ == "__main__":
    main()
