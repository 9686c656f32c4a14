"""Shadow comparison queue: many decisions' rows share a call, a burst is bounded by rows, not tasks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
from prometheus_client import REGISTRY

from mlpair.prediction.deciding.policy import DecisionPolicy
from mlpair.prediction.monitoring import shadow as shadow_module
from mlpair.prediction.monitoring.shadow import ServedRow, ShadowComparison
from tests.support import CONFIG_DIR


class Margin:
    """Calibrator stand-in: margin = logit 1 - logit 0, probability = sigmoid(margin)."""

    method = "none"

    @staticmethod
    def margins(logits: np.ndarray) -> np.ndarray:
        return logits[:, 1] - logits[:, 0]

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        return 1 / (1 + np.exp(-self.margins(logits)))


def family(name: str):
    policy = DecisionPolicy.from_toml(CONFIG_DIR / "credit-risk" / "policy.toml")
    return SimpleNamespace(name=name, policy=policy, members=[SimpleNamespace(version="3")],
                           shadow=SimpleNamespace(version="2", calibrator=Margin()))


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def rows(n: int) -> list[ServedRow]:
    return [ServedRow(np.full(4, i, dtype=np.float32), 0.0, "APPROVE") for i in range(n)]


async def test_concurrent_decisions_share_shadow_calls_and_every_row_is_compared():
    calls = []

    async def infer(fam, version, features):
        calls.append(len(features))
        await asyncio.sleep(0.01)
        return np.zeros((len(features), 2), dtype=np.float32), version.version  # margin 0: p = 0.5

    fam = family("shadow-queue")
    labels = {"model": fam.name, "primary_version": "3", "shadow_version": "2"}
    comparison = ShadowComparison(infer, max_rows=64)
    for _ in range(200):  # 200 single-row decisions in one burst, more than any task bound
        comparison.start(fam, rows(1))
    await comparison.drain()
    assert sum(calls) == 200
    assert len(calls) <= 5  # the first call takes one row; the rest wait for it and go together
    assert max(calls) <= 64
    assert metric("prediction_shadow_logit_difference_count", **labels) == 200
    compared = sum(metric("prediction_shadow_decisions_total", **labels, agreement=a) for a in ("agree", "disagree"))
    assert compared == 200


async def test_rows_past_the_queue_bound_are_skipped_and_counted(monkeypatch):
    monkeypatch.setattr(shadow_module, "MAX_PENDING_ROWS", 50)
    release = asyncio.Event()

    async def infer(fam, version, features):
        await release.wait()
        return np.zeros((len(features), 2), dtype=np.float32), version.version

    fam = family("shadow-bound")
    comparison = ShadowComparison(infer, max_rows=1000)
    comparison.start(fam, rows(30))
    comparison.start(fam, rows(30))  # only 20 fit
    release.set()
    await comparison.drain()
    assert metric("prediction_shadow_failures_total", model=fam.name, shadow_version="2", cause="skipped_busy") == 10
    assert metric("prediction_shadow_logit_difference_count", model=fam.name, primary_version="3",
                  shadow_version="2") == 50


async def test_a_failed_shadow_call_counts_each_of_its_rows():
    async def infer(fam, version, features):
        raise RuntimeError("down")

    fam = family("shadow-failing")
    comparison = ShadowComparison(infer, max_rows=1000)
    comparison.start(fam, rows(7))
    await comparison.drain()
    assert metric("prediction_shadow_failures_total", model=fam.name, shadow_version="2", cause="unexpected") == 7
