"""A real Prometheus server on loopback for the live observability test, and the rules it runs.

* :func:`prometheus_binary` — ``.venv/bin/prometheus`` (``make test`` fetches it from Debian's
  ``prometheus`` package, as it fetches promtool), or a skip with the reason (a failure under CI).
* :func:`scaled_rules` — the test copy of ``deploy/observability/prometheus/rules.yaml``, generated
  from it: every range selector, every ``for:`` and every threshold on an ``*_age_seconds``
  gauge divided by one factor, so minutes of production time pass in seconds. Ranges keep a floor
  of a few scrape intervals (``rate()`` needs two samples in its range).
* :class:`PrometheusServer` — starts the binary with a scrape configuration (targets with the
  labels Kubernetes service discovery would give the pods), waits for readiness, and wraps the
  HTTP API (``/api/v1/query``, ``query_range``, ``series``, ``alerts``). Ends only its own process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support import REPO_ROOT
from tests.support.pair import free_port

RULES = REPO_ROOT / "deploy" / "observability" / "prometheus" / "rules.yaml"
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000,
            "y": 31_536_000_000}
# `[5m]` and `[5m:1m]`; the duration inside a range selector or subquery.
_RANGE = re.compile(r"\[(\d+(?:ms|s|m|h|d|w|y))(:(\d+(?:ms|s|m|h|d|w|y))?)?\]")
# A duration threshold: an age gauge compared with a number of seconds.
_AGE_THRESHOLD = re.compile(r"(_age_seconds\)?\s*[<>]=?\s*)(\d+(?:\.\d+)?)")


def prometheus_binary() -> Path:
    """The Prometheus server binary; skips (fails under CI=true) when it is not installed."""
    for candidate in (Path(sys.prefix) / "bin" / "prometheus", shutil.which("prometheus")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    message = ("prometheus not found: `make .venv/bin/prometheus` unpacks it from Debian's prometheus package "
               "(deploy/observability/fetch-promtool.sh); the live alert test needs a real server")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{message}: required in CI", pytrace=False)
    pytest.skip(message)


def duration_ms(text: str) -> int:
    """A Prometheus duration (``5m``, ``1h30m``, ``250ms``) in milliseconds."""
    return sum(int(n) * _UNIT_MS[unit] for n, unit in _DURATION.findall(text))


def _ms(value: float) -> str:
    return f"{max(1, round(value))}ms"


def scale_expr(expr: str, factor: float, range_floor_ms: int) -> str:
    """``expr`` with its ranges and age thresholds divided by ``factor``."""
    def scale_range(m: re.Match) -> str:
        scaled = _ms(max(range_floor_ms, duration_ms(m.group(1)) / factor))
        step = f":{_ms(duration_ms(m.group(3)) / factor)}" if m.group(3) else (":" if m.group(2) else "")
        return f"[{scaled}{step}]"

    expr = _RANGE.sub(scale_range, expr)
    return _AGE_THRESHOLD.sub(lambda m: f"{m.group(1)}{float(m.group(2)) / factor:g}", expr)


def scaled_rules(factor: float, range_floor_ms: int, source: Path = RULES) -> dict:
    """The rules file with time compressed ``factor`` times (see the module docstring)."""
    doc = yaml.safe_load(source.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["expr"] = scale_expr(rule["expr"], factor, range_floor_ms)
            if "for" in rule:
                rule["for"] = _ms(duration_ms(rule["for"]) / factor)
    return doc


def production_expr(expr: str, records: dict[str, str]) -> str:
    """``expr`` with every recording rule it names replaced by that rule's own expression, so it
    can be evaluated with production windows on a server that records the scaled ones.

    Raises:
        ValueError: a recorded name is used with label matchers (not supported here).
    """
    for _ in range(5):  # recordings of recordings
        for name, body in records.items():
            pattern = rf"(?<![\w:]){re.escape(name)}(?![\w:])"
            if re.search(pattern + r"\s*\{", expr):
                raise ValueError(f"{name} is used with matchers; inline it by hand")
            expr = re.sub(pattern, lambda _m, b=body: f"({b.strip()})", expr)
    return expr


@dataclass
class Target:
    """One scrape target and the labels Kubernetes discovery would attach to its series."""

    job: str
    address: str
    labels: dict[str, str]


class PrometheusServer:
    """One Prometheus process on 127.0.0.1 with its own configuration and storage."""

    def __init__(self, binary: Path, workdir: Path, rules: dict, targets: list[Target], interval_s: float) -> None:
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
        interval = _ms(interval_s * 1000)
        jobs: dict[str, list[dict]] = {}
        for t in targets:
            jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": t.labels})
        config = {"global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
                  "rule_files": [str(workdir / "rules.yaml")],
                  "scrape_configs": [{"job_name": job, "static_configs": configs} for job, configs in jobs.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))

    def start(self, timeout_s: float = 30.0) -> None:
        with open(self.workdir / "prometheus.log", "w") as log:  # the child holds its own descriptor
            self.process = subprocess.Popen(
                [str(self.binary), f"--config.file={self.workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                 "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus not ready")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def _get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant vector (``[{"metric": {...}, "value": [t, "v"]}]``) at ``at`` (default now)."""
        data = self._get("/api/v1/query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        return self._get("/api/v1/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                         step=f"{step_s:g}")["result"]

    def series(self, selector: str, start: float, end: float) -> list[dict]:
        return self._get("/api/v1/series", **{"match[]": selector, "start": f"{start:.3f}", "end": f"{end:.3f}"})

    def alerts(self) -> list[dict]:
        return self._get("/api/v1/alerts")["alerts"]

    def targets_up(self) -> dict[str, float]:
        return {s["metric"]["instance"]: float(s["value"][1]) for s in self.query("up")}
