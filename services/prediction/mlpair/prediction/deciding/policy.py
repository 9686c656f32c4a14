"""Decision policy: calibrated probability (and ensemble spread) → decision with business reasons.

Each model family has its own versioned file, ``config/<model_name>/policy.toml``, naming its
own decisions (APPROVE / REVIEW / DECLINE for credit, NO_ACTION / RETAIN_OFFER for churn).
"""

from __future__ import annotations

import bisect
import functools
import tomllib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from mlpair.contracts.schema import reason_prefix

# Decision labels and reason codes are stable machine-readable identifiers; 32 characters is
# also the width of the CRM's decision column.
Label = Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Z0-9_]{0,31}$")]
Code = Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Z0-9_]{0,63}$")]


# How a row is routed: by its band, or overridden by scarce data or ensemble disagreement.
ROUTE_BAND, ROUTE_INSUFFICIENT_DATA, ROUTE_UNCERTAIN = 0, 1, 2


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Band(_Frozen):
    """One decision band: probabilities from ``min_probability`` up to the next band's."""

    decision: Label
    min_probability: float = Field(ge=0, le=1)
    reason_code: Code
    description: str = ""
    """The reason in business language, for people reading the decision."""


class InsufficientData(_Frozen):
    """Where too much of the record was missing to decide automatically.

    When more than ``max_defaulted_fraction`` of the schema's features took their default
    (missing or a sentinel), ``decision`` overrides the band and ``reason_code`` is added: a
    record with next to no data must not be approved or declined on the training averages.
    """

    max_defaulted_fraction: float = Field(ge=0, lt=1)
    decision: Label
    reason_code: Code = "INSUFFICIENT_DATA"
    description: str = ""


class AttributeGroup(_Frozen):
    """At most ``max_missing`` of ``attributes`` may be missing for an automatic decision."""

    attributes: tuple[str, ...] = Field(min_length=1)
    max_missing: int = Field(ge=0)
    reason_code: Code
    description: str = ""


class MissingData(_Frozen):
    """Attributes a decision cannot do without, whatever the model makes of their defaults.

    An attribute is missing when it took its schema default: absent, null, NaN, an empty string,
    a category's missing spelling or one of the schema's sentinels. Each ``required`` attribute
    missing breaks the rule with reason code ``<ATTRIBUTE>_REQUIRED_MISSING``
    (``INCOME_REQUIRED_MISSING``); a group with more than ``max_missing`` of its attributes
    missing breaks it with the group's ``reason_code``. ``action`` says what a broken rule does:
    ``review`` makes ``decision`` with those codes first (before the band's); ``refuse`` refuses
    the request (INVALID_ARGUMENT, reason ``REQUIRED_ATTRIBUTE_MISSING``), nothing decided or recorded.
    """

    action: Literal["review", "refuse"] = "review"
    decision: Label = "REVIEW"
    required: tuple[str, ...] = ()
    groups: tuple[AttributeGroup, ...] = ()
    description: str = ""

    @property
    def attributes(self) -> frozenset[str]:
        """Every attribute the rule names."""
        return frozenset(self.required).union(*(g.attributes for g in self.groups))

    def reason_codes(self, missing: Collection[str]) -> tuple[str, ...]:
        """The codes of what ``missing`` (names of attributes that took their default) breaks, in
        file order: required attributes, then groups; empty when the rule holds."""
        if not missing:
            return ()
        codes = [self._codes[name] for name in self.required if name in missing]
        codes += [g.reason_code for g in self.groups if sum(a in missing for a in g.attributes) > g.max_missing]
        return tuple(codes)

    @functools.cached_property
    def _codes(self) -> dict[str, str]:
        return {name: f"{reason_prefix(name)}_REQUIRED_MISSING" for name in self.required}


class Uncertainty(_Frozen):
    """Where an ensemble's members disagree too much to decide automatically.

    ``spread`` is max − min of the members' calibrated probabilities; a spread strictly above
    ``max_spread`` overrides the band with ``decision`` and adds ``reason_code``.
    """

    max_spread: float = Field(gt=0, le=1)
    decision: Label
    reason_code: Code
    description: str = ""


@dataclass(frozen=True)
class Decision:
    """The policy's verdict: decision label and reason codes, most important first."""

    decision: str
    reason_codes: tuple[str, ...]
    band: Band
    uncertain: bool = False  # routed by the ensemble spread rather than by the band


class DecisionPolicy(_Frozen):
    """A versioned thresholds file.

    ``comparison`` states how a probability meets a band's lower bound: ``">="`` (default) gives
    p the band with the largest ``min_probability`` ≤ p (lower bound inclusive); ``">"`` the
    band with the largest ``min_probability`` < p (lower bound exclusive; p = 0 gets the first).
    """

    version: str = Field(min_length=1, max_length=64)
    comparison: Literal[">=", ">"] = ">="
    bands: tuple[Band, ...]
    uncertainty: Uncertainty | None = None
    insufficient_data: InsufficientData | None = None
    missing_data: MissingData | None = None
    fallback_decision: Label = "REVIEW"
    """Decision made without model output (inference unavailable and no stale cache entry), with
    reason ``INFERENCE_UNAVAILABLE``: a decision a person makes, never an automatic approval or
    decline (docs/design.md)."""

    @model_validator(mode="after")
    def _ordered_from_zero(self) -> DecisionPolicy:
        starts = [b.min_probability for b in self.bands]
        if not starts or starts[0] != 0.0 or starts != sorted(set(starts)):
            raise ValueError("bands must start at 0 and have strictly increasing min_probability")
        return self

    @classmethod
    def from_toml(cls, path: Path) -> DecisionPolicy:
        """Loads a policy file.

        Raises:
            OSError: unreadable. pydantic.ValidationError: invalid bands or labels.
        """
        with open(path, "rb") as f:
            return cls.model_validate(tomllib.load(f))

    @property
    def decisions(self) -> tuple[str, ...]:
        """Every decision label this policy can return, bands first."""
        labels = [b.decision for b in self.bands]
        if self.uncertainty:
            labels.append(self.uncertainty.decision)
        if self.insufficient_data:
            labels.append(self.insufficient_data.decision)
        if self.missing_data:
            labels.append(self.missing_data.decision)
        labels.append(self.fallback_decision)
        return tuple(dict.fromkeys(labels))

    def band(self, probability: float) -> Band:
        """The band for a probability in [0, 1].

        Raises:
            ValueError: the probability is not finite or outside [0, 1] (never decided on).
        """
        return self.bands[self.verdict_code(probability) // 3]

    def decide(
        self, probability: float, spread: float = 0.0, defaulted_fraction: float = 0.0, missing: Collection[str] = ()
    ) -> Decision:
        """Decision for a calibrated probability, the ensemble spread (0 without an ensemble), the
        fraction of the schema's features that took their default (missing or sentinel) and the
        names of those attributes (``missing``, for :class:`MissingData`). Overrides in order:
        insufficient data, a broken missing-data rule (``review``), ensemble disagreement.

        Raises:
            ValueError: probability, spread or fraction not finite or outside [0, 1].
        """
        code = self.verdict_code(probability, spread, defaulted_fraction)
        return self.missing_override(code, missing) or self.verdict(code // 3, code % 3)

    def missing_override(self, code: int, missing: Collection[str]) -> Decision | None:
        """The decision the ``review`` missing-data rule makes instead of verdict ``code``'s when the
        attributes ``missing`` break it; None when it holds, the policy has none, it refuses instead
        (the request never reaches a decision), or insufficient data already routed the row."""
        rule = self.missing_data
        if rule is None or rule.action != "review" or code % 3 == ROUTE_INSUFFICIENT_DATA:
            return None
        if not (codes := rule.reason_codes(missing)):
            return None
        found = self.verdict(code // 3, code % 3)
        return Decision(rule.decision, (*codes, found.band.reason_code), found.band, found.uncertain)

    def verdict_code(self, probability: float, spread: float = 0.0, defaulted_fraction: float = 0.0) -> int:
        """The verdict before any missing-data rule, as one small integer ``band * 3 + route``: the
        band's index and the route (:data:`ROUTE_BAND`; :data:`ROUTE_INSUFFICIENT_DATA`, which wins;
        :data:`ROUTE_UNCERTAIN`). :meth:`verdict` turns it into the :class:`Decision`; a group's rows
        share a few codes, so deciding many rows looks each code's decision up once.

        Raises:
            ValueError: probability, spread or fraction not finite or outside [0, 1].
        """
        if not 0.0 <= probability <= 1.0:  # also false for NaN
            raise ValueError(f"probability {probability!r} is outside [0, 1]")
        if not 0.0 <= spread <= 1.0:
            raise ValueError(f"spread {spread!r} is outside [0, 1]")
        if not 0.0 <= defaulted_fraction <= 1.0:
            raise ValueError(f"defaulted fraction {defaulted_fraction!r} is outside [0, 1]")
        if self.comparison == ">=":
            band = bisect.bisect_right(self._starts, probability) - 1
        else:
            band = max(bisect.bisect_left(self._starts, probability) - 1, 0)
        scarce, uncertainty = self.insufficient_data, self.uncertainty
        if scarce is not None and defaulted_fraction > scarce.max_defaulted_fraction:
            return band * 3 + ROUTE_INSUFFICIENT_DATA
        if uncertainty is not None and spread > uncertainty.max_spread:
            return band * 3 + ROUTE_UNCERTAIN
        return band * 3 + ROUTE_BAND

    def verdict(self, band: int, route: int) -> Decision:
        """The :class:`Decision` of a band index and route (:meth:`verdict_code`)."""
        found = self._verdicts[band][route]
        if found is None:  # verdict_code routes a row only to a rule the policy has
            raise ValueError(f"policy {self.version!r} has no rule for route {route}")
        return found

    @functools.cached_property
    def _starts(self) -> list[float]:
        return [b.min_probability for b in self.bands]

    @functools.cached_property
    def _verdicts(self) -> tuple[tuple[Decision | None, ...], ...]:
        scarce, uncertain = self.insufficient_data, self.uncertainty
        return tuple(
            (
                Decision(b.decision, (b.reason_code,), b),
                Decision(scarce.decision, (scarce.reason_code, b.reason_code), b) if scarce else None,
                Decision(uncertain.decision, (uncertain.reason_code, b.reason_code), b, True) if uncertain else None,
            )
            for b in self.bands
        )
