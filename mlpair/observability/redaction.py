"""Personal-data redaction for log lines and error details: schema-flagged fields and well-known patterns.

One implementation, one process-wide :data:`PROCESS_REDACTOR`, applied to every log line before
it is written (:mod:`mlpair.logs`) and to every error a client may see, its message and its
ErrorInfo metadata, when the error is made (:class:`mlpair.errors.ServiceError`: gRPC statuses,
BatchPredict item errors, OIP stream errors). Two rules:

1. **Schema-flagged fields.** Attributes a feature schema marks ``personal_data = true``
   (e.g. ``Income``, ``Marital`` for credit-risk) are replaced wherever the line names them:
   as a structured field (``extra={"Income": ...}``, also nested in dicts), or inside text as
   ``Income=4200``, ``Income: 4200``, ``'Income': 4200`` or ``"Income": "4200"``.
2. **Patterns.** Values that look like one of these identifiers are replaced in any string,
   whatever field carries them, each form whole with its check characters:

   * e-mail addresses;
   * national ID numbers: US SSN (``123-45-6789``); Spanish DNI and NIE with their check letter
     (``12345678Z``, ``12345678-Z``, ``X1234567L``); UK National Insurance numbers with their
     suffix letter (``AB 12 34 56 C``); 18-character resident identity numbers, whose check
     character is a digit or ``X`` (``11010519491231002X``, also grouped 6-8-4);
   * IBANs with their two check digits (``ES91 2100 0418 4502 0005 1332``);
   * payment card numbers with their check digit, bare (13–19 digits) or grouped by spaces or
     dashes (``4111 1111 1111 1111``, ``3782 822463 10005``);
   * phone numbers, with or without a country code.

Redaction replaces with a marker naming the kind (``[REDACTED:email]``), never with a hash:
personal values such as an income have so little entropy that a hash is reversible by
enumeration. Patterns are deliberately broad (a bare run of 9–19 digits counts as a possible
phone or ID number); a redacted count in a log line is a smaller harm than a leaked number.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

# ID numbers stand alone or end a longer token: a letter or digit next to one makes it part of a
# larger value (a hash, a version), while "-" and "_" are where callers join an ID to a prefix
# (request ids such as "ssn-123-45-6789" or "app_4111111111111111"), so they bound it.
_NOT_AFTER = r"(?<![A-Za-z0-9])"
_NOT_BEFORE = r"(?![A-Za-z0-9])"
# (kind, pattern, fewest digits). Order matters: specific shapes run before generic digit runs.
# The digit minimum keeps dates (2026-11-30: 8 digits), versions and timings out of "phone".
PATTERNS: tuple[tuple[str, re.Pattern[str], int], ...] = (
    ("email", re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"), 0),
    # US Social Security number, 123-45-6789 (also with spaces).
    ("national_id", re.compile(rf"{_NOT_AFTER}\d{{3}}[- ]\d{{2}}[- ]\d{{4}}{_NOT_BEFORE}"), 0),
    # Spanish DNI (8 digits + check letter) and NIE (X/Y/Z + 7 digits + letter).
    (
        "national_id",
        re.compile(rf"{_NOT_AFTER}(?:\d{{8}}|[XYZxyz]\d{{7}})-?[A-HJ-NP-TV-Za-hj-np-tv-z]{_NOT_BEFORE}"),
        0,
    ),
    # Resident identity number: 17 digits and a check character, a digit or X (ISO 7064 MOD 11-2),
    # also written in groups of 6, 8 and 4 (area, birth date, sequence and check).
    ("national_id", re.compile(rf"{_NOT_AFTER}\d{{6}}( ?)\d{{8}}\1\d{{3}}[\dXx]{_NOT_BEFORE}"), 0),
    # UK National Insurance number, AB 12 34 56 C.
    (
        "national_id",
        re.compile(
            rf"{_NOT_AFTER}[A-CEGHJ-PR-TW-Za-ceghj-pr-tw-z]{{2}} ?\d{{2}} ?\d{{2}} ?\d{{2}} ?[A-Da-d]{_NOT_BEFORE}"
        ),
        0,
    ),
    # IBAN: country code, two check digits, then 11–30 letters and digits, bare or in groups of 4.
    (
        "iban",
        re.compile(
            rf"{_NOT_AFTER}[A-Z]{{2}}\d{{2}}( ?)[A-Z0-9]{{4}}(?:\1[A-Z0-9]{{4}}){{1,6}}(?:\1[A-Z0-9]{{1,4}})?{_NOT_BEFORE}"
        ),
        0,
    ),
    # Payment card numbers grouped by one kind of separator: 4-4-4-4(-3), Amex's 4-6-5, Diners' 4-6-4.
    (
        "card",
        re.compile(
            rf"{_NOT_AFTER}\d{{4}}([ -])(?:\d{{4}}\1\d{{4}}\1\d{{4}}(?:\1\d{{3}})?|\d{{6}}\1\d{{4,5}}){_NOT_BEFORE}"
        ),
        0,
    ),
    # Phone numbers with a country code: +34 612 345 678, +1 (555) 123-4567, +441234567890.
    ("phone", re.compile(r"(?<![\w+])\+\d{1,3}(?:[\s.-]?(?:\(\d{1,4}\)|\d{1,4})){2,5}(?!\w)"), 8),
    # Numbers in groups of 2–4 digits with one kind of separator (phones, card numbers):
    # 612 34 56 78, 555-123-4567, 4111 1111 1111 1111. One separator kind throughout keeps a
    # timestamp's date and time ("2026-11-30 12:00") apart.
    ("phone", re.compile(r"(?<![\w.-])\d{2,4}([ .-])(?:\d{2,4}\1){1,3}\d{2,4}(?![\w.-])"), 9),
    ("phone", re.compile(r"(?<![\w.-])\(\d{2,4}\)\s?\d{2,4}[ .-]\d{2,4}(?![\w.-])"), 9),
    # Bare runs of 9–19 digits (phones up to E.164's 15, card numbers up to 19) not part of a
    # decimal, hex string or word.
    ("number", re.compile(r"(?<![A-Za-z0-9.])\d{9,19}(?![A-Za-z0-9.])"), 0),
)

_VALUE = r"""(?:"[^"]*"|'[^']*'|[^\s,;)}\]]+)"""


class Redactor:
    """Replaces personal data in log messages and structured fields.

    Args:
        personal_fields: attribute names flagged as personal data (matched case-insensitively).
    """

    def __init__(self, personal_fields: Iterable[str] = ()) -> None:
        self._fields: frozenset[str] = frozenset()
        self._field_text: re.Pattern[str] | None = None
        # :meth:`text`, remembered: error details repeat a few texts (a refusal's fixed message)
        # many times under load; emptied whenever the fields change
        self.cached_text = functools.lru_cache(maxsize=1024)(self.text)
        self.add_fields(personal_fields)

    @property
    def fields(self) -> frozenset[str]:
        """The lower-cased personal field names currently redacted."""
        return self._fields

    def add_fields(self, names: Iterable[str]) -> None:
        """Adds schema-flagged field names (e.g. from ``FeatureSchema.personal_data``)."""
        self._fields = self._fields | {n.lower() for n in names}
        if self._fields:
            names_re = "|".join(sorted(map(re.escape, self._fields), key=len, reverse=True))
            # name=value, name: value, 'name': value, "name": value (any case of the name).
            self._field_text = re.compile(rf"""(?i)(?P<key>(?<![\w])["']?(?:{names_re})["']?\s*[:=]\s*){_VALUE}""")
        self.cached_text.cache_clear()

    def text(self, value: str) -> str:
        """``value`` with every personal field value and personal-data pattern replaced."""
        if self._field_text is not None:
            value = self._field_text.sub(lambda m: m.group("key") + "[REDACTED]", value)
        return identifiers(value)

    def value(self, key: str, value: Any) -> Any:
        """A structured field's value, redacted: whole when ``key`` is personal, else by pattern."""
        if key.lower() in self._fields:
            return "[REDACTED]"
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {str(k): self.value(str(k), v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(key, v) for v in value]
        return value


PROCESS_REDACTOR = Redactor()
"""The process's redactor, shared by log lines (:mod:`mlpair.logs`, whose
:func:`~mlpair.logs.add_personal_fields` registers the schema-flagged fields here) and error
details (:class:`mlpair.errors.ServiceError`)."""


def redact(text: str) -> str:
    """``text`` as :data:`PROCESS_REDACTOR` writes it (remembered for the last 1,024 texts)."""
    return PROCESS_REDACTOR.cached_text(text)


@functools.lru_cache(maxsize=1024)
def identifiers(text: str) -> str:
    """``text`` with every documented identifier form (:data:`PATTERNS`) replaced, and nothing else.

    What an error's details may hold: the service writes its messages naming attributes, never
    their values, so only what they repeat of a caller's input (a request id, a model name, a path)
    can be personal; the field rule of :meth:`Redactor.text` (a personal attribute's name followed
    by ``:`` or ``=`` and a value) would blank the service's own words after ``Income:``.
    """
    for kind, pattern, min_digits in PATTERNS:
        text = pattern.sub(_replacer(kind, min_digits), text)
    return text


def _replacer(kind: str, min_digits: int):
    marker = f"[REDACTED:{kind}]"
    if not min_digits:
        return marker

    def replace(match: re.Match[str]) -> str:
        text = match.group(0)
        return marker if sum(c.isdigit() for c in text) >= min_digits else text

    return replace
