"""Intake's checks of a call's items, before anything is prepared: who may be decided here.

:func:`admit` checks each item's ids (present, at most 128 characters, no control or invisible
formatting characters), that no request id repeats within the call, and that its model family is
served, and groups the admitted items by family; an item that fails gets its own error and
leaves the call. Also the refusal of a request id already on record for another payload. Whatever
of a client's input is repeated in a message is cut to ``MAX_ECHO`` characters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from mlpair.prediction.errors import IdempotencyKeyReused, InvalidRequest, PredictionError
from mlpair.prediction.families import ModelFamily
from mlpair.prediction.outcomes import RequestWarning

if TYPE_CHECKING:
    from mlpair.prediction.outcomes import PredictInput

SMALL_CALL = 8  # fewer items than this are checked item by item (a pass per check over the call would cost more)

MAX_ID_LENGTH = 128
MAX_ECHO = 64  # most characters of a client's value repeated in an error
# Never part of an id: C0 and C1 control characters (PostgreSQL cannot store NUL in text), and the
# invisible characters that change how text around them is shown — line and paragraph separators
# (U+2028, U+2029: a new line in a log viewer), bidirectional controls (U+061C, U+200E, U+200F,
# U+202A–U+202E, U+2066–U+2069: "txt.exe" shown as "exe.txt"), zero-width and other format
# characters (U+180E, U+200B–U+200D, U+2060–U+2064, U+FEFF, U+FFF9–U+FFFB, tags U+E0000–U+E007F),
# with which one id could pass for another in a log line or a CRM screen (Unicode Technical
# Report #36, "Unicode Security Considerations", sections 2.4 and 3.5).
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f"
    "\ufeff\ufff9-\ufffb\U000e0000-\U000e007f]"
)


def explanation_not_recorded(decided_at: datetime | None) -> RequestWarning:
    """The warning of a replay asked to explain whose explanation cannot be given: explanations are
    not recorded, and the recorded decision's could not be computed again (:func:`~mlpair.prediction.pipeline.replay_explanation`)."""
    when = f" at {decided_at.isoformat()}" if decided_at is not None else ""
    return RequestWarning(
        "EXPLANATION_NOT_RECORDED",
        "explain",
        f"this request id was decided earlier{when}; explanations are not recorded, and that decision "
        "cannot be explained again now (another model version serves, or it was made without model "
        "output); a new request id gets a new decision with its explanation",
    )


def key_reused(request_id: str) -> IdempotencyKeyReused:
    """The refusal of a request id already on record for another payload."""
    return IdempotencyKeyReused(
        f"request_id {request_id!r} is already on record for another request (model family, entity or "
        "attributes differ); a new decision needs a new request_id",
        metadata={"request_id": request_id},
    )


def check_id(field: str, value: str) -> None:
    """Refuses an empty, over-long or control-character id.

    Raises:
        InvalidRequest: naming the field.
    """
    if not value or not value.strip():
        raise InvalidRequest(f"{field} is required", metadata={"field": field})
    if len(value) > MAX_ID_LENGTH:
        raise InvalidRequest(f"{field} is longer than {MAX_ID_LENGTH} characters", metadata={"field": field})
    if _CONTROL.search(value):
        raise InvalidRequest(f"{field} contains control or invisible formatting characters", metadata={"field": field})


def ids_pass(values: list[str]) -> bool:
    """Whether every id passes :func:`check_id`, checked for the whole list at once (a C-level
    pass per check instead of three per id); False sends the caller to :func:`check_id` per id
    for each one's own error."""
    return (
        all(map(str.strip, values))
        and max(map(len, values), default=0) <= MAX_ID_LENGTH
        and _CONTROL.search("".join(values)) is None
    )


Admitted = dict[str, tuple[ModelFamily, list[int]]]  # family name → (family, its items' positions in the call)


def admit(requests: Sequence[PredictInput], resolve: Callable[[str], ModelFamily], outcomes: list) -> Admitted:
    """The call's items that may be decided, by model family, in request order; a failing
    item's error is put in ``outcomes`` at its position.

    Args:
        resolve: model name → family (raises :class:`~mlpair.prediction.errors.UnknownModel`).
    """
    by_family = _every_item_admitted(requests, resolve) if len(requests) >= SMALL_CALL else None
    return by_family if by_family is not None else _admit_item_by_item(requests, resolve, outcomes)


def _every_item_admitted(requests: Sequence[PredictInput], resolve: Callable[[str], ModelFamily]) -> Admitted | None:
    """Each family's items when every item passes its checks, found with a pass per check over
    the whole call; None when one does not (:func:`_admit_item_by_item` then gives each
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
    by_family: Admitted = {}
    for index, request in enumerate(requests):
        family = families[request.model_name]
        by_family.setdefault(family.name, (family, []))[1].append(index)
    return by_family


def _admit_item_by_item(
    requests: Sequence[PredictInput], resolve: Callable[[str], ModelFamily], outcomes: list
) -> Admitted:
    """Each family's items, checking item by item; a failing item's error goes in ``outcomes``."""
    by_family: Admitted = {}
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
