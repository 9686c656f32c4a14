"""The live scenario: faults injected into the running fleet, alerts followed through Prometheus.

Each phase starts its faults, waits until every alert it expects is firing (or its deadline),
removes the faults and waits until those alerts have resolved. A poller reads
``/api/v1/alerts`` twice per evaluation interval throughout, so every alert's pending time
(``activeAt``), first firing and resolution are known, and any alert active outside the phases
that allow it is recorded as a violation.

Phases (production durations compressed :data:`TIME_FACTOR` times by the test copy of the rules):

1. canary: holdout replay and steady load over two stable replicas and two canaries; the
   degraded canary's disagreement with the stable version alerts; the canary analysis is measured;
   the canaries are retired.
2. inference killed (SIGKILL): fallbacks, the breaker opens, cache repeats are served stale.
3. CRM cut, income x 3 and 200 ms added each way on the Infer hop, together: the backlog and relay
   alerts, the per-process and fleet drift alerts, the latency burn.
4. probing: near-identical applications scored just below 0.25.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from datetime import datetime

from tests.observability.live_fleet import Fleet, Traffic
from tests.observability.prometheus_server import PrometheusServer

TIME_FACTOR = 120  # production minutes pass in half-seconds
SCRAPE_S = 1.0
RANGE_FLOOR_MS = 4000  # rate() over at least four scrapes


@dataclass(frozen=True)
class Expect:
    """An alert a phase must raise: its name and labels it must carry."""

    alert: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, alert: dict) -> bool:
        return alert["labels"]["alertname"] == self.alert and all(
            alert["labels"].get(k) == v for k, v in self.labels)

    def __str__(self) -> str:
        return self.alert + ("{" + ", ".join(f"{k}={v}" for k, v in self.labels) + "}" if self.labels else "")


@dataclass
class Seen:
    """One alert instance (name and labels) as the poller saw it."""

    labels: dict
    active_at: float  # when it went pending (Prometheus's activeAt), epoch seconds
    firing_at: float | None = None  # first poll that saw it firing
    last_seen: float = 0.0
    resolved_at: float | None = None  # first poll that no longer saw it


@dataclass
class PhaseRecord:
    name: str
    expected: list[Expect]
    allowed: list[Expect]
    started: float = 0.0  # faults on (epoch seconds)
    recovered: float = 0.0  # faults off
    ended: float = 0.0


@dataclass
class AlertLog:
    """Every alert instance seen (an alert that resolves and fires again is a new instance), and
    the violations: alerts firing where no phase allows them."""

    history: list[Seen] = field(default_factory=list)
    current: dict[tuple, Seen] = field(default_factory=dict)  # by labels, while active
    violations: list[str] = field(default_factory=list)

    def instances(self, expect: Expect) -> list[Seen]:
        return [s for s in self.history if expect.matches({"labels": s.labels})]


def _epoch(stamp: str) -> float:
    """An RFC 3339 time as Prometheus writes it (nanoseconds, Z or an offset), in epoch seconds."""
    m = re.match(r"(.*T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", stamp)
    base = datetime.fromisoformat(m.group(1) + m.group(3).replace("Z", "+00:00"))
    return base.timestamp() + float(m.group(2) or 0)


async def follow_alerts(prometheus: PrometheusServer, log: AlertLog, allowed: list[Expect],
                        interval_s: float) -> None:
    """Polls Prometheus's active alerts until cancelled; ``allowed`` is read live (the phases
    extend it). An alert firing where no phase allows or expects it is a violation."""
    while True:
        now = time.time()
        active = await asyncio.to_thread(prometheus.alerts)
        keys = set()
        for alert in active:
            key = tuple(sorted(alert["labels"].items()))
            keys.add(key)
            seen = log.current.get(key)
            if seen is None:
                seen = log.current[key] = Seen(dict(alert["labels"]), _epoch(alert["activeAt"]))
                log.history.append(seen)
            if alert["state"] == "firing" and seen.firing_at is None:
                seen.firing_at = now
            seen.last_seen = now
            # A pending blip (one failed scrape on a starved machine) pages nobody: only firing counts.
            if alert["state"] == "firing" and not any(e.matches(alert) for e in allowed):
                log.violations.append(f"{time.strftime('%H:%M:%S', time.localtime(now))} {alert['state']} "
                                      f"{alert['labels']['alertname']} {alert['labels']}")
        for key in [k for k in log.current if k not in keys]:
            log.current.pop(key).resolved_at = now
        await asyncio.sleep(interval_s)


async def wait_for(log: AlertLog, expected: list[Expect], firing: bool, timeout_s: float) -> bool:
    """Until every expected alert is firing (``firing``) or none is active any more."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        def done(e: Expect) -> bool:
            instances = log.instances(e)
            if firing:
                return any(s.firing_at is not None and s.resolved_at is None for s in instances)
            return all(s.resolved_at is not None for s in instances)
        if all(done(e) for e in expected):
            return True
        await asyncio.sleep(0.25)
    return False


@dataclass
class Scenario:
    """What one run drives and keeps: the fleet, its traffic, Prometheus and the alert log."""

    fleet: Fleet
    traffic: Traffic
    prometheus: PrometheusServer
    log: AlertLog = field(default_factory=AlertLog)
    allowed: list[Expect] = field(default_factory=list)
    phases: list[PhaseRecord] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # named instants for later queries
    replay: object = None  # the holdout replay's outcome (mlpair.demo.Replay)
    analysis: dict = field(default_factory=dict)  # canary -> its first analysis measurements

    async def phase(self, record: PhaseRecord, faults_on, faults_off, fire_timeout_s: float = 75.0,
                    resolve_timeout_s: float = 60.0) -> None:
        """Runs one phase: faults on, expected alerts firing, faults off, expected alerts resolved."""
        self.phases.append(record)
        self.traffic.phase = record.name
        self.allowed.extend(record.expected + record.allowed)
        record.started = time.time()
        await faults_on()
        await wait_for(self.log, record.expected, True, fire_timeout_s)
        record.recovered = time.time()
        await faults_off()
        await wait_for(self.log, record.expected, False, resolve_timeout_s)
        record.ended = time.time()
        for expect in record.expected:  # resolved: from now on it is a violation again
            if expect in self.allowed and expect not in record.allowed:
                self.allowed.remove(expect)
