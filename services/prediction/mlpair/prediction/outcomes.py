"""What a call asks for and what each of its items gets, in domain terms.

:class:`PredictInput` is one Predict call or BatchPredict item; :class:`PredictionResult` one
recorded decision and how it was served. A batch's results come back as :class:`Outcomes`, a
sequence in request order whose fresh decisions stay in their columns
(:class:`~mlpair.prediction.deciding.decisions.Decided`) until an item is read: the response is encoded
from the columns (``converters.batch_response``), so a BatchPredict builds no object per item.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, overload

from mlpair.prediction.deciding.explain import Explanation
from mlpair.prediction.errors import PredictionError
from mlpair.prediction.records import StoredDecision

if TYPE_CHECKING:
    from mlpair.prediction.deciding.decisions import Decided


@dataclass(frozen=True, slots=True)
class RequestWarning:
    """Something about a request that did not stop its decision (``UNKNOWN_ATTRIBUTE``,
    ``EXPLANATION_NOT_RECORDED``)."""

    code: str
    field: str
    message: str


class PredictInput(NamedTuple):
    """One Predict call (or BatchPredict item) in domain terms; values are float, str, bool or None.

    Immutable like a frozen dataclass, and a named tuple because a BatchPredict makes one per
    item, and a named tuple is cheaper to make than a frozen dataclass (docs/decisions/0005).
    """

    request_id: str
    entity_id: str
    attributes: Mapping[str, Any]
    model_name: str = ""
    explain: bool = False
    deadline: float | None = None  # the caller's deadline in time.monotonic() seconds; None = none
    caller: str = ""  # who asked, as intake established it (intake/callers.py); "" = not established


@dataclass(frozen=True)
class PredictionResult:
    """A recorded decision plus how it was served.

    ``spread`` and ``calibration_method`` describe a fresh decision; a replayed one (a request id
    already on record, by any replica) carries only what was recorded, and, asked to explain, the
    explanation computed now when it explains the recorded decision (the same model version, the
    same probability), else the warning ``EXPLANATION_NOT_RECORDED``.
    """

    stored: StoredDecision
    from_cache: bool = False
    spread: float = 0.0
    calibration_method: str = ""
    explanation: Explanation | None = None
    replayed: bool = False  # the request id was already on record: this is that decision
    warnings: tuple[RequestWarning, ...] = ()  # about this request (not recorded: a replay computes its own)


Outcome: TypeAlias = "PredictionResult | PredictionError"
# a slot of a call in progress: not decided yet (None), an outcome, or row j of a group's fresh decisions
Slot: TypeAlias = "PredictionResult | PredictionError | tuple[Decided, int] | None"


class Outcomes(Sequence[Outcome]):
    """Each item's :class:`PredictionResult` or error, in request order.

    A slot holds a result, an error, or ``(decided, j)``: row ``j`` of a group's fresh decisions,
    turned into a :class:`PredictionResult` the first time it is read.
    """

    __slots__ = ("slots",)

    def __init__(self, slots: list[Slot]) -> None:
        self.slots = slots

    def __len__(self) -> int:
        return len(self.slots)

    @overload
    def __getitem__(self, i: int) -> Outcome: ...

    @overload
    def __getitem__(self, i: slice) -> list[Outcome]: ...

    def __getitem__(self, i: int | slice) -> Outcome | list[Outcome]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        slot = self.slots[i]
        if isinstance(slot, tuple):
            result = self.slots[i] = fresh_result(*slot)
            return result
        if slot is None:
            raise LookupError(f"item {i} of the call was never decided")
        return slot

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Outcomes({list(self)!r})"


def fresh_result(decided: Decided, j: int) -> PredictionResult:
    """Row ``j`` of a group's fresh decisions as a :class:`PredictionResult`."""
    return PredictionResult(
        decided.columns[j],
        from_cache=decided.from_cache[j],
        spread=decided.spread[j],
        calibration_method=decided.calibration_method[j],
        explanation=decided.explanations.get(j),
        warnings=decided.group.warnings.get(decided.rows[j], ()),
    )
