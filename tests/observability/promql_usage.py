"""Which series a PromQL expression reads and which of their labels it relies on.

Parsed with PromQL's own grammar (``promql-parser``), not by pattern: every vector selector, with
the labels its matchers name (a negative matcher relies on nothing), the ``by`` labels of the
aggregations above it, the ``on`` labels of the vector matches it takes part in, and ``le`` under
``histogram_quantile``. Label requirements flow down the way results are built: an aggregation
starts a fresh set (its ``by`` labels), a ``group_left`` match passes the outer requirements to
its many side only, and ``label_replace`` produces its destination label instead of needing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import promql_parser as pp


@dataclass(frozen=True)
class Use:
    """One vector selector of an expression."""

    name: str
    labels: frozenset[str]  # labels the expression needs on this selector's series

    def __str__(self) -> str:
        return f"{self.name}{{{', '.join(sorted(self.labels))}}}"


def uses(expr: str) -> list[Use]:
    """Every selector of ``expr`` and the labels it needs (see the module docstring).

    Raises:
        ValueError: ``expr`` is not valid PromQL.
    """
    found: list[Use] = []
    _walk(pp.parse(expr), frozenset(), found)
    return found


def _walk(node, needed: frozenset[str], found: list[Use]) -> None:
    kind = type(node).__name__
    if kind == "VectorSelector":
        own = {m.name for m in node.matchers.matchers
               if m.name != "__name__" and str(m.op) not in ("MatchOp.NotEqual", "MatchOp.NotRe")}
        found.append(Use(node.name, frozenset(needed | own)))
    elif kind == "MatrixSelector":
        _walk(node.vector_selector, needed, found)
    elif kind == "AggregateExpr":
        by = node.modifier is not None and str(node.modifier.type) == "AggModifierType.By"
        labels = frozenset(node.modifier.labels) if node.modifier is not None else frozenset()
        _walk(node.expr, labels if by else (needed - labels), found)
    elif kind == "BinaryExpr":
        modifier = node.modifier
        matching = frozenset(modifier.matching.labels) if modifier is not None and modifier.matching is not None \
            and str(modifier.matching.type) == "LabelModifierType.Include" else frozenset()
        card = str(modifier.card) if modifier is not None else ""
        left = needed | matching if "OneToMany" not in card else matching
        right = needed | matching if "ManyToOne" not in card else matching
        _walk(node.lhs, left, found)
        _walk(node.rhs, right, found)
    elif kind == "Call":
        name = node.func.name
        for i, arg in enumerate(node.args):
            if name == "histogram_quantile" and i == 1:
                _walk(arg, needed | {"le"}, found)
            elif name == "label_replace" and i == 0:
                _walk(arg, needed - {node.args[1].val if hasattr(node.args[1], "val") else ""}, found)
            else:
                _walk(arg, needed, found)
    elif kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
        _walk(node.expr, needed, found)
