"""The gauge constructor both services' ``metrics.py`` declare their gauges with.

Each metric is still declared once, in its service's module, with its whole name, help text and
labels; this holds only what every gauge declaration repeated: how the supervisor combines the
workers' values when ``workers`` > 1 (prometheus-client's multiprocess mode, :mod:`mlpair.workers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from prometheus_client import Gauge

# The multiprocess modes the services' gauges use; ``live*`` modes drop a worker that exited.
WorkerMode = Literal["livemax", "livemin", "livesum", "max"]


def gauge(name: str, documentation: str, labels: Sequence[str] = (), *, workers: WorkerMode = "livemax") -> Gauge:
    """A gauge labelled by ``labels`` whose workers combine by ``workers``: the highest live
    worker's value unless told otherwise (``livemin`` for the lowest, ``livesum`` to add up,
    ``max`` to keep exited workers' values too)."""
    return Gauge(name, documentation, labels, multiprocess_mode=workers)
