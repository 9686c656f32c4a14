"""Cold start to SERVING of InferenceService for one model: from a local folder, from S3 with an
empty node cache, and from S3 again with the cache the first start filled.

Two measures per case, each repeated: the load alone (``InferenceServer.start`` + ``load`` in this
process, imports already done) and a whole process (``mlpair serve inference`` until grpc.health.v1
says SERVING, imports included). S3 is moto's standalone server on loopback
(tests/support/stores.py), so the figures show what the source adds on this machine, not a
cloud's network.

    python bench/model_source_start.py --model-repository var/models --model credit-risk --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable (tests.support)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from mlpair.inference.server import InferenceServer  # noqa: E402
from mlpair.inference.settings import InferenceSettings  # noqa: E402
from mlpair.sources.publish import publish  # noqa: E402
from tests.support.pair import free_port  # noqa: E402
from tests.support.stores import moto_s3, s3_env  # noqa: E402


async def load_seconds(model: str, **settings) -> float:
    s = InferenceSettings(host="127.0.0.1", port=0, metrics_port=0, models=[model], workers=1, **settings)
    started = time.perf_counter()
    server = InferenceServer(s)
    await server.start()
    await server.load()
    seconds = time.perf_counter() - started
    await server.stop()
    return seconds


def process_seconds(model: str, env: dict[str, str]) -> float:
    port = free_port()
    env = {**os.environ, **env, "INFERENCE_PORT": str(port), "INFERENCE_METRICS_PORT": "0", "INFERENCE_WORKERS": "1",
           "INFERENCE_MODELS": f'["{model}"]'}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mlpair.cli", "serve", "inference"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.perf_counter() - started < 60:
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == 1:
                        return time.perf_counter() - started
                except grpc.RpcError:
                    pass
                time.sleep(0.01)
        raise RuntimeError("not SERVING within 60 s")
    finally:
        proc.terminate()
        proc.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, default=Path("var/models"))
    parser.add_argument("--model", default="credit-risk")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    versions = sorted(int(p.name) for p in (args.model_repository / args.model).iterdir() if p.name.isdigit())
    work = Path(tempfile.mkdtemp(prefix="mlpair-source-start-"))
    results: dict[str, list[float]] = {}
    try:
        with moto_s3(work / "moto.log") as endpoint:
            os.environ.update(s3_env(endpoint))
            import boto3

            boto3.client("s3").create_bucket(Bucket="bench-models")
            uri = "s3://bench-models/prod"
            publish(args.model_repository / args.model / str(versions[-1]), uri)
            asyncio.run(load_seconds(args.model, model_repository=args.model_repository))  # imports, once
            for i in range(args.repeat):
                cache = work / f"cache-{i}"
                local = {"model_repository": args.model_repository}
                remote = {"model_source": uri, "model_cache_dir": cache}
                results.setdefault("load: local folder", []).append(asyncio.run(load_seconds(args.model, **local)))
                results.setdefault("load: S3, empty cache", []).append(asyncio.run(load_seconds(args.model, **remote)))
                results.setdefault("load: S3, cached", []).append(asyncio.run(load_seconds(args.model, **remote)))
                shutil.rmtree(cache)
                env_local = {"INFERENCE_MODEL_REPOSITORY": str(args.model_repository)}
                env_remote = {"INFERENCE_MODEL_SOURCE": uri, "INFERENCE_MODEL_CACHE_DIR": str(cache)}
                results.setdefault("process: local folder", []).append(process_seconds(args.model, env_local))
                results.setdefault("process: S3, empty cache", []).append(process_seconds(args.model, env_remote))
                results.setdefault("process: S3, cached", []).append(process_seconds(args.model, env_remote))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'start to SERVING':28s} {'median s':>9s} {'min s':>7s} {'max s':>7s}  ({args.repeat} runs)")
    for name, values in results.items():
        print(f"{name:28s} {statistics.median(values):9.3f} {min(values):7.3f} {max(values):7.3f}")


if __name__ == "__main__":
    main()
