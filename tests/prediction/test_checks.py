"""A whole call's ids checked at once (``ids_pass``) pass exactly when each passes ``check_id``.

BatchPredict checks the ids of a call of eight or more items with one pass per check
(``checks.admit``) and falls back to ``check_id`` per item, for each item's own
error, only when that says no; so the two must agree on every list of ids.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlpair.prediction.errors import InvalidRequest
from mlpair.prediction.intake.checks import MAX_ID_LENGTH, check_id, ids_pass

ids = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["", " ", "\t", "a\x00b", "a\x85", "ok-1", "x" * MAX_ID_LENGTH, "x" * (MAX_ID_LENGTH + 1), "é",
                     "a\u202eb", "a\u2028", "\u200bid", "日本語-id"]),
)


def each_passes(values: list[str]) -> bool:
    for value in values:
        try:
            check_id("request_id", value)
        except InvalidRequest:
            return False
    return True


@settings(max_examples=500, deadline=None)
@given(st.lists(ids, max_size=12))
def test_ids_pass_is_check_id_on_every_id(values: list[str]) -> None:
    assert ids_pass(values) == each_passes(values)


# Characters that change how the text around them is shown: one id passing for another in a log
# line or a CRM screen (a right-to-left override, a line separator, a zero-width space, a tag).
INVISIBLE = ["\u202e", "\u2028", "\u2029", "\u200b", "\u200f", "\u2066", "\ufeff", "\u061c", "\U000e0041"]


@pytest.mark.parametrize("char", INVISIBLE, ids=[f"U+{ord(c):04X}" for c in INVISIBLE])
def test_an_id_holding_an_invisible_formatting_character_is_refused(char: str) -> None:
    with pytest.raises(InvalidRequest, match="control or invisible formatting characters") as refused:
        check_id("request_id", f"order{char}-1")
    assert refused.value.metadata == {"field": "request_id"}
    assert not ids_pass(["order-1", f"order{char}-1"])


def test_ids_in_any_script_pass() -> None:
    for value in ("é-1", "日本語-id", "заявка-7", "طلب-3", "ok-1"):
        check_id("request_id", value)
    assert ids_pass(["é-1", "日本語-id", "заявка-7", "طلب-3"])
