"""What PredictionService checks of a request before deciding it, and what it tells the caller.

Ids (present, at most 128 characters, no control or invisible formatting characters), attributes
the feature schema does not know (named in the response's warnings, or refused when the service is strict), and
the refusal of a request id already on record for another payload. Whatever of a client's
input is repeated in a message is cut to ``MAX_ECHO`` characters.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from mlpair.prediction.deciding.policy import MissingData
from mlpair.prediction.errors import IdempotencyKeyReused, InvalidRequest, MissingRequiredAttribute, UnknownAttribute
from mlpair.prediction.families import ModelFamily

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


@dataclass(frozen=True, slots=True)
class RequestWarning:
    """Something about a request that did not stop its decision (``UNKNOWN_ATTRIBUTE``)."""

    code: str
    field: str
    message: str


MAX_WARNINGS = 16  # attributes named one by one; the rest in one more warning


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
