"""The fleet the live observability test runs: real processes, the traffic they get, the faults.

* :func:`model_repository` — credit-risk version 1 (the session's model), 2 (a retrain with another
  seed: a healthy canary) and 3 (one epoch of a 4-unit network: a deliberately worse one).
* :class:`Fleet` — InferenceService behind a TCP proxy (killed with SIGKILL, latency injected on
  the hop), two stable PredictionService replicas and two canaries (versions 2 and 3, each shadowing
  version 1), one decision ledger and a CRM behind another proxy (cut), a Redis cache. Every process
  exposes its metrics port; :meth:`Fleet.targets` gives Prometheus the labels Kubernetes service
  discovery would (namespace, pod, rollouts_pod_template_hash).
* :class:`Traffic` — open-loop Predict load at a fixed rate, weighted over the replicas, whose
  requests come from a source the scenario switches: holdout applicants drawn at random, rows
  seen before (cache repeats), income x 3 (drift), near-identical applications just below a
  threshold (probing).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.client import to_attributes
from tests.observability.prometheus_server import Target
from tests.support.pair import Service, TcpProxy, free_port, pair

MODEL = "credit-risk"
NAMESPACE = "mlpair"
# rollouts-pod-template-hash of each revision, as Argo labels its pods.
HASHES = {"stable": "5f7c9d8b6", "good": "6c8d7f9b4", "bad": "7b9f6c5d8"}
CANARY_VERSIONS = {"good": "2", "bad": "3"}


def model_repository(root: Path, stable_entry, schema: Path) -> Path:
    """credit-risk versions 1 (copied), 2 (seed 7) and 3 (under-trained), same split and features."""
    from mlpair.training.pipeline import load_train_config, train_family

    shutil.copytree(stable_entry.path, root / MODEL / "1")
    base = load_train_config(schema)
    train_family(schema, root, dataclasses.replace(base, seed=7), force=True, show_progress=False)
    train_family(schema, root, dataclasses.replace(base, seed=3, epochs=1, learning_rate=1e-4, hidden=(4,)),
                 force=True, show_progress=False)
    return root


def near_threshold_applications(entry, records: list[dict], threshold: float, width: float, count: int) -> list[dict]:
    """``count`` near-identical applications the stable version scores in ``[t - width, t)``:
    one holdout applicant whose loan amount is nudged a little at a time (what a prober does)."""
    import onnxruntime as ort

    from mlpair.contracts.assembly import FeatureAssembler
    from mlpair.prediction.scoring.calibration import Calibrator

    assembler, calibrator = FeatureAssembler(entry.preprocessing), Calibrator(entry.manifest)
    session = ort.InferenceSession(str(entry.path / entry.manifest.model_file), providers=["CPUExecutionProvider"])

    def scores(rows: list[dict]) -> np.ndarray:
        x = assembler.assemble_many(rows).astype(np.float32)
        return calibrator.probabilities(session.run(None, {session.get_inputs()[0].name: x})[0])

    low, high = threshold - width * 0.9, threshold - width * 0.1
    coarse = np.arange(100.0, 20000.0, 25.0)
    for record in records:
        if record.get("Amount") is None:
            continue
        p = scores([{**record, "Amount": a} for a in coarse])
        hits = np.flatnonzero((p >= low) & (p < high))
        if len(hits) == 0:
            continue
        i = int(hits[len(hits) // 2])
        fine = np.linspace(coarse[max(i - 1, 0)], coarse[min(i + 1, len(coarse) - 1)], 8 * count)
        p = scores([{**record, "Amount": float(a)} for a in fine])
        inside = fine[(p >= low) & (p < high)]
        if len(inside) >= count:
            chosen = inside[np.linspace(0, len(inside) - 1, count).astype(int)]
            return [{**record, "Amount": round(float(a), 2)} for a in chosen]
    raise LookupError("no holdout applicant could be nudged into the band")


class Fleet:
    """The processes, proxies and their Prometheus targets (see the module docstring)."""

    def __init__(self, workdir: Path, repository: Path, postgres_url: str) -> None:
        from sqlalchemy import make_url

        target = make_url(postgres_url)
        self.crm_proxy = TcpProxy(target.host, target.port)
        prefix = f"mlpair:live:{uuid.uuid4().hex[:8]}:"
        crm_url = target.set(host="127.0.0.1", port=self.crm_proxy.port).render_as_string(hide_password=False)
        env = {"PREDICTION_MODELS": json.dumps([MODEL]), "PREDICTION_MODEL_NAME": MODEL,
               "PREDICTION_METRICS_PORT": str(free_port()), "PREDICTION_HEALTH_INTERVAL_MS": "500",
               "PREDICTION_INFERENCE_TIMEOUT_MS": "3000", "PREDICTION_LEDGER_TIMEOUT_MS": "2000",
               "PREDICTION_CRM_TIMEOUT_MS": "500", "PREDICTION_RELAY_BACKOFF_MAX_MS": "250",
               "PREDICTION_CACHE_BACKEND": "redis", "PREDICTION_REDIS_KEY_PREFIX": prefix,
               "PREDICTION_CACHE_FRESH_TTL_S": "1", "PREDICTION_BREAKER_OPEN_MS": "500",
               "PREDICTION_DRIFT_WINDOW_ROWS": "400", "PREDICTION_DRIFT_MIN_ROWS": "200",
               "PREDICTION_DRIFT_INTERVAL_S": "1", "PREDICTION_ENSEMBLES": json.dumps({MODEL: ["1"]})}
        self.pair = pair(workdir, repository, crm_url=crm_url, ledger_url=postgres_url, prediction_env=env,
                         inference_env={"INFERENCE_MODELS": json.dumps([MODEL]), "INFERENCE_VERSION_POLICY": "all",
                                        "INFERENCE_METRICS_PORT": str(free_port())},
                         prediction_replicas=2)
        self.inference = self.pair.inference
        self.inference_proxy = TcpProxy("127.0.0.1", self.inference.port)
        self.predictions: dict[str, Service] = {"stable-a": self.pair.predictions[0], "stable-b": self.pair.predictions[1]}
        for name, version in CANARY_VERSIONS.items():
            overrides = {"PREDICTION_METRICS_PORT": str(free_port()),
                         "PREDICTION_ENSEMBLES": json.dumps({MODEL: [version]}),
                         "PREDICTION_SHADOWS": json.dumps({MODEL: "1"})}
            service = Service("prediction", {**self.pair.prediction.env, **overrides}, free_port(),
                              workdir / f"prediction-{name}.log")
            service.env["PREDICTION_PORT"] = str(service.port)
            self.predictions[name] = service
        for service in self.predictions.values():
            service.env["PREDICTION_INFERENCE_TARGET"] = f"127.0.0.1:{self.inference_proxy.port}"

    def revision(self, name: str) -> str:
        return "stable" if name.startswith("stable") else name

    def targets(self) -> list[Target]:
        """What Kubernetes discovery would label each process's series with (pod names are made up)."""
        out = [Target("inference", f"127.0.0.1:{self.inference.env['INFERENCE_METRICS_PORT']}",
                      {"namespace": NAMESPACE, "pod": "inference-5d8f7c6b9-x2kq7"})]
        for i, (name, service) in enumerate(self.predictions.items()):
            digest = HASHES[self.revision(name)]
            out.append(Target("prediction", f"127.0.0.1:{service.env['PREDICTION_METRICS_PORT']}",
                              {"namespace": NAMESPACE, "pod": f"prediction-stable-{digest}-p{i}x4z",
                               "rollouts_pod_template_hash": digest}))
        return out

    async def start(self) -> None:
        await self.crm_proxy.start()
        await self.inference_proxy.start()
        await asyncio.to_thread(self.pair.migrate)
        await asyncio.to_thread(self.inference.start)
        await asyncio.gather(*(asyncio.to_thread(s.start) for s in self.predictions.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(s.terminate, 20) for s in self.predictions.values()))
        await asyncio.to_thread(self.inference.terminate, 20)
        await self.crm_proxy.close()
        await self.inference_proxy.close()


class Traffic:
    """Open-loop Predict load: ``rate`` calls a second, each to a replica drawn by ``weights``,
    its attributes from ``source`` (a callable the scenario swaps)."""

    def __init__(self, fleet: Fleet, records: list[dict], run_id: str, rate: float) -> None:
        self.rate = rate
        self.weights: dict[str, float] = {}
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.timeline: Counter[tuple[int, str]] = Counter()  # (second, "sent" or a code) -> calls
        self.phase = "start"
        self._stubs: dict[str, pb_grpc.PredictionServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._fleet = fleet
        self._records = records
        self._fresh_rows = 0
        self.seen: list[dict] = []  # attributes already decided (cache repeats draw from them)
        self.source: Callable[[], dict] = self.fresh
        self._run_id, self._n = run_id, 0
        self._task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()
        self._random = random.Random(20241130)

    def fresh(self) -> dict:
        """A holdout applicant drawn at random (the split's order is not random: a window of
        consecutive applicants would look drifted), its loan amount moved by a fraction of a unit so
        that the row is new to the cache (fallbacks, not stale results, when inference is down). The
        moves run from -2.5 to +2.5 and round again every 5,000 rows, so that they average out
        (moves that only grew added up to +50 before they wrapped)."""
        attributes = dict(self._random.choice(self._records))
        self._fresh_rows += 1
        if attributes.get("Amount") is not None:
            attributes["Amount"] = float(attributes["Amount"]) + ((self._fresh_rows % 5000) - 2500) * 0.001
        if len(self.seen) < 2000:
            self.seen.append(attributes)
        return attributes

    def repeat_or_fresh(self) -> dict:
        return self._random.choice(self.seen) if self._random.random() < 0.5 else self.fresh()

    def drifted(self) -> dict:
        attributes = self.fresh()
        return {**attributes, "Income": None if attributes.get("Income") is None else attributes["Income"] * 3}

    def start(self) -> None:
        for name, service in self._fleet.predictions.items():
            channel = grpc.aio.insecure_channel(service.address)
            self._channels.append(channel)
            self._stubs[name] = pb_grpc.PredictionServiceStub(channel)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._inflight, return_exceptions=True)
        for channel in self._channels:
            await channel.close()

    async def send(self, replica: str, attributes: dict) -> str:
        self._n += 1
        request = pb.PredictRequest(request_id=f"live-{self._run_id}-{self._n}", entity_id=f"e-{self._n % 997}",
                                    model_name=MODEL, attributes=to_attributes(attributes))
        self.timeline[int(time.time()), "sent"] += 1
        try:
            await self._stubs[replica].Predict(request, timeout=8)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        self.outcomes[self.phase, code] += 1
        self.timeline[int(time.time()), code] += 1
        return code

    async def burst(self, applications: list[dict], rate: float) -> None:
        """Sends ``applications`` at ``rate`` a second, over the replicas that take traffic."""
        for attributes in applications:
            self._spawn(self._pick(), attributes)
            await asyncio.sleep(1 / rate)

    def _pick(self) -> str:
        names = [n for n, w in self.weights.items() if w > 0]
        return self._random.choices(names, [self.weights[n] for n in names])[0]

    def _spawn(self, replica: str, attributes: dict) -> None:
        if len(self._inflight) > 400:  # bounded: a stalled service must not grow the client without end
            self.outcomes[self.phase, "CLIENT_SHED"] += 1
            return
        task = asyncio.create_task(self.send(replica, attributes))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += 1 / self.rate
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if self.weights:
                self._spawn(self._pick(), self.source())
