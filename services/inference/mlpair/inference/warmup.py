"""Opening one model version before it serves: verify the entry, start its runtime, warm it up,
record its known-answer self-test. Blocking; :mod:`mlpair.inference.repository` runs it in a thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mlpair.contracts.manifest import ManifestError, ModelEntry, load_entry
from mlpair.inference.errors import ModelLoadFailed
from mlpair.inference.model_health import KnownAnswer
from mlpair.inference.runtimes import Runtime, warmup_batch_sizes
from mlpair.inference.settings import InferenceSettings


def open_version(
    path: Path, factory: Callable[[ModelEntry, InferenceSettings], Runtime], settings: InferenceSettings
) -> tuple[ModelEntry, Runtime, float, KnownAnswer]:
    """Blocking: verifies the entry, starts its runtime, warms it up and records its self-test.

    Warm-up runs zeros at batch 1, each preferred size and max_batch_size, and checks the
    output's shape and finiteness, so the first real requests pay no set-up cost. The
    max_batch_size batch runs three times; the fastest run's milliseconds are returned
    (the first run of a size includes allocations). Then the known-answer self-test is
    recorded (:meth:`KnownAnswer.record`).

    Raises:
        ManifestError, ModelLoadFailed, or what the runtime raises.
    """
    entry = load_entry(path)
    if path.parent.name != entry.manifest.model_name:
        raise ManifestError(
            f"{path}: folder is model {path.parent.name!r} but the manifest says {entry.manifest.model_name!r}"
        )
    runtime = factory(entry, settings)
    n_features, n_classes = entry.manifest.n_features, len(entry.manifest.class_names)
    max_rows = settings.max_batch_size
    max_batch_ms = float("inf")
    for rows in [*warmup_batch_sizes(settings), max_rows, max_rows]:
        started = time.perf_counter()
        logits = runtime.run(np.zeros((rows, n_features), dtype=np.float32))
        if rows == max_rows:
            max_batch_ms = min(max_batch_ms, (time.perf_counter() - started) * 1000)
        if not isinstance(logits, np.ndarray) or logits.shape != (rows, n_classes) or not np.isfinite(logits).all():
            raise ModelLoadFailed(
                f"warm-up at batch {rows} returned unusable logits "
                f"(shape {getattr(logits, 'shape', None)}, expected {(rows, n_classes)})"
            )
    known = KnownAnswer.record(runtime.run, n_features, max_rows, settings.self_test_atol, settings.self_test_rtol)
    return entry, runtime, max_batch_ms, known
