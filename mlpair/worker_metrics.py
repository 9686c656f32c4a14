"""The supervisor's view of its workers' metrics: prometheus-client's multiprocess files, merged
for ``/metrics`` (:func:`mlpair.workers.serve_metrics`) even when one of them cannot be read."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


class TolerantCollector:
    """prometheus-client's ``MultiProcessCollector`` over ``folder``, less the files it cannot read.

    prometheus-client reads every ``*.db`` file of the folder in one pass and raises on the first
    it cannot parse (an empty file, one cut short, a key that is not its JSON), which makes every
    scrape of the whole pod fail. Here a scrape that raises is redone file by file: each file that
    fails alone is left out, the others are merged as usual, a warning names each such file once,
    and the gauge ``<layer>_metrics_files_unreadable`` (files) says how many were left out of this
    scrape (0 when all were read).
    """

    def __init__(self, layer: str, folder: Path) -> None:
        self.layer, self.folder = layer, folder
        self._reported: set[str] = set()

    def collect(self):
        """The metrics of every readable ``*.db`` file of the folder, merged as prometheus-client's
        multiprocess collector merges them, then the gauge ``<layer>_metrics_files_unreadable``.
        """
        from prometheus_client.core import GaugeMetricFamily
        from prometheus_client.multiprocess import MultiProcessCollector

        files = sorted(str(f) for f in self.folder.glob("*.db"))
        unreadable: list[str] = []
        try:
            metrics = list(MultiProcessCollector.merge(files, accumulate=True))
        except Exception:  # noqa: BLE001 - any parse failure of any file: find which, below
            unreadable = [f for f in files if not _readable(f)]
            readable = [f for f in files if f not in unreadable]
            metrics = list(MultiProcessCollector.merge(readable, accumulate=True))
        for name in sorted(set(unreadable) - self._reported):
            logger.warning("metrics file %s cannot be read (empty or cut short); left out of /metrics", name)
        self._reported |= set(unreadable)
        yield from metrics
        yield GaugeMetricFamily(
            f"{self.layer}_metrics_files_unreadable",
            "Files of the workers' multiprocess metrics folder this scrape could not read and left out.",
            value=len(unreadable),
        )


def _readable(path: str) -> bool:
    """True when prometheus-client reads the metrics file ``path`` whole: every entry and its JSON key
    (a file removed since the folder was listed, as a dead worker's live gauges are, counts as read)."""
    import json

    from prometheus_client.mmap_dict import MmapedDict

    try:
        for key, _, _, _ in MmapedDict.read_all_values_from_file(path):
            json.loads(key)
    except FileNotFoundError:
        return True
    except Exception:  # noqa: BLE001 - struct, Unicode, JSON and "corrupted" errors alike
        return False
    return True
