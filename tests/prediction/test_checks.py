"""A whole call's ids checked at once (``ids_pass``) pass exactly when each passes ``check_id``.

BatchPredict checks the ids of a call of eight or more items with one pass per check
(``batch._families_at_once``) and falls back to ``check_id`` per item, for each item's own
error, only when that says no; so the two must agree on every list of ids.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlpair.prediction.checks import MAX_ID_LENGTH, check_id, ids_pass
from mlpair.prediction.errors import InvalidRequest

ids = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["", " ", "\t", "a\x00b", "a\x85", "ok-1", "x" * MAX_ID_LENGTH, "x" * (MAX_ID_LENGTH + 1), "é"]),
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
