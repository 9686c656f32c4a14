"""What a client may send for an attribute, as hypothesis strategies (assembly and fingerprint tests)."""

from __future__ import annotations

from hypothesis import strategies as st


def messy_values(feature) -> st.SearchStrategy:
    """What a client may send for one attribute: the wire's kinds, with what the guards and the
    conversion rules exist for (missing, sentinels, out of range, infinities, words, fractions)."""
    numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
        [0.0, 1.0, -1.0, 2.5, 1e30, -1e30, *getattr(feature, "sentinels", ())]))
    strings = st.one_of(st.sampled_from(["", " ", "42", " 7 ", "1e3", "nan", "yes", "No", "abc", "A11", " a12 "]),
                        st.text(max_size=6))
    return st.one_of(st.none(), numbers, strings, st.booleans(), st.just(["a list"]))  # a list: no rule takes it
