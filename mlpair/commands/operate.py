"""``mlpair drift-report`` and ``mlpair demo``: watching a running PredictionService, and the whole
job end to end on real data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DRIFT_NO_VERDICT = 3  # `mlpair drift-report`: some model has too few decisions for a verdict yet


def drift_report(args: argparse.Namespace) -> int:
    """``mlpair drift-report``: the drift tests a PredictionService exports on its metrics port.

    Returns:
        0 no drift, 2 drift, :data:`DRIFT_NO_VERDICT` when some model has too few decisions for a
        verdict (or none reported), 1 when the metrics endpoint cannot be read.
    """
    import urllib.request

    from mlpair.prediction.drift_report import render, reports_from_metrics, to_json

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
    if any(r.drifted for r in reports):
        return 2
    return DRIFT_NO_VERDICT if not reports or not all(r.judged for r in reports) else 0


def demo(args: argparse.Namespace) -> int:
    """``mlpair demo``: :func:`mlpair.demo.run_demo`; 0 only if everything succeeded and every target was met."""
    from mlpair.demo import run_demo

    return run_demo(
        Path(args.model_repository), Path(args.workdir), Path(args.config_dir), concurrency=args.concurrency
    )
