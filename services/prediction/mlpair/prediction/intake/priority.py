"""Request priorities: online decisions ahead of bulk ones, all the way to InferenceService's batch queue.

Every deciding RPC runs at a priority level, 1 the highest (InferenceService's levels, Triton's
semantics): Predict at ``priority_online`` (1), BatchPredict and PredictColumns at
``priority_bulk`` (2). A caller may ask for another level with the ``x-priority`` metadata key
(an integer): a lower one (a larger number, up to ``priority_levels``) always, a higher one than
its RPC's default only when the operator allows it (``priority_allow_raise``); anything else is
refused INVALID_ARGUMENT before anything is decided.

The level is this module's context variable, set by the servicer for the call; what runs in the
caller's context (the merger's queues, the scoring tasks, the inference coalescer's lanes) reads it
from there: the merger sends queued online Predicts before bulk ones, and the coalescer never merges
rows of different levels into one Infer call, which carries its level as ``InferRequest.priority``.
Work outside any call (shadow comparisons) runs at 0: InferenceService's default level.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from mlpair.prediction.errors import InvalidRequest

PRIORITY_KEY = "x-priority"
"""gRPC metadata key a caller asks for a priority level with (lower case, as HTTP/2 requires)."""

_LEVEL: contextvars.ContextVar[int] = contextvars.ContextVar("mlpair_priority", default=0)


def current() -> int:
    """The running call's priority level, 1 the highest; 0 outside any call (InferenceService's default)."""
    return _LEVEL.get()


def use(level: int) -> None:
    """Sets the running call's priority level (in the current context, so for its tasks too)."""
    _LEVEL.set(level)


@dataclass(frozen=True, slots=True)
class PriorityPolicy:
    """The levels the deciding RPCs run at and what a caller may ask for (see the module docstring).

    Attributes:
        levels: InferenceService's ``priority_levels``: levels 1 … ``levels`` exist.
        online: Predict's level.
        bulk: BatchPredict's and PredictColumns' level.
        allow_raise: whether a caller may ask for a higher level than its RPC's default.
    """

    levels: int = 2
    online: int = 1
    bulk: int = 2
    allow_raise: bool = False

    def enter(self, metadata, default: int) -> int:
        """Sets and returns the running call's level: ``x-priority`` from ``metadata`` when sent, else ``default``.

        Raises:
            InvalidRequest: the value is not an integer, not a defined level (1 … ``levels``), or
                higher (smaller) than ``default`` while raising is not allowed.
        """
        level = default
        for key, value in metadata or ():
            if key.lower() == PRIORITY_KEY:
                level = self._asked(value if isinstance(value, str) else value.decode(errors="replace"), default)
        use(level)
        return level

    def _asked(self, text: str, default: int) -> int:
        shown = text[:24]
        if not text.strip().isdigit() or not 1 <= int(text) <= self.levels:
            raise InvalidRequest(
                f"{PRIORITY_KEY} {shown!r} is not a priority level: send 1 (highest) to {self.levels}",
                metadata={"key": PRIORITY_KEY},
            )
        level = int(text)
        if level < default and not self.allow_raise:
            raise InvalidRequest(
                f"{PRIORITY_KEY} {level} is higher than this call's default level {default}; "
                "a caller may only lower its priority",
                metadata={"key": PRIORITY_KEY},
            )
        return level
