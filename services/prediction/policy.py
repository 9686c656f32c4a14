"""Decision policy: calibrated probability → decision band with a business reason code."""

from __future__ import annotations

import bisect
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Band(BaseModel):
    """One decision band: probabilities from ``min_probability`` (inclusive) up to the next band."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decision: str
    min_probability: float = Field(ge=0, le=1)
    reason_code: str


class DecisionPolicy(BaseModel):
    """A versioned thresholds file (``config/<model_name>/policy.toml``).

    A probability p gets the band with the largest ``min_probability`` ≤ p (``>=`` comparison).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str
    bands: tuple[Band, ...]

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
            OSError: unreadable. pydantic.ValidationError: invalid bands.
        """
        with open(path, "rb") as f:
            return cls.model_validate(tomllib.load(f))

    def decide(self, probability: float) -> Band:
        """The band for a probability in [0, 1].

        Raises:
            ValueError: the probability is not finite or outside [0, 1] (never decided on).
        """
        if not 0.0 <= probability <= 1.0:  # also false for NaN
            raise ValueError(f"probability {probability!r} is outside [0, 1]")
        starts = [b.min_probability for b in self.bands]
        return self.bands[bisect.bisect_right(starts, probability) - 1]
