"""C55 · workers behind a proxy: PredictionService with 3 workers behind an HTTP/2 proxy that
multiplexes calls onto few upstream connections, as a pod's mesh sidecar does.

The proxy here is a grpc.aio pass-through whose upstream connection pool follows Envoy's rules
for an HTTP/2 cluster: calls share a connection until it carries ``max_concurrent_streams``
calls at once (the next opens another) or has carried ``max_requests_per_connection`` calls (it is
drained and the next call opens a new one); without limits every call shares one connection, and
the kernel's SO_REUSEPORT balancing of connections gives one worker everything. The limits are
the ones deploy/istio/sidecars.yaml gives the prediction pods' sidecars. Calls per worker are read
from each worker's own prometheus-client multiprocess file (``counter_<pid>.db``) in the
supervisor's metrics folder: ``prediction_requests_total``, which every worker already counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.multiprocess import MultiProcessCollector

from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as ppb_grpc
from tests.e2e.replicas import request
from tests.support.e2e import listeners
from tests.support.pair import pair

SIDECARS = Path(__file__).resolve().parents[2] / "deploy" / "istio" / "sidecars.yaml"
WORKERS = 3
CALLS = 1920
IN_FLIGHT = 32
MOST_SHARE = 0.6


def sidecar_limits(workload: str) -> tuple[int | None, int | None]:
    """(maxConcurrentStreams, maxRequestsPerConnection) of ``workload``'s inbound pool in
    deploy/istio/sidecars.yaml; None where unset (Envoy: no limit)."""
    for doc in yaml.safe_load_all(SIDECARS.read_text()):
        if doc and doc["spec"]["workloadSelector"]["labels"].get("app.kubernetes.io/name") == workload:
            http = doc["spec"].get("inboundConnectionPool", {}).get("http", {})
            return http.get("maxConcurrentStreams"), http.get("maxRequestsPerConnection")
    return None, None


@dataclass
class Upstream:
    channel: grpc.aio.Channel
    active: int = 0
    served: int = 0


@dataclass
class MultiplexingProxy:
    """A gRPC pass-through on 127.0.0.1 with an Envoy-like HTTP/2 upstream pool (module docstring).
    Each upstream connection is a channel of its own (a local subchannel pool: channels to one
    target would otherwise share one connection); a GOAWAY from the server makes that channel
    reconnect, as Envoy does."""

    target: str
    max_streams: int | None
    max_requests: int | None
    pool: list[Upstream] = field(default_factory=list)
    opened: int = 0
    server: grpc.aio.Server | None = None
    port: int = 0

    def _connection(self) -> Upstream:
        for upstream in self.pool:
            if (self.max_requests is None or upstream.served < self.max_requests) and (
                    self.max_streams is None or upstream.active < self.max_streams):
                return upstream
        upstream = Upstream(grpc.aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)]))
        self.pool.append(upstream)
        self.opened += 1
        return upstream

    async def _forward(self, method: str, payload: bytes, context: grpc.aio.ServicerContext) -> bytes:
        upstream = self._connection()
        upstream.active += 1
        upstream.served += 1
        try:
            call = upstream.channel.unary_unary(method)
            return await call(payload, metadata=context.invocation_metadata(), timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        finally:
            upstream.active -= 1
            if self.max_requests is not None and upstream.served >= self.max_requests and upstream.active == 0:
                self.pool.remove(upstream)  # drained: closed once its last call is answered
                await upstream.channel.close()

    async def start(self) -> None:
        proxy = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                async def forward(payload, context):
                    return await proxy._forward(details.method, payload, context)

                return grpc.unary_unary_rpc_method_handler(forward)

        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((Handler(),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
        for upstream in self.pool:
            await upstream.channel.close()


def calls_per_worker(folder: Path, workers: list[int]) -> dict[int, float]:
    """``prediction_requests_total{code="OK"}`` of each worker, from its own multiprocess file."""
    counts = {}
    for pid in workers:
        metrics = MultiProcessCollector.merge([str(folder / f"counter_{pid}.db")], accumulate=True)
        counts[pid] = sum(s.value for m in metrics for s in m.samples
                          if s.name == "prediction_requests_total" and s.labels.get("code") == "OK")
    return counts


async def drive(proxy: MultiplexingProxy, records: list[dict], tag: str) -> list:
    """``CALLS`` Predict calls through the proxy, ``IN_FLIGHT`` at a time, over one client connection."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        stub = ppb_grpc.PredictionServiceStub(channel)
        limit = asyncio.Semaphore(IN_FLIGHT)

        async def one(i: int):
            async with limit:
                try:
                    return await stub.Predict(request(f"{tag}-{i}", records[i % len(records)]), timeout=30)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()

        return await asyncio.gather(*(one(i) for i in range(CALLS)))


@pytest.mark.timeout(240)
def test_c55_workers_share_the_work_behind_a_multiplexing_proxy(model_repository, credit_holdout,
                                                                tmp_path: Path) -> None:
    max_streams, max_requests = sidecar_limits("prediction")
    temp = tmp_path / "tmp"
    temp.mkdir()
    p = pair(tmp_path, model_repository, prediction_env={
        "PREDICTION_WORKERS": str(WORKERS), "PREDICTION_CACHE_BACKEND": "off", "TMPDIR": str(temp),
        "PREDICTION_INFERENCE_TIMEOUT_MS": "10000", "PREDICTION_RELAY_LINGER_MS": "10"})
    p.start()
    try:
        deadline = time.monotonic() + 60
        while len(workers := [pid for pid in listeners(p.prediction.pid, p.prediction.port)
                              if pid != p.prediction.pid]) < WORKERS:
            assert time.monotonic() < deadline, workers
            time.sleep(0.1)
        (folder,) = temp.glob("mlpair-prediction-metrics-*")
        before = calls_per_worker(folder, workers)

        async def run():
            proxy = MultiplexingProxy(p.prediction.address, max_streams, max_requests)
            await proxy.start()
            try:
                started = time.monotonic()
                replies = await drive(proxy, credit_holdout.records, tmp_path.name)
                return replies, proxy.opened, time.monotonic() - started
            finally:
                await proxy.stop()

        replies, opened, took = asyncio.run(run())
        after = calls_per_worker(folder, workers)
    finally:
        with contextlib.suppress(Exception):
            p.stop()
        p.kill()
    served = {pid: after[pid] - before[pid] for pid in workers}
    failed = [r for r in replies if isinstance(r, grpc.StatusCode)]
    assert failed == [], failed[:5]
    assert sum(served.values()) == CALLS, served
    shares = sorted(n / CALLS for n in served.values())
    print(f"calls per worker {sorted(served.values())}, shares {[round(s, 3) for s in shares]}, "
          f"{opened} upstream connections, {took:.1f} s")
    assert shares[-1] <= MOST_SHARE, (served, opened)
    assert all(n > 0 for n in served.values()), (served, opened)
