"""What scoring hands back: the logits of a call's rows as one matrix, and how each row was served.

InferenceService answers a call with logits ``[rows, n_classes] float32``; they stay one matrix
(:class:`ScoredRows`) from the cache's answer through calibration, never split into rows and
stacked again. Beside it, per row, where the logits came from (:class:`Source`), the model version,
a cached entry's age and why inference was not used.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, overload

import numpy as np


class Source(enum.StrEnum):
    """Where the logits behind a decision came from (stored with the decision as ``served_from``)."""

    INFERENCE = "inference"
    CACHE = "cache"
    STALE_CACHE = "stale_cache"
    FALLBACK = "fallback"


class Scored(NamedTuple):
    """Logits for one row and how they were obtained (a named tuple: a BatchPredict makes one
    per row, and it is cheaper to make than a frozen dataclass).

    Attributes:
        logits: ``[n_classes] float32``, or None when no model output is available (FALLBACK).
        model_version: version that produced the logits ("" for FALLBACK).
        source: where they came from.
        age_ms: age of a cached entry in milliseconds (0 for INFERENCE and FALLBACK).
        degraded_reason: why inference was not used (``INFERENCE_UNAVAILABLE``,
            ``INFERENCE_TIMEOUT``, ``CIRCUIT_OPEN``) for STALE_CACHE and FALLBACK, else "".
    """

    logits: np.ndarray | None
    model_version: str
    source: Source
    age_ms: int = 0
    degraded_reason: str = ""


@dataclass(frozen=True, eq=False)
class ScoredRows(Sequence[Scored]):
    """``n`` rows scored: their logits as one matrix, and how each row was served, column by column.

    Attributes:
        logits: ``[n, n_classes] float32``; a row without usable output (FALLBACK, a row error,
            logits of another width) is all NaN, so per-row calibration marks it, and it alone, unusable.
        sources, model_versions, age_ms, degraded_reasons: per row, as :class:`Scored`'s fields.

    As a sequence, row ``i`` reads as a :class:`Scored` whose logits are a view of the matrix.
    """

    logits: np.ndarray
    sources: list[Source]
    model_versions: list[str]
    age_ms: list[int]
    degraded_reasons: list[str]

    @classmethod
    def of(cls, rows: Sequence[Scored], n_classes: int) -> ScoredRows:
        """Rows scored one by one (cache entries, a test's rows) as one :class:`ScoredRows`;
        logits of any shape but ``[n_classes]`` become a NaN row."""
        logits = np.full((len(rows), n_classes), np.nan, dtype=np.float32)
        for i, r in enumerate(rows):
            if r.logits is not None and r.logits.shape == (n_classes,):
                logits[i] = r.logits
        return cls(
            logits,
            [r.source for r in rows],
            [r.model_version for r in rows],
            [r.age_ms for r in rows],
            [r.degraded_reason for r in rows],
        )

    @classmethod
    def concat(cls, parts: Sequence[ScoredRows]) -> ScoredRows:
        """The rows of ``parts`` one after another, as one :class:`ScoredRows` (logits of one width)."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            np.concatenate([p.logits for p in parts]),
            [s for p in parts for s in p.sources],
            [v for p in parts for v in p.model_versions],
            [a for p in parts for a in p.age_ms],
            [r for p in parts for r in p.degraded_reasons],
        )

    def __len__(self) -> int:
        return len(self.sources)

    def row(self, i: int) -> Scored:
        """How row ``i`` was served (its logits None for FALLBACK)."""
        source = self.sources[i]
        logits = None if source is Source.FALLBACK else self.logits[i]
        return Scored(logits, self.model_versions[i], source, self.age_ms[i], self.degraded_reasons[i])

    @overload
    def __getitem__(self, i: int) -> Scored: ...

    @overload
    def __getitem__(self, i: slice) -> list[Scored]: ...

    def __getitem__(self, i: int | slice) -> Scored | list[Scored]:
        if isinstance(i, slice):
            return [self.row(k) for k in range(*i.indices(len(self)))]
        return self.row(i if i >= 0 else len(self) + i)
