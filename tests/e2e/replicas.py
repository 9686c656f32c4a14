"""Several PredictionService processes over one InferenceService, one decision ledger and one CRM.

The pieces the replica tests share: a cluster of real processes (``mlpair serve``, migrated with
``mlpair migrate``) whose ledger and CRM may sit behind TCP proxies the test cuts, a round-robin
client, and the comparison of an answer with the CRM row of its request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path

import grpc
from sqlalchemy import func, make_url, select

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.client import to_attributes
from mlpair.prediction.recording.models import DecisionRecord
from mlpair.prediction.recording.store import make_engine
from mlpair.rpc import error_info
from tests.support.pair import Pair, Service, TcpProxy, free_port, pair

FAMILIES = json.dumps(["credit-risk", "churn"])


@dataclass
class Cluster:
    """Running processes and a stub per PredictionService replica (round-robin by index)."""

    pair: Pair
    crm_url: str  # direct, not through a proxy (for the test's own reads)
    replicas: list[Service]
    stubs: list[pb_grpc.PredictionServiceStub] = field(default_factory=list)
    channels: list[grpc.aio.Channel] = field(default_factory=list)
    proxies: dict[str, TcpProxy] = field(default_factory=dict)

    def connect(self) -> None:
        self.channels = [grpc.aio.insecure_channel(r.address) for r in self.replicas]
        self.stubs = [pb_grpc.PredictionServiceStub(c) for c in self.channels]

    async def close_channels(self) -> None:
        for channel in self.channels:
            await channel.close()


def through(url: str, proxy: TcpProxy) -> str:
    return make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


@contextlib.asynccontextmanager
async def cluster(workdir: Path, model_repository: Path, postgres_url: str, *, replicas: int,
                  proxied: tuple[str, ...] = (), extra: dict[str, dict[str, str]] | None = None, **prediction_env):
    """InferenceService and ``replicas`` PredictionService processes sharing the ledger and the
    CRM (one PostgreSQL database: the ledger in its own schema). ``proxied`` names what goes
    through its own TCP proxy ("ledger", "crm"); ``extra`` adds replicas with settings of their
    own (name → environment overrides). Processes are started off the event loop, which keeps the
    proxies running while they migrate and start."""
    target = make_url(postgres_url)
    proxies = {name: TcpProxy(target.host, target.port) for name in proxied}
    for proxy in proxies.values():
        await proxy.start()
    ledger_url = through(postgres_url, proxies["ledger"]) if "ledger" in proxies else postgres_url
    crm_url = through(postgres_url, proxies["crm"]) if "crm" in proxies else postgres_url
    env = {"PREDICTION_MODELS": FAMILIES, "PREDICTION_HEALTH_INTERVAL_MS": "200",
           "PREDICTION_INFERENCE_TIMEOUT_MS": "10000", "PREDICTION_LEDGER_TIMEOUT_MS": "5000",
           "PREDICTION_CRM_TIMEOUT_MS": "1000", "PREDICTION_RELAY_BACKOFF_MAX_MS": "200", **prediction_env}
    p = pair(workdir, model_repository, crm_url=crm_url, ledger_url=ledger_url, prediction_env=env,
             inference_env={"INFERENCE_MODELS": FAMILIES}, prediction_replicas=replicas)
    more = []
    for name, overrides in (extra or {}).items():
        service = Service("prediction", {**p.prediction.env, **overrides}, free_port(), workdir / f"prediction-{name}.log")
        service.env["PREDICTION_PORT"] = str(service.port)
        more.append(service)
    c = Cluster(p, postgres_url, [*p.predictions, *more], proxies=proxies)
    try:
        await asyncio.to_thread(p.start)
        for service in more:
            await asyncio.to_thread(service.start)
        c.connect()
        yield c
    finally:
        await c.close_channels()
        for service in more:
            await asyncio.to_thread(service.terminate)
        await asyncio.to_thread(p.stop)
        for proxy in proxies.values():
            await proxy.close()


def request(request_id: str, record: dict, entity_id: str = "", model_name: str = "") -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=entity_id or f"entity-{request_id}",
                             attributes=to_attributes(record), model_name=model_name)


async def crm_rows(crm_url: str, request_ids: list[str] | None = None) -> dict[str, list]:
    """Every CRM row (for these request ids, or all), read directly."""
    engine = make_engine(crm_url)
    try:
        async with engine.connect() as conn:
            query = select(DecisionRecord)
            if request_ids is not None:
                query = query.where(DecisionRecord.request_id.in_(request_ids))
            rows = (await conn.execute(query)).all()
    finally:
        await engine.dispose()
    out: dict[str, list] = {}
    for row in rows:
        out.setdefault(row.request_id, []).append(row)
    return out


async def crm_totals(crm_url: str) -> tuple[int, int]:
    """(rows, distinct request ids) in the CRM."""
    engine = make_engine(crm_url)
    try:
        async with engine.connect() as conn:
            total, distinct = (await conn.execute(
                select(func.count(), func.count(func.distinct(DecisionRecord.request_id))))).one()
    finally:
        await engine.dispose()
    return int(total), int(distinct)


def contradicts(reply: pb.PredictResponse, row) -> list[str]:
    """How an answer differs from the CRM row of its request id (empty: it agrees)."""
    differences = []
    if reply.decision_id != row.decision_id:
        differences.append("decision_id")
    if reply.decision_label != row.decision:
        differences.append("decision")
    if (row.probability is None) != reply.fallback or (row.probability is not None and reply.probability != row.probability):
        differences.append("probability")
    if list(reply.reason_codes) != json.loads(row.reason_codes):
        differences.append("reason_codes")
    if row.decided_at is not None and reply.decided_at.ToDatetime() != row.decided_at.astimezone(UTC).replace(tzinfo=None):
        differences.append("decided_at")
    return differences


def refusal_reason(error: grpc.RpcError) -> str:
    info = error_info(error)
    return info.reason if info else ""
