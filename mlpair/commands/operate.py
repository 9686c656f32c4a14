"""``mlpair drift-report`` and ``mlpair demo``: watching a running PredictionService, and the whole
job end to end on real data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DRIFT_NO_VERDICT = 3  # `mlpair drift-report`: no family has enough decisions for a verdict yet


def drift_report(args: argparse.Namespace) -> int:
    """``mlpair drift-report``: the drift tests a PredictionService exports on its metrics port.

    The exit status comes from the families with a verdict; one with no traffic, or with too few
    decisions, is reported as such and does not hide another's verdict.

    Returns:
        0 when every family with a verdict has no drift, 2 when any has drift,
        :data:`DRIFT_NO_VERDICT` when no family has a verdict (none has enough decisions, or no
        monitor reported), 1 when the metrics endpoint cannot be read.
    """
    import urllib.request

    from mlpair.prediction.monitoring.drift_report import render, reports_from_metrics, to_json

    try:
        with urllib.request.urlopen(args.metrics_url, timeout=args.timeout_s) as reply:
            text = reply.read().decode()
    except OSError as exc:
        print(f"mlpair: cannot read {args.metrics_url}: {exc}", file=sys.stderr)
        return 1
    reports = reports_from_metrics(text)
    if args.json:
        print(to_json(reports))
    else:
        print(render(reports))
    judged = [r for r in reports if r.judged]
    if not judged:
        return DRIFT_NO_VERDICT
    return 2 if any(r.drifted for r in judged) else 0


def demo(args: argparse.Namespace) -> int:
    """``mlpair demo``: :func:`mlpair.demo.run_demo`; 0 only if everything succeeded and every target was met."""
    from mlpair.demo import run_demo

    return run_demo(
        Path(args.model_repository), Path(args.workdir), Path(args.config_dir), concurrency=args.concurrency
    )
