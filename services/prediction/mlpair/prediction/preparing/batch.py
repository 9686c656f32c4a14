"""Preparing a family's admitted items: their attributes → one guarded matrix, fingerprints and refusals.

:func:`prepare` takes the items of one model family that intake admitted
(:func:`~mlpair.prediction.intake.checks.admit`), assembles their rows into one guarded matrix
(:mod:`~mlpair.contracts.columns`), refuses the items whose attributes cannot be used
(values no conversion rule accepts, attributes the schema does not know when the service is
strict, attributes the policy requires that are missing), names unknown attributes in warnings
otherwise, and fingerprints each request (:mod:`~mlpair.prediction.preparing.idempotency`). A
refused item gets its own error and leaves the call. What remains is one :class:`Group`, an
immutable value that scoring (:mod:`~mlpair.prediction.scoring.scorer`) and the decisions
(:mod:`~mlpair.prediction.deciding.decisions`) read column by column.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from mlpair.contracts.assembly import ConversionError
from mlpair.contracts.columns import ACTION_BITS, SMALL_BATCH, AttributeColumns, ColumnAssembler, RowGuards
from mlpair.prediction import metrics
from mlpair.prediction.errors import InvalidRequest, MissingRequiredAttribute, PredictionError, UnknownAttribute
from mlpair.prediction.families import ModelFamily
from mlpair.prediction.intake.checks import MAX_ECHO
from mlpair.prediction.outcomes import RequestWarning
from mlpair.prediction.preparing.idempotency import request_fingerprints

if TYPE_CHECKING:
    from mlpair.prediction.deciding.policy import MissingData
    from mlpair.prediction.outcomes import PredictInput

MAX_WARNINGS = 16  # attributes named one by one; the rest in one more warning


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
        occlusions: for each row whose request asks for an explanation, its occluded rows
            ``[n_schema_features, n_features] float32`` (sent with the row itself, one row per schema feature
            set to its training default: :meth:`~mlpair.contracts.assembly.FeatureAssembler.occlusions`).
    """

    family: ModelFamily
    index: list[int]
    requests: list[PredictInput]
    vectors: np.ndarray
    guards: list[RowGuards]
    fingerprints: list[str]
    warnings: dict[int, tuple] = field(default_factory=dict)
    occlusions: dict[int, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.index)


def prepare(
    family: ModelFamily,
    assembler: ColumnAssembler,
    requests: Sequence[PredictInput],
    index: list[int],
    refuse_unknown: bool,
    outcomes: list,
    table: AttributeColumns | None = None,
) -> Group | None:
    """The admitted items ``index`` of ``requests``, all of ``family``, as their :class:`Group`
    (None when every one is refused); a refused item's error is put in ``outcomes`` at its position.

    Args:
        assembler: the family's :class:`ColumnAssembler`.
        refuse_unknown: refuse requests naming attributes the schema does not know.
        table: the items' attribute values read already (a table's chunk, rows ``index``), else read here.
    """
    if not index:
        return None
    items = [requests[i] for i in index] if len(index) < len(requests) else list(requests)
    attributes = [r.attributes for r in items]
    if table is None and len(items) >= SMALL_BATCH:
        table = assembler.columns(attributes)  # read once for assembly and fingerprints
    assembled = assembler.assemble(attributes, table)
    every_guards = assembler.guards(assembled.actions)
    refused, warnings = _refusals(family, assembled.problems, assembled.unknown, every_guards, refuse_unknown)
    for k, error in refused.items():
        outcomes[index[k]] = error
    keep = [k for k in range(len(items)) if k not in refused] if refused else range(len(items))
    if not keep:
        return None
    guards = [every_guards[k] for k in keep] if refused else every_guards
    count_guards(assembler, family.name, assembled.actions[keep] if refused else assembled.actions, guards)
    kept = [items[k] for k in keep] if refused else items
    if table is not None:  # every row's, refused ones too (rare), rather than the columns read again
        every = request_fingerprints(family.name, [r.entity_id for r in items], attributes, table, family.reading)
        fingerprints = every if not refused else [every[k] for k in keep]
    else:
        fingerprints = request_fingerprints(
            family.name, [r.entity_id for r in kept], [r.attributes for r in kept], reading=family.reading
        )
    if refused:
        renumber = {k: j for j, k in enumerate(keep)}
        warnings = {renumber[k]: w for k, w in warnings.items()}
    vectors = assembled.matrix if not refused else assembled.matrix[keep]
    occlusions = {j: family.assembler.occlusions(vectors[j]) for j, r in enumerate(kept) if r.explain}
    return Group(family, [index[k] for k in keep], kept, vectors, guards, fingerprints, warnings, occlusions)


def count_guards(assembler: ColumnAssembler, family: str, actions: np.ndarray, guards: list[RowGuards]) -> None:
    """``prediction_feature_guards_total`` per feature and action, one per (row, feature, action)
    of rows with guard bits ``actions`` ``[rows, n_schema_features] uint8`` and their ``guards``:
    from each row's decoded events for a few rows, else a column of guard bits at a time."""
    if len(guards) < SMALL_BATCH:
        for g in guards:
            for event in g.events:
                metrics.labelled(metrics.FEATURE_GUARDS, family, event.feature, event.action).inc()
        return
    if not actions.any():
        return
    for k, feat in enumerate(assembler.features):
        column = actions[:, k]
        if not column.any():
            continue
        for action, bit in ACTION_BITS.items():
            n = int(np.count_nonzero(column & bit))
            if n:
                metrics.labelled(metrics.FEATURE_GUARDS, family, feat.name, action).inc(n)


def rows_of(table: AttributeColumns, index: list[int]) -> AttributeColumns:
    """The rows ``index`` of ``table`` (``others`` renumbered)."""
    others = set(table.others)
    return AttributeColumns(
        table.names,
        [[column[i] for i in index] for column in table.values],
        [k for k, i in enumerate(index) if i in others],
    )


def _refusals(
    family: ModelFamily,
    problems: dict[int, dict[str, str]],
    unknown: dict[int, tuple[str, ...]],
    guards: list[RowGuards],
    refuse_unknown: bool,
) -> tuple[dict[int, PredictionError], dict[int, tuple[RequestWarning, ...]]]:
    """(row → why it is refused, row → warnings about it) of assembled rows: values no conversion
    rule accepts, unknown attributes (refused when ``refuse_unknown``, else warned about), and
    attributes the policy requires that took their default (``[missing_data] action = "refuse"``)."""
    refused: dict[int, PredictionError] = {
        k: InvalidRequest(
            f"attribute values cannot be converted: {ConversionError(found)}",
            metadata={"attributes": ",".join(sorted(found))},
        )
        for k, found in problems.items()
    }
    warnings = {}
    for k, names in unknown.items():
        if k in refused:
            continue
        metrics.UNKNOWN_ATTRIBUTES.labels(family.name).inc(len(names))
        if refuse_unknown:
            refused[k] = unknown_attributes_error(family, names)
        else:
            warnings[k] = unknown_attribute_warnings(family, names)
    if (rule := family.policy.missing_data) is not None and rule.action == "refuse":
        for k, g in enumerate(guards):
            if g.defaulted and k not in refused and (codes := rule.reason_codes(g.defaulted_features)):
                refused[k] = missing_required_error(family, rule, g.defaulted_features, codes)
    return refused, warnings


def unknown_attribute_warnings(family: ModelFamily, names: Sequence[str]) -> tuple[RequestWarning, ...]:
    """One warning per attribute the schema does not know (names cut short), at most ``MAX_WARNINGS`` + 1,
    each naming the schema's closest attribute when one is close (a misspelling, another case)."""
    warnings = [
        RequestWarning(
            "UNKNOWN_ATTRIBUTE",
            name[:MAX_ECHO],
            f"the {family.name!r} feature schema has no attribute of this name; it was ignored"
            + _did_you_mean(name[:MAX_ECHO], family.schema.attribute_names),  # cut first: the cache keeps it
        )
        for name in names[:MAX_WARNINGS]
    ]
    if len(names) > MAX_WARNINGS:
        warnings.append(
            RequestWarning("UNKNOWN_ATTRIBUTE", "", f"and {len(names) - MAX_WARNINGS} more unknown attributes")
        )
    return tuple(warnings)


def unknown_attributes_error(family: ModelFamily, names: Sequence[str]) -> UnknownAttribute:
    """The refusal of a request naming attributes the schema does not know (strict setting), with
    the hint the warning gives: each name followed by the schema's closest attribute when one is
    close (``'Incme' (did you mean 'Income'?)``), and in metadata ``did_you_mean``: the
    ``name=closest`` pairs, comma-separated (absent when no name is close to one)."""
    named = [n[:MAX_ECHO] for n in names[:MAX_WARNINGS]]
    known = family.schema.attribute_names
    shown = ", ".join(repr(n) + _did_you_mean(n, known) for n in named) + (" …" if len(names) > MAX_WARNINGS else "")
    metadata = {"attributes": ",".join(named)}
    if closest := [f"{n}={_closest(n, known)}" for n in named if _closest(n, known)]:
        metadata["did_you_mean"] = ",".join(closest)
    return UnknownAttribute(
        f"the {family.name!r} feature schema has no attribute named {shown}; this service "
        "refuses unknown attributes (PREDICTION_UNKNOWN_ATTRIBUTES=refuse)",
        metadata=metadata,
    )


def missing_required_error(
    family: ModelFamily, rule: MissingData, missing: Collection[str], codes: Sequence[str]
) -> MissingRequiredAttribute:
    """The refusal of a request lacking attributes its family's policy requires (``action = "refuse"``):
    metadata ``attributes`` names the missing attributes the rule names (schema order) and
    ``reason_codes`` the rule's codes the request broke (``INCOME_REQUIRED_MISSING``, a group's code)."""
    named = [n for n in family.schema.attribute_names if n in missing and n in rule.attributes]
    return MissingRequiredAttribute(
        f"the {family.name!r} decision policy ({family.policy.version}) does not decide without "
        f"{', '.join(named)}: send {'it' if len(named) == 1 else 'them'} (absent, null, empty and sentinel values are missing)",
        metadata={"attributes": ",".join(named), "reason_codes": ",".join(codes)},
    )


def _did_you_mean(name: str, known: tuple[str, ...]) -> str:
    """``" (did you mean 'Income'?)"`` for the known attribute closest to ``name``, else ``""``."""
    close = _closest(name, known)
    return f" (did you mean {close!r}?)" if close else ""


@functools.lru_cache(maxsize=1024)  # a batch repeats the same unknown names item after item
def _closest(name: str, known: tuple[str, ...]) -> str:
    """The known attribute closest to ``name`` (difflib's ratio ≥ 0.8 on lower-cased names), else
    ``""``. ``name`` comes from a client: callers cut it to ``MAX_ECHO`` characters, so the cache
    holds no more than that per entry."""
    import difflib

    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.8)
    return lowered[close[0]] if close else ""
