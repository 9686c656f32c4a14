"""A call's items, columnar: what the pipeline knows of each model family's rows, as arrays.

:func:`prepare_items` checks every item (ids, duplicates, model family), assembles each family's
rows into one guarded matrix (:mod:`~mlpair.prediction.preparing.columns`) and fingerprints each request;
an item that fails gets its own error and leaves the batch. What remains of each family is one
:class:`Group`, an immutable value that scoring (:mod:`~mlpair.prediction.scoring.scorer`) and the
decisions (:mod:`~mlpair.prediction.deciding.decisions`) read column by column.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mlpair.contracts.assembly import MISSING_DEFAULTED, SENTINEL_DEFAULTED, ConversionError
from mlpair.prediction import metrics
from mlpair.prediction.deciding.explain import explanation_rows
from mlpair.prediction.errors import InvalidRequest, PredictionError
from mlpair.prediction.families import ModelFamily
from mlpair.prediction.intake.checks import (
    check_id,
    ids_pass,
    missing_required_error,
    unknown_attribute_warnings,
    unknown_attributes_error,
)
from mlpair.prediction.preparing.columns import (
    ACTION_BITS,
    SMALL_BATCH,
    AttributeColumns,
    ColumnAssembler,
    RowGuards,
)
from mlpair.prediction.preparing.idempotency import request_fingerprints

if TYPE_CHECKING:
    from mlpair.prediction.pipeline import PredictInput

DEFAULTED_ACTIONS = frozenset({MISSING_DEFAULTED, SENTINEL_DEFAULTED})  # the value was absent: a default stood in


def defaulted_features(guards: RowGuards) -> frozenset[str]:
    """The schema features of a row that took their default (missing, or a sentinel)."""
    return frozenset(e.feature for e in guards.events if e.action in DEFAULTED_ACTIONS)


@dataclass(frozen=True, eq=False)
class Group:
    """The accepted items of one model family in one call, in request order: what preparing hands
    to scoring (which answers with its own value, :class:`~mlpair.prediction.scoring.scorer.GroupScores`)
    and to deciding, never changed after it is made.

    Attributes:
        family: the family that decides them.
        index: each item's position in the call ``[n]``.
        requests: each item's request.
        vectors: the items' own rows ``[n, n_features] float32``.
        guards: what the guards did to each row.
        fingerprints: each request's SHA-256 (:func:`~mlpair.prediction.preparing.idempotency.request_fingerprint`
            over the values as the family's schema reads them).
        warnings: row → warnings about that request (unknown attributes), for rows with any.
        explained: rows whose request asks for an explanation (each sends 1 + n_schema_features rows).
    """

    family: ModelFamily
    index: list[int]
    requests: list[PredictInput]
    vectors: np.ndarray
    guards: list[RowGuards]
    fingerprints: list[str]
    warnings: dict[int, tuple] = field(default_factory=dict)
    explained: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.index)

    def rows_of(self, k: int) -> np.ndarray:
        """Row ``k``'s rows for inference: ``[1, n_features]``, or with its occlusions when explained."""
        if k in self.explained:
            return explanation_rows(self.family.assembler, self.vectors[k])
        return self.vectors[k : k + 1]

    def n_rows(self, k: int) -> int:
        """How many rows row ``k`` sends to inference."""
        return 1 + self.family.n_schema_features if k in self.explained else 1


def prepare_items(
    requests: Sequence[PredictInput],
    resolve: Callable[[str], ModelFamily],
    columns: Callable[[ModelFamily], ColumnAssembler],
    refuse_unknown: bool,
    outcomes: list,
) -> list[Group]:
    """Checks ids, resolves families and assembles each family's rows; a failing item's error is
    put in ``outcomes`` at its position and the item leaves the batch.

    Args:
        resolve: model name → family (raises :class:`~mlpair.prediction.errors.UnknownModel`).
        columns: family → its :class:`ColumnAssembler`.
        refuse_unknown: refuse requests naming attributes the schema does not know.
    """
    by_family = _families_at_once(requests, resolve) if len(requests) >= SMALL_BATCH else None
    if by_family is None:
        by_family = _families_item_by_item(requests, resolve, outcomes)
    return [
        group
        for family, index in by_family.values()
        if (group := _assemble(family, columns(family), [requests[i] for i in index], index, refuse_unknown, outcomes))
    ]


def prepare_table(
    family: ModelFamily,
    assembler: ColumnAssembler,
    requests: Sequence[PredictInput],
    table: AttributeColumns,
    refuse_unknown: bool,
    outcomes: list,
) -> list[Group]:
    """:func:`prepare_items` for a table of one family's rows whose attribute values are read
    already (``table``: the values of ``assembler.attribute_names``, and which rows hold others):
    the same checks, guards and fingerprints, with no per-row record read. A row whose outcome is
    in ``outcomes`` already (refused by the caller) is left out."""
    request_ids = [r.request_id for r in requests]
    index = list(range(len(requests)))
    if (
        len(set(request_ids)) < len(request_ids)
        or not ids_pass(request_ids)
        or not ids_pass([r.entity_id for r in requests])
    ):
        found = _families_item_by_item(requests, lambda _: family, outcomes)
        index = found[family.name][1] if found else []
    if outcomes.count(None) < len(outcomes):
        index = [i for i in index if outcomes[i] is None]
    if len(index) < len(requests):
        table = _rows_of(table, index)
    group = _assemble(family, assembler, [requests[i] for i in index], index, refuse_unknown, outcomes, table)
    return [group] if group is not None else []


def _rows_of(table: AttributeColumns, index: list[int]) -> AttributeColumns:
    """The rows ``index`` of ``table`` (``others`` renumbered)."""
    others = set(table.others)
    return AttributeColumns(
        table.names,
        [[column[i] for i in index] for column in table.values],
        [k for k, i in enumerate(index) if i in others],
    )


def _families_at_once(
    requests: Sequence[PredictInput], resolve: Callable[[str], ModelFamily]
) -> dict[str, tuple[ModelFamily, list[int]]] | None:
    """Each family's items when every item passes its checks, found with a pass per check over
    the whole call; None when one does not (:func:`_families_item_by_item` then gives each
    failing item its own error, as it would have here)."""
    request_ids = [r.request_id for r in requests]
    if len(set(request_ids)) < len(request_ids) or not ids_pass(request_ids):
        return None
    if not ids_pass([r.entity_id for r in requests]):
        return None
    families = {}
    names = {r.model_name for r in requests}
    for name in names:
        try:
            families[name] = resolve(name)
        except PredictionError:
            return None
    if len(names) == 1:  # one model named throughout (the usual call): every item in order
        family = families[names.pop()]
        return {family.name: (family, list(range(len(requests))))}
    by_family: dict[str, tuple[ModelFamily, list[int]]] = {}
    for index, request in enumerate(requests):
        family = families[request.model_name]
        by_family.setdefault(family.name, (family, []))[1].append(index)
    return by_family


def _families_item_by_item(
    requests: Sequence[PredictInput], resolve: Callable[[str], ModelFamily], outcomes: list
) -> dict[str, tuple[ModelFamily, list[int]]]:
    """Each family's items, checking item by item; a failing item's error goes in ``outcomes``."""
    by_family: dict[str, tuple[ModelFamily, list[int]]] = {}
    seen: set[str] = set()
    for index, request in enumerate(requests):
        try:
            family = resolve(request.model_name)
            check_id("request_id", request.request_id)
            check_id("entity_id", request.entity_id)
            if request.request_id in seen:
                raise InvalidRequest(
                    "request_id appears more than once in this batch", metadata={"field": "request_id"}
                )
            seen.add(request.request_id)
        except PredictionError as exc:
            outcomes[index] = exc
            continue
        by_family.setdefault(family.name, (family, []))[1].append(index)
    return by_family


def _assemble(
    family: ModelFamily,
    assembler: ColumnAssembler,
    requests: list[PredictInput],
    index: list[int],
    refuse_unknown: bool,
    outcomes: list,
    table: AttributeColumns | None = None,
) -> Group | None:
    """The checked items of one family → their :class:`Group` (None when every one is refused);
    ``table``: their attribute values read already (a table's chunk), else read here."""
    if not requests:
        return None
    attributes = [r.attributes for r in requests]
    if table is None and len(requests) >= SMALL_BATCH:
        table = assembler.columns(attributes)  # read once for assembly and fingerprints
    assembled = assembler.assemble(attributes, table)
    refused: dict[int, PredictionError] = {
        k: InvalidRequest(
            f"attribute values cannot be converted: {ConversionError(problems)}",
            metadata={"attributes": ",".join(sorted(problems))},
        )
        for k, problems in assembled.problems.items()
    }
    warnings = {}
    for k, names in assembled.unknown.items():
        if k in refused:
            continue
        metrics.UNKNOWN_ATTRIBUTES.labels(family.name).inc(len(names))
        if refuse_unknown:
            refused[k] = unknown_attributes_error(family, names)
        else:
            warnings[k] = unknown_attribute_warnings(family, names)
    every_guards = None
    if (rule := family.policy.missing_data) is not None and rule.action == "refuse":
        every_guards = assembler.guards(assembled.actions)
        for k, g in enumerate(every_guards):
            if g.defaulted and k not in refused and (codes := rule.reason_codes(defaulted_features(g))):
                refused[k] = missing_required_error(family, rule, defaulted_features(g), codes)
    keep = [k for k in range(len(requests)) if k not in refused] if refused else range(len(requests))
    for k, error in refused.items():
        outcomes[index[k]] = error
    if not keep:
        return None
    actions = assembled.actions[keep] if refused else assembled.actions
    guards = assembler.guards(actions) if every_guards is None else [every_guards[k] for k in keep]
    _count_guards(family, actions, guards)
    name = family.name
    kept = [requests[k] for k in keep]
    renumber = {k: j for j, k in enumerate(keep)} if refused else None
    if table is not None:  # every row's, refused ones too (rare), rather than the columns read again
        every = request_fingerprints(name, [r.entity_id for r in requests], attributes, table, family.reading)
        fingerprints = every if not refused else [every[k] for k in keep]
    else:
        fingerprints = request_fingerprints(
            name, [r.entity_id for r in kept], [r.attributes for r in kept], reading=family.reading
        )
    return Group(
        family,
        [index[k] for k in keep],
        kept,
        assembled.matrix if not refused else assembled.matrix[keep],
        guards,
        fingerprints,
        warnings if renumber is None else {renumber[k]: w for k, w in warnings.items()},
        frozenset(j for j, r in enumerate(kept) if r.explain),
    )


def _count_guards(family: ModelFamily, actions: np.ndarray, guards: list[RowGuards]) -> None:
    """``prediction_feature_guards_total`` per feature and action, one per (row, feature, action):
    from each row's decoded events for a few rows, else a column of guard bits at a time."""
    if len(guards) < SMALL_BATCH:
        for g in guards:
            for event in g.events:
                metrics.labelled(metrics.FEATURE_GUARDS, family.name, event.feature, event.action).inc()
        return
    if not actions.any():
        return
    for k, feat in enumerate(family.schema.features):
        column = actions[:, k]
        if not column.any():
            continue
        for action, bit in ACTION_BITS.items():
            n = int(np.count_nonzero(column & bit))
            if n:
                metrics.labelled(metrics.FEATURE_GUARDS, family.name, feat.name, action).inc(n)
