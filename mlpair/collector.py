"""Garbage-collector settings for a serving process, applied once it is up (both services).

CPython's cyclic collector runs a full collection over every tracked object now and then, and
a young one every 700 allocations. In a serving process almost everything alive at start-up
(modules, models, gRPC, SQLAlchemy: a few hundred thousand objects) lives until exit, and most
objects a request creates are freed by reference counting before the collector would look at
them. So, once the process is ready:

* ``gc.freeze()`` moves every object alive now into the permanent generation: full
  collections scan only what requests create. Start-up objects are never garbage, so nothing is
  kept that would have been freed.
* Young collections every 10,000 allocations instead of 700.

Full collections over the start-up heap were pauses of the event loop (InferenceService's p99)
and a share of every BatchPredict row's CPU; what freezing and the threshold bought is in
docs/decisions/0003-collector-tuned-once-serving.md.
"""

from __future__ import annotations

import gc

YOUNG_GC_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)


def tune_collector() -> None:
    """Freezes what is alive now and spaces young collections (module docstring). Call once,
    when the service is ready to serve."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, middle, old)
