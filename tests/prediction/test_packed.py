"""The ledger's packed columns (``crm.packed.pack_column``): each value's own text, joined.

A column's values at any positions pack to the text PostgreSQL reads back as those values (text as
it is, float8 as ``repr`` writes it, int4 as ``str``); a text holding the separator, or no value
at all, cannot be packed; what a comprehension would refuse is refused.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlpair.prediction.recording import packed
from tests.support.ledger import float_sweep

awkward_texts = st.one_of(
    st.text(max_size=12), st.sampled_from(['"', "\\", "\x00", "\x1f", "\x7f", "\u2028", 'é"\\n', "\b\f\n\r\t", "😀"])
)
packable = {
    "text": st.lists(awkward_texts, max_size=12),
    "float8": st.lists(st.one_of(st.none(), st.floats(), st.integers(-(2**60), 2**60)), max_size=12),
    "int4": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12),
}
TEXT_OF = {"text": lambda v: v, "float8": lambda v: "" if v is None else repr(float(v)), "int4": str}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), sql_type=st.sampled_from(sorted(packable)))
def test_a_packed_column_splits_back_into_each_values_own_text(data, sql_type) -> None:
    """The values at any positions (repeated, out of order, none) of a text, float8 (None and
    ints among floats, NaN, infinities, -0.0) or int4 column."""
    values = data.draw(packable[sql_type])
    order = data.draw(st.lists(st.integers(0, len(values) - 1), max_size=15)) if values else []
    taken = [TEXT_OF[sql_type](values[i]) for i in order]
    if any(packed.SEP in t for t in taken) or not order:  # no value: refused, as its text would be one ""'s
        with pytest.raises(packed.Unpackable):
            packed.pack_column(values, order, sql_type)
    else:
        assert packed.pack_column(values, order, sql_type).split(packed.SEP)[1:] == taken


def test_a_packed_column_refuses_what_the_comprehension_refuses() -> None:
    """A text column holding a number, a float8 value float() refuses and a position outside the column."""
    with pytest.raises(TypeError):
        packed.pack_column(["a", 1.0], [0, 1], "text")
    with pytest.raises(ValueError):
        packed.pack_column(["x"], [0], "float8")
    with pytest.raises(IndexError):
        packed.pack_column(["a"], [1], "text")


@pytest.mark.parametrize("seed", [1, 2])
def test_packed_floats_are_their_repr(seed) -> None:
    values = float_sweep(seed, 100_000)
    column = packed.pack_column(values, list(range(len(values))), "float8")
    assert column.split(packed.SEP)[1:] == [repr(v) for v in values]


@settings(max_examples=500, deadline=None)
@given(st.integers(-(10**15), 10**15), st.integers(0, 20))
def test_any_short_decimal_is_written_as_repr_writes_it(digits, places) -> None:
    """Every decimal of at most 15 significant digits, at any place of its point."""
    value = digits / 10**places
    assert packed.pack_column([value], [0], "float8") == packed.SEP + repr(value)
