"""Scoring a call's groups: their rows packed into InferenceService calls, calibrated per row.

Each group's rows (an explained item's occlusions next to its own row) are packed, in order and
without splitting an item, into calls of at most ``max_rows`` rows per model version; every member
of an ensemble scores the same matrix, and its logits come back as one matrix ``[rows, n_classes]
float32`` (:class:`~.rows.ScoredRows`) that is calibrated as it is. Calibration is row-wise: a row whose output is unusable (a
non-finite logit, a probability outside [0, 1]) is marked so alone, and every other row of the same
call is calibrated exactly as if it had been sent alone. A call that fails gives its error to the
items whose rows it carried, and to no others. Scoring reads each prepared
:class:`~mlpair.prediction.preparing.batch.Group` and answers with a :class:`GroupScores` of its own.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from mlpair.contracts.columns import SMALL_BATCH
from mlpair.errors import ServiceError
from mlpair.prediction.errors import CallerLeft, PredictionError
from mlpair.prediction.families import ModelFamily, ModelVersion
from mlpair.prediction.preparing.batch import Group
from mlpair.prediction.scoring.rows import Scored, ScoredRows, Source

if TYPE_CHECKING:
    from mlpair.prediction.intake.merging import MergedCall

logger = logging.getLogger(__name__)

Infer = Callable[[ModelFamily, ModelVersion, np.ndarray, float | None], Awaitable[ScoredRows]]


@dataclass(frozen=True, eq=False)
class GroupScores:
    """How each row of a :class:`~mlpair.prediction.preparing.batch.Group` was scored, row for row.

    Attributes:
        served: per row, how its own row was scored (:class:`~.rows.Scored`); None where the
            row's call failed (see ``errors``).
        probabilities: ``[n_members, n] float64`` calibrated, own rows (0 where not usable).
        usable: ``[n] bool``: every member's output for the row is usable.
        margins: ``[n] float64`` the first member's margin (shadow comparison), 0 where not usable.
        model_versions: per row, the version(s) that scored it ("" where not usable).
        occluded: row → ``[n_members, n_schema_features]`` its occlusions' probabilities (explained
            rows with every occlusion scored).
        errors: row → why it could not be scored (its call's error, or :class:`CallerLeft`).
    """

    served: list[Scored | None]
    probabilities: np.ndarray
    usable: np.ndarray
    margins: np.ndarray
    model_versions: list[str]
    occluded: dict[int, np.ndarray] = field(default_factory=dict)
    errors: dict[int, ServiceError] = field(default_factory=dict)


async def score_groups(
    groups: list[Group], infer: Infer, max_rows: int, callers: Sequence[MergedCall] | None = None
) -> list[GroupScores]:
    """Each group's :class:`GroupScores`, in order, through ``infer`` in calls of at most ``max_rows`` rows.

    ``callers``: when the call's items are separate callers' Predicts decided together
    (:mod:`mlpair.prediction.intake.merging`), each item's caller by position in the call. Each item is
    then scored on its own, in its caller's context and with its own deadline, as if it had been
    sent alone (the inference coalescer still merges the rows into shared Infer calls); a caller
    that leaves cancels its own item's scoring, and the item gets :class:`CallerLeft` (neither
    decided nor recorded)."""
    if callers is not None:
        return await _score_callers(groups, infer, callers)
    every = [_new_scores(group) for group in groups]
    calls = []
    for group, scores in zip(groups, every):
        calls += [_score_chunk(group, scores, start, end, infer) for start, end in pack(group, max_rows)]
    await gather(calls)
    return every


async def _score_callers(groups: list[Group], infer: Infer, callers: Sequence[MergedCall]) -> list[GroupScores]:
    """Each item's row scored in a task of its own, in its caller's context and with its deadline;
    then the rows of a group that were scored calibrated together (calibration is row-wise, so
    each row's probability is the one it would get alone, for far less than a call per row:
    docs/decisions/0006-merged-predicts.md)."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task] = []
    scored: list[tuple[Group, GroupScores, list[list[ScoredRows] | None]]] = []
    for group in groups:
        scores = _new_scores(group)
        answers: list[list[ScoredRows] | None] = [None] * len(group)  # per item, each member's row
        scored.append((group, scores, answers))
        for k, index in enumerate(group.index):
            caller = callers[index]
            if k in group.occlusions:  # an explanation's occlusions are scored and calibrated as one chunk
                item = _score_chunk(group, scores, k, k + 1, infer)
            else:
                item = _score_item(group, scores, k, infer, answers)
            task = loop.create_task(item, context=caller.context)
            caller.future.add_done_callback(functools.partial(_cancel_if_left, task))
            tasks.append(task)
    await asyncio.gather(*tasks, return_exceptions=True)  # a left caller's task ends cancelled
    for group, scores, answers in scored:
        done = [(k, a) for k, a in enumerate(answers) if a is not None]
        if done:
            _calibrate_items(group, scores, [k for k, _ in done], [a for _, a in done])
        for k, index in enumerate(group.index):  # left while the batch was scored: its scoring cancelled
            if callers[index].gone and k not in scores.errors:
                scores.errors[k] = CallerLeft("the caller left before its item was decided")
    return [scores for _, scores, _ in scored]


async def _score_item(
    group: Group, scores: GroupScores, k: int, infer: Infer, answers: list[list[ScoredRows] | None]
) -> None:
    """Scores item ``k``'s own row with every member into ``answers[k]``, or records its error."""
    family = group.family
    try:
        answers[k] = await gather(
            [infer(family, m, group.vectors[k : k + 1], group.requests[k].deadline) for m in family.members]
        )
    except ServiceError as exc:
        scores.errors[k] = exc
    except Exception as exc:  # noqa: BLE001  (one item's failure must not fail the batch)
        scores.errors[k] = as_item_error(exc)


def _calibrate_items(group: Group, scores: GroupScores, items: list[int], answers: list[list[ScoredRows]]) -> None:
    """Calibrates and fills the scored rows of items ``items`` (one row each) together; should
    that fail, item by item, so a failure stays with the item whose row caused it."""
    members = range(len(group.family.members))
    try:
        chunk = _calibrated(group.family, [ScoredRows.concat([a[m] for a in answers]) for m in members])
    except Exception as exc:  # noqa: BLE001  (one item's failure must not fail the batch)
        if len(items) > 1:  # which row caused it: one item at a time
            for k, own in zip(items, answers):
                _calibrate_items(group, scores, [k], [own])
        else:
            scores.errors[items[0]] = exc if isinstance(exc, ServiceError) else as_item_error(exc)
        return
    _fill(scores, items, chunk)


def _cancel_if_left(task: asyncio.Task, future: asyncio.Future) -> None:
    if future.cancelled():
        task.cancel()


def _new_scores(group: Group) -> GroupScores:
    """Scores for ``group`` before any row is scored: nothing served, usable or versioned yet."""
    n, members = len(group), len(group.family.members)
    return GroupScores(
        [None] * n,  # stays None where the row's call fails
        np.zeros((members, n), dtype=np.float64),
        np.zeros(n, dtype=bool),
        np.zeros(n, dtype=np.float64),
        [""] * n,
    )


def pack(group: Group, max_rows: int) -> list[tuple[int, int]]:
    """Greedy, order-keeping packing of the group's items into ``[start, end)`` ranges of at most
    ``max_rows`` rows in total; an item's rows are never split (each has at most ``max_rows``)."""
    n = len(group)
    if not group.occlusions:
        return [(start, min(start + max_rows, n)) for start in range(0, n, max_rows)]
    chunks: list[tuple[int, int]] = []
    start, rows = 0, 0
    for k in range(n):
        size = _n_rows(group, k)
        if k > start and rows + size > max_rows:
            chunks.append((start, k))
            start, rows = k, 0
        rows += size
    chunks.append((start, n))
    return chunks


async def _score_chunk(group: Group, scores: GroupScores, start: int, end: int, infer: Infer) -> None:
    family = group.family
    explained = [k for k in range(start, end) if k in group.occlusions]
    if explained:
        sizes = [_n_rows(group, k) for k in range(start, end)]
        matrix = np.concatenate([_rows_of(group, k) for k in range(start, end)])
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    else:
        sizes, matrix, offsets = None, group.vectors[start:end], range(end - start)
    deadlines = [r.deadline for r in group.requests[start:end] if r.deadline is not None]
    deadline = min(deadlines) if deadlines else None
    try:
        answers: list[ScoredRows] = await gather([infer(family, m, matrix, deadline) for m in family.members])
        chunk = _calibrated(family, answers, offsets, sizes)
    except ServiceError as exc:
        error: ServiceError = exc
    except Exception as exc:  # noqa: BLE001  (one chunk's failure must not fail the batch)
        error = as_item_error(exc)
    else:
        _fill(scores, range(start, end), chunk)
        return
    for k in range(start, end):
        scores.errors[k] = error


def _rows_of(group: Group, k: int) -> np.ndarray:
    """Row ``k``'s rows for inference: ``[1, n_features]``, followed by its occlusions when explained."""
    if k in group.occlusions:
        return np.concatenate([group.vectors[k : k + 1], group.occlusions[k]])
    return group.vectors[k : k + 1]


def _n_rows(group: Group, k: int) -> int:
    """How many rows row ``k`` sends to inference."""
    return 1 + len(group.occlusions[k]) if k in group.occlusions else 1


def _calibrated(
    family: ModelFamily, answers: list[ScoredRows], offsets: Sequence[int] | None = None, sizes: list[int] | None = None
) -> ChunkScores:
    """Every member's logits calibrated row by row (``offsets``: each item's own row, by default
    one row per item).

    Raises:
        InferenceFailed: a member's logits cannot be calibrated at all (malformed tensor).
    """
    calibrated = [m.calibrator.probabilities_per_row(a.logits) for m, a in zip(family.members, answers)]
    probabilities = np.stack([p for p, _ in calibrated])
    usable = np.logical_and.reduce([ok for _, ok in calibrated])  # every member's output usable
    # margins only feed the shadow comparison (unusable rows: zeros, never compared)
    margins = (
        family.members[0].calibrator.margins(np.where(usable[:, None], answers[0].logits, np.float32(0.0)))
        if family.shadow
        else None
    )
    return ChunkScores(
        answers, probabilities, usable, margins, range(len(usable)) if offsets is None else offsets, sizes
    )


class ChunkScores(NamedTuple):
    """What was scored for some items of a group (a call's, or merged Predicts' rows), packed as sent."""

    answers: list[ScoredRows]  # per ensemble member, the call's rows as scored
    probabilities: np.ndarray  # [members, rows] float64, calibrated
    usable: np.ndarray  # [rows] bool: every member's output usable
    margins: np.ndarray | None  # [rows] float64, for the shadow comparison only (None without a shadow)
    offsets: Sequence[int]  # per item, the row of its own row in the call
    sizes: list[int] | None  # per item, its rows (own and occluded); None when no item is explained


def _fill(scores: GroupScores, items: Sequence[int], chunk: ChunkScores) -> None:
    """Each item's own row: how it was scored and, where usable, its calibrated probabilities
    (``items``: the group's items ``chunk`` is of, in order: a ``range``, or any list)."""
    if len(items) < SMALL_BATCH:
        _fill_rows(scores, items, chunk)
        return
    answers, probabilities, usable, margins, offsets, sizes = chunk
    single, first = len(answers) == 1, answers[0]
    own = _rows_at(first, offsets) if single else [_served([a.row(o) for a in answers]) for o in offsets]
    at: slice | list[int]
    if isinstance(items, range):
        at = slice(items.start, items.stop)
        scores.served[at] = own
    else:
        at = list(items)
        for k, served in zip(at, own):
            scores.served[k] = served
    rows = np.asarray(offsets, dtype=np.intp) if sizes is not None else slice(0, len(items))
    if single and offsets == range(len(first)) and Source.FALLBACK not in first.sources:  # the usual call
        fallback = np.zeros(len(own), dtype=bool)
    else:
        fallback = np.fromiter((s.source is Source.FALLBACK for s in own), dtype=bool, count=len(own))
    decided = usable[rows] & ~fallback  # fallback first: a row without output is not "invalid"
    scores.usable[at] = decided
    scores.probabilities[:, at] = np.where(decided, probabilities[:, rows], 0.0)
    if margins is not None:
        scores.margins[at] = np.where(decided, margins[rows], 0.0)
    versions = scores.model_versions
    if single and sizes is None:  # one member, nothing explained: only the versions to copy
        if isinstance(at, slice) and offsets == range(len(first)) and decided.all():  # the whole answer, in order
            versions[at] = first.model_versions
            return
        for k, served, ok in zip(items, own, decided.tolist()):
            if ok:
                versions[k] = served.model_version
        return
    for j, (k, o, served, ok) in enumerate(zip(items, offsets, own, decided.tolist())):
        if not ok:
            continue
        versions[k] = served.model_version if single else "+".join(a.model_versions[o] for a in answers)
        n = 1 if sizes is None else sizes[j]
        if n > 1 and usable[o : o + n].all():  # an explanation needs every occluded row scored
            scores.occluded[k] = probabilities[:, o + 1 : o + n]


def _rows_at(answer: ScoredRows, offsets: Sequence[int]) -> list[Scored]:
    """``answer.row(o)`` for each of ``offsets``, its columns looked up once instead of per row."""
    logits, fallback = answer.logits, Source.FALLBACK
    sources, versions, ages, reasons = answer.sources, answer.model_versions, answer.age_ms, answer.degraded_reasons
    if offsets == range(len(answer)):  # every row in order: the columns side by side
        if fallback not in sources:  # no row without logits: each Scored made in C, not by its __new__
            return list(map(tuple.__new__, itertools.repeat(Scored), zip(logits, versions, sources, ages, reasons)))
        return [
            Scored(None if s is fallback else row, v, s, a, r)
            for row, v, s, a, r in zip(logits, versions, sources, ages, reasons)
        ]
    return [
        Scored(None if sources[o] is fallback else logits[o], versions[o], sources[o], ages[o], reasons[o])
        for o in offsets
    ]


def _fill_rows(scores: GroupScores, items: Sequence[int], chunk: ChunkScores) -> None:
    """:func:`_fill` row by row, for chunks too small for NumPy to pay: the same columns, the
    same values (rows left unusable keep the zeros :func:`_new_scores` put there)."""
    answers, probabilities, usable, margins, offsets, sizes = chunk
    single, ok = len(answers) == 1, usable.tolist()
    for j, (k, o) in enumerate(zip(items, offsets)):
        own = [a.row(o) for a in answers]
        served = scores.served[k] = own[0] if single else _served(own)
        if served.source is Source.FALLBACK or not ok[o]:  # fallback first, as in _fill
            continue
        scores.usable[k] = True
        scores.probabilities[:, k] = probabilities[:, o]
        if margins is not None:
            scores.margins[k] = margins[o]
        scores.model_versions[k] = served.model_version if single else "+".join(r.model_version for r in own)
        n = 1 if sizes is None else sizes[j]
        if n > 1 and all(ok[o : o + n]):  # an explanation needs every occluded row scored
            scores.occluded[k] = probabilities[:, o + 1 : o + n]


async def gather(calls: list) -> list:
    """``asyncio.gather`` without its task per call when there is only one (a single Predict)."""
    if len(calls) == 1:
        return [await calls[0]]
    return await asyncio.gather(*calls)


def _served(own: list[Scored]) -> Scored:
    """How an item's own row was scored across ensemble members: fallback if any member has no
    output, stale if any member's is stale, from cache only if all are, else fresh inference."""
    for source in (Source.FALLBACK, Source.STALE_CACHE):
        if found := next((r for r in own if r.source is source), None):
            return found
    return (
        own[0] if all(r.source is Source.CACHE for r in own) else next(r for r in own if r.source is Source.INFERENCE)
    )


class UnexpectedFailure(PredictionError):
    """An unexpected failure while deciding one item; the details are only in the log."""

    code = "INTERNAL"
    reason = "INTERNAL"


def as_item_error(exc: BaseException) -> PredictionError:
    """An item's failure as a client-safe error; anything unexpected is logged and made generic."""
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    if isinstance(exc, PredictionError):
        return exc
    if isinstance(exc, ServiceError):
        return UnexpectedFailure(exc.message)
    logger.error("unexpected failure deciding one item", exc_info=exc)
    return UnexpectedFailure("internal error")
