"""Logging set-up, called only from a service's ``main()``: readable text or JSON lines."""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    """One JSON object per line with time, level, logger, message, layer and any traceback."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        self.layer = layer

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": self.formatTime(record), "level": record.levelname, "logger": record.name,
                "layer": self.layer, "message": record.getMessage()}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(layer: str, level: str = "INFO", fmt: str = "text") -> None:
    """Sends logs to stderr in ``fmt`` ("text" or "json"), tagging each with the ``layer``."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(layer))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {layer} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
